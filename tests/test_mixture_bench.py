"""The TeacherMixture benchmark end to end on the CPU: ``benchmarks/mixture.py --small`` in a subprocess,
then its JSON rows: every row measured, each one that calls orda_tp checked against the fp32 oracle, and
the recorded losses compared here (the dense "divergences" mixture against the separate calls, each row
against its oracle, the three modes on one-hot rows against each other), so that this test fails even if
the script's own check were wrong."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO_ROOT / "benchmarks" / "mixture.py")
MODES = ("divergences", "probabilities", "log_probabilities")
SHARED = ("GEMM-only (cuBLAS)", "GEMM-only (cuBLAS), routed", "n separate calls")
PER_MODE = ("orda_tp mixture", "routed", "routed, scattered")


def test_small_mixture_bench_matches_its_oracle(tmp_path: Path) -> None:
    command = [sys.executable, SCRIPT, "--small", "--device", "cpu"]
    completed = subprocess.run(
        [*command, "--out", str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=240
    )
    assert completed.returncode == 0, (
        f"{command} exited {completed.returncode}:\n{completed.stdout}\n{completed.stderr}"
    )
    record = json.loads((tmp_path / "mixture.json").read_text())["mixture"]
    lines = [json.loads(line) for line in (tmp_path / "mixture.jsonl").read_text().splitlines()]
    assert lines == record["rows"] and record["not_run"] == []
    rows = {(row["mode"], row["impl"]): row for row in record["rows"]}
    expected = [(None, impl) for impl in SHARED] + [(mode, impl) for mode in MODES for impl in PER_MODE]
    assert sorted(rows, key=str) == sorted(expected, key=str)
    assert all(row["status"] == "ok" and row["ms"] > 0 for row in rows.values()), record["rows"]
    separate = rows[None, "n separate calls"]
    for key, row in rows.items():
        if key[1].startswith("GEMM-only"):
            continue
        errors = row["check"]["errors"]
        assert row["check"]["ok"] and max(errors["loss"], errors["dh"], errors["dW"]) <= 1e-5, row
        assert row["loss"] == pytest.approx(row["exact_loss"], rel=1e-5), row
        assert row["x_gemm_only"] > 0, row
    # "divergences" is the sum of the separate calls; its check compared the two.
    divergences = rows["divergences", "orda_tp mixture"]
    assert divergences["loss"] == pytest.approx(separate["loss"], rel=1e-5)
    assert divergences["check"]["errors"]["separate"] <= 1e-5
    # Dense weights: the modes differ (Σ w·KL(q_i‖p) ≥ KL(Σ w·q_i‖p) by convexity); one-hot rows: one loss.
    dense = [rows[mode, "orda_tp mixture"]["loss"] for mode in MODES]
    assert len(set(dense)) == len(MODES) and dense[0] > dense[1]
    for impl in ("routed", "routed, scattered"):
        losses = [rows[mode, impl]["loss"] for mode in MODES]
        assert losses == pytest.approx([losses[0]] * len(MODES), rel=1e-6), (impl, losses)
    # The targets are judged on a GPU only.
    assert len(record["targets"]) == 4 * len(MODES)
    assert all(target["met"] is None and target["ratio"] > 0 for target in record["targets"]), record["targets"]
