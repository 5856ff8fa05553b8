"""The TRL loss benchmark end to end on the CPU: ``benchmarks/trl_loss.py --small --masked-fraction 0.25``
in a subprocess, then its JSON rows: for β = 0, 0.5 and 1, orda_tp's TRL adapter and the direct
``distillation_loss`` call against TRL's own loss on the same inputs (loss, entropy sum, count and
the gradients' errors), compared here from the recorded numbers, so that this test fails even if
the script's own check were wrong."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO_ROOT / "benchmarks" / "trl_loss.py")
BETAS = (0.0, 0.5, 1.0)
ORDA_ROWS = ("orda_tp adapter", "orda_tp direct")
# --small is (B, K) = (2, 16); with a quarter masked the second completion keeps its first 8 positions.
IN_THE_LOSS = 16 + 8


def test_small_trl_loss_bench_matches_trl(tmp_path: Path) -> None:
    command = [sys.executable, SCRIPT, "--small", "--device", "cpu", "--masked-fraction", "0.25"]
    completed = subprocess.run(
        [*command, "--out", str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=240
    )
    assert completed.returncode == 0, (
        f"{command} exited {completed.returncode}:\n{completed.stdout}\n{completed.stderr}"
    )
    document = json.loads((tmp_path / "trl_loss.json").read_text())
    assert document["env"]["trl"] == "1.16.0", document["env"]
    record = document["trl_loss"]
    lines = [json.loads(line) for line in (tmp_path / "trl_loss.jsonl").read_text().splitlines()]
    assert lines == record["rows"]
    rows = {(row["beta"], row["impl"]): row for row in record["rows"]}
    assert record["n_valid"] == IN_THE_LOSS and rows[None, "GEMM-only (cuBLAS)"]["status"] == "ok"
    for beta in BETAS:
        trl = rows[beta, "TRL"]
        assert trl["status"] == "ok" and trl["n_valid"] == IN_THE_LOSS and trl["loss"] > 0 and trl["ms"] > 0, trl
        # The student's entropy does not depend on β.
        assert trl["entropy_sum"] == pytest.approx(rows[0.0, "TRL"]["entropy_sum"], rel=1e-6)
        for impl in ORDA_ROWS:
            row = rows[beta, impl]
            assert row["status"] == "ok" and row["check"]["ok"], row
            assert row["n_valid"] == IN_THE_LOSS, row
            assert abs(row["loss"] - trl["loss"]) <= 1e-5 * trl["loss"], (row, trl)
            assert abs(row["entropy_sum"] - trl["entropy_sum"]) <= 1e-5 * trl["entropy_sum"], (row, trl)
            errors = row["check"]["errors"]
            assert max(errors["dh"], errors["dW"]) <= 1e-4, row
            assert row["x_trl"] > 0 and row["x_gemm_only"] > 0, row
    # β reaches the loss: KL(teacher‖student), the JSD and KL(student‖teacher) differ.
    assert len({rows[beta, "TRL"]["loss"] for beta in BETAS}) == len(BETAS)
    # The targets are the adapter's, judged on a GPU only.
    assert [(t["beta"], t["what"]) for t in record["targets"]] == [
        (beta, what) for beta in BETAS for what in ("time", "peak memory")
    ]
    assert all(target["met"] is None for target in record["targets"]), record["targets"]
