"""The triton backend writes no file on its default path (``checks/kernel_files.py``, the GPU probe,
run here under Triton's CPU interpreter at tiny shapes): every kind of generated function is built
and runs from memory, each call matches the fp64 reference, and nothing appears under an empty home
or under ``orda_tp/``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_kernel_files_probe_passes_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    script = ROOT / "checks" / "kernel_files.py"
    environment = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", "--small"],
        capture_output=True,
        text=True,
        timeout=600,
        env=environment,
    )
    lines = result.stdout.splitlines()
    report = result.stdout[-6000:] + result.stderr[-3000:]
    assert result.returncode == 0 and lines[-1] == "PASS", report
    cases = [line for line in lines if line.startswith(("ok", "FAIL"))]
    assert len(cases) == 6 and all(line.startswith("ok") for line in cases), report
    assert "files under the temporary home: none" in lines, report
    assert "files written or changed under orda_tp/: none" in lines, report
