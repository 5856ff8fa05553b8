"""``TeacherMixture`` under tensor parallelism (gloo, 2 and 3 ranks; tests/support/mixture_workers.py):
uneven vocabulary shards of every teacher's head or logits, a whole top-k cache, sequence parallelism,
the linear and views forms equal to one device's loss and gradients (fp64, 1e-10); what is not built
yet (rows that mix teachers under "probabilities") raises on every rank."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("world_size", [2, 3])
def test_mixture_under_tensor_parallelism(world_size: int) -> None:
    from .support import mixture_workers
    from .support.distributed import run_distributed

    reports = run_distributed(world_size, mixture_workers.mixture_worker, timeout=300)
    problems = [f"rank {rank}: {p}" for rank, found in enumerate(reports) for p in found]
    assert not problems, "\n".join(problems[:40])
