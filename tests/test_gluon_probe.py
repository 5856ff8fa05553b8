"""The Gluon kernels of the gate probe (``benchmarks/gluon_exp_gemm.py``) compile for an H200 (sm_90)
on this CPU-only machine: ``benchmarks/gluon_probe.py --compile-only`` binds each variant's launch
arguments as a launch does and compiles them through Gluon's frontend and ``ptxas`` (in a subprocess
without ``TRITON_INTERPRET``). Gluon's API moves between Triton releases; this is where a change of
its signatures shows before a GPU run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_gluon_probe_variant_compiles_for_sm90() -> None:
    pytest.importorskip("triton")
    pytest.importorskip("triton.experimental.gluon", reason="this triton has no Gluon (triton.experimental.gluon)")
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this triton wheel has no CUDA backend")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    script = ROOT / "benchmarks" / "gluon_probe.py"
    command = [sys.executable, str(script), "--compile-only"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    report = result.stdout[-6000:] + result.stderr[-3000:]
    assert result.returncode == 0, report
    lines = result.stdout.splitlines()
    compiled = [line for line in lines if line.startswith("compiled")]
    assert lines[-1] == f"PASS: 0 of {len(compiled)} variant(s) failed for sm_90", report
    assert len(compiled) >= 6, report
    assert all("spills=0/0 B" in line for line in compiled), report
    # the warp-specialized variants: two consumer warpgroups and the producer's, registers traded
    pingpong = [line for line in compiled if "pingpong/" in line]
    assert pingpong and all("warps=12" in line and "232" in line for line in pingpong), report
