"""examples/pipeline_distill.py under torchrun on gloo: two pipeline stages (torch.distributed.pipelining),
the loss on the last stage per micro-batch, checked against the unsplit model in float64; and the
check fails when the micro-batches are normalized the usual wrong way."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from .test_launch import REPO_ROOT, run

SCRIPT = str(REPO_ROOT / "examples" / "pipeline_distill.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
CHECK = re.compile(r"^pp=2 tp=(\d) teacher=(\w+) schedule=(\w+): check (PASS|FAIL) max_rel_err ([0-9.eE+-]+)$", re.M)


def torchrun(ranks: int, *args: str) -> list[str]:
    """The command line of the example on ``ranks`` processes (``--standalone`` picks a free port)."""
    return [*TORCHRUN, "--nproc-per-node", str(ranks), SCRIPT, *args]


def check_line(stdout: str) -> tuple[str, float]:
    """``(PASS or FAIL, max_rel_err)`` of the example's one check line."""
    found = CHECK.findall(stdout)
    assert len(found) == 1, stdout
    return found[0][3], float(found[0][4])


@pytest.mark.parametrize(
    "ranks, args",
    [
        (2, ["--teacher", "pipelined", "--schedule", "1f1b"]),
        (4, ["--teacher", "pipelined", "--schedule", "1f1b", "--tp", "2"]),
        (4, ["--teacher", "cached", "--schedule", "gpipe", "--tp", "2"]),
    ],
    ids=["pp2-pipelined-teacher-1f1b", "pp2-tp2-pipelined-teacher-1f1b", "pp2-tp2-cached-logits-gpipe"],
)
def test_pipelined_step_equals_unsplit_model(ranks: int, args: list[str]) -> None:
    stdout = run(torchrun(ranks, *args, "--steps", "3"))
    verdict, error = check_line(stdout)
    assert verdict == "PASS" and error <= 1e-12, stdout
    assert re.search(r"^step 3: loss [0-9.]+ \(last stage, 4 micro-batches\)$", stdout, re.M), stdout


def test_per_microbatch_means_fail_the_check() -> None:
    # Each micro-batch divided by its own valid count and the schedule averaging: the micro-batches'
    # counts differ, so the gradients are not the batch mean's and every rank exits 1.
    completed = subprocess.run(
        torchrun(2, "--per-microbatch-mean", "--steps", "1"), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode != 0, completed.stdout
    verdict, error = check_line(completed.stdout)
    assert verdict == "FAIL" and error > 1e-3, completed.stdout
