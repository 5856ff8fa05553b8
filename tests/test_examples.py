"""The examples in examples/ run as their docstrings say, under torchrun on gloo, and pass their own
check against the single-process float64 computation."""

from __future__ import annotations

import re

from .test_launch import REPO_ROOT, run

TORCHRUN = ["-m", "torch.distributed.run", "--standalone"]


def torchrun(ranks: int, script: str, *args: str) -> str:
    import sys

    return run([sys.executable, *TORCHRUN, "--nproc-per-node", str(ranks), str(REPO_ROOT / script), *args])


def test_fsdp2_data_parallel() -> None:
    stdout = torchrun(2, "examples/fsdp2_distill.py", "--steps", "5")
    assert re.search(r"^mesh dp=2 tp=1: check PASS", stdout, flags=re.MULTILINE), stdout


def test_fsdp2_with_vocabulary_parallel_head_on_2d_mesh() -> None:
    stdout = torchrun(4, "examples/fsdp2_distill.py", "--tp", "2", "--steps", "5")
    assert re.search(r"^mesh dp=2 tp=2: check PASS", stdout, flags=re.MULTILINE), stdout
