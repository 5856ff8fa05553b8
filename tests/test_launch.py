"""End-to-end runs of the main job, ``launch/distill.py`` (one plain process, and a 2-rank torchrun job
with vocab-parallel heads on gloo), and of the memory measurement ``benchmarks/measure_memory.py``,
each in a subprocess with small settings."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DISTILL = str(REPO_ROOT / "launch" / "distill.py")
MEASURE_MEMORY = str(REPO_ROOT / "benchmarks" / "measure_memory.py")
SMALL_DEMO = [
    "--steps", "40", "--teacher-steps", "30", "--batch", "16", "--seq", "32", "--vocab", "256",
    "--teacher-hidden", "64", "--student-hidden", "32", "--lr", "1e-2", "--log-every", "10",
]  # fmt: skip
FLOAT = r"([0-9.eE+-]+)"


def run(command: list[str]) -> str:
    """Run ``command`` from the repository root; assert it exits 0 and return its stdout."""
    completed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, (
        f"{command} exited {completed.returncode}:\n{completed.stdout}\n{completed.stderr}"
    )
    return completed.stdout


def assert_demo_succeeded(stdout: str) -> None:
    """The bodies stayed replicated, the fused-vs-unfused check passed, and the logged student loss and
    CE fell clearly."""
    replicated = re.search(rf"^replicated bodies (PASS|FAIL): checksum max-min {FLOAT} ", stdout, flags=re.MULTILINE)
    assert replicated is not None and replicated.group(1) == "PASS", stdout
    assert float(replicated.group(2)) == 0.0, stdout
    check = re.search(rf"^check (PASS|FAIL) max_rel_err {FLOAT} tol {FLOAT}", stdout, flags=re.MULTILINE)
    assert check is not None, stdout
    assert check.group(1) == "PASS", stdout
    assert float(check.group(2)) <= float(check.group(3)) <= 1e-5, stdout
    student_ce = [float(value) for value in re.findall(rf"^student step .*\| student_ce {FLOAT} \|", stdout, re.M)]
    assert len(student_ce) >= 3, stdout
    assert student_ce[-1] < 0.8 * student_ce[0], f"student CE did not fall: {student_ce}"
    loss = [float(value) for value in re.findall(rf"^student step .*\| loss {FLOAT} \|", stdout, re.M)]
    assert len(loss) == len(student_ce), stdout
    assert loss[-1] < 0.85 * loss[0] and loss[-1] < min(loss[:2]), f"student loss did not fall: {loss}"
    assert re.search(r"^summary: .* check PASS$", stdout, flags=re.MULTILINE), stdout


def test_distill_demo_single_process() -> None:
    assert_demo_succeeded(run([sys.executable, DISTILL, *SMALL_DEMO]))


def test_distill_job_two_ranks_vocab_parallel() -> None:
    # --standalone rendezvous picks a free port itself. Vocab 255 pads to 256: rank 1 holds the padding row.
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    stdout = run([*torchrun, DISTILL, *SMALL_DEMO, "--vocab", "255", "--kl-divergence", "reverse"])
    assert re.search(r"^distill: world_size 2 device cpu process_group gloo ", stdout, flags=re.MULTILINE), stdout
    assert "vocab 255 padded to 256 = 2 x 128 rows" in stdout, stdout
    assert_demo_succeeded(stdout)


def test_measure_memory_chunked_below_quarter_of_reference() -> None:
    # The default 64 MiB workspace would hold all 1024 rows of this small shape in one chunk; 2 MiB gives
    # 64-row chunks (1/16 of the rows; the default budget at the default shape gives 512 of 4096 rows).
    stdout = run(
        [
            sys.executable, MEASURE_MEMORY, "--bt", "1024", "--vocab", "8192", "--hidden", "64",
            "--kl-divergence", "forward", "--workspace-mib", "2", "--max-ratio", "0.25",
        ]
    )  # fmt: skip
    ratio = re.search(rf"^ratio forward: torch/reference = {FLOAT} \(limit", stdout, flags=re.MULTILINE)
    assert ratio is not None, stdout
    assert float(ratio.group(1)) < 0.25, stdout
