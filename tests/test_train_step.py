"""The training-step benchmark on the CPU: ``benchmarks/train_step.py --small`` in a subprocess, its
own check, and each method's first-step loss and gradients against its task's reference, read from
its JSON lines (so this test fails even if the script's check were wrong). The on-policy task's
reference is TRL's own loss (``trl_onpolicy``), so ``orda_onpolicy`` is orda_tp's TRL adapter against it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO_ROOT / "benchmarks" / "train_step.py")
REFERENCE = {"CE": "hf", "KD": "logits_kd", "on-policy": "trl_onpolicy"}
# Need no GPU (trl is a test extra): no skip allowed.
ALWAYS_RUN = {"hf", "orda", "logits_kd", "orda_teacher_head", "orda_topk", "trl_onpolicy", "orda_onpolicy"}


def test_small_train_step_matches_references(tmp_path: Path) -> None:
    command = [sys.executable, SCRIPT, "--small", "--out", str(tmp_path)]
    completed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, (
        f"{command} exited {completed.returncode}:\n{completed.stdout}\n{completed.stderr}"
    )
    assert "check PASS" in completed.stdout.splitlines(), completed.stdout
    lines = [json.loads(line) for line in (tmp_path / "train_step.jsonl").read_text().splitlines()]
    assert lines[0]["environment"]["transformers"], lines[0]
    records = {r["method"]: r for r in lines[1:]}
    assert ALWAYS_RUN <= {name for name, r in records.items() if r["status"] == "ok"}, records
    for record in records.values():
        if record["status"] == "skipped":
            assert record["reason"], record
            continue
        assert record["status"] == "ok", record
        reference = records[REFERENCE[record["task"]]]
        assert abs(record["loss"] - reference["loss"]) <= 1e-5 * abs(reference["loss"]), (record, reference)
        # Timings on a shared CPU are noise (the loss alone can outlast a tiny model's step); only their
        # presence is checked here, their values come from the H200 runs in docs/benchmarks.md.
        assert record["step_ms"] > 0 and record["tokens_per_s"] > 0 and record["loss_ms"] > 0, record
        for name, error in record["grad_rel_err"].items():
            assert error <= 1e-4, (record["method"], name, error)
