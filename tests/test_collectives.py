"""The tensor-parallel collectives (orda_tp/parallel/collectives.py) on 2 gloo ranks: what a call
leaves to the process group, and which torch.distributed names it uses. Workers are in
tests/support/collective_workers.py."""

from __future__ import annotations

import torch.distributed as dist

from orda_tp.parallel import collectives

from .support import collective_workers
from .support.distributed import run_distributed

TIMEOUT_S = 120.0


def test_no_tensor_left_with_the_process_group() -> None:
    """After the forward and after the backward of a call (eager and deferred gradients, sequence
    parallel, KDLoss), every tensor it handed to a collective is released: nothing of the call is
    left for a gloo worker thread to drop later, possibly while the interpreter exits (the abort
    that tests/test_clean_exit.py reproduces under load). A forward without its backward leaves
    no gradient sum in flight either."""
    results = run_distributed(2, collective_workers.lent_tensors_worker, timeout=TIMEOUT_S)
    problems = [f"rank {rank}: {problem}" for rank, found in enumerate(results) for problem in found]
    assert not problems, "\n".join(problems)


def test_no_deprecated_collective() -> None:
    """The same calls, forward and backward, raise no FutureWarning or DeprecationWarning (made
    errors): all_gather_single where torch has it."""
    results = run_distributed(2, collective_workers.warnings_worker, timeout=TIMEOUT_S)
    problems = [f"rank {rank}: {problem}" for rank, found in enumerate(results) for problem in found]
    assert not problems, "\n".join(problems)


def test_current_collective_names() -> None:
    """The collectives use torch's current names where it has them (the old ones warn), the old
    ones otherwise (torch before the rename; the NCCL reduce-scatter of sequence parallelism,
    which gloo replaces by an all-reduce, is covered by this alone)."""
    expected = {
        "all_gather_single": getattr(dist, "all_gather_single", dist.all_gather_into_tensor),
        "reduce_scatter_single": getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor),
    }
    for name, function in expected.items():
        assert getattr(collectives, name) is function, name
