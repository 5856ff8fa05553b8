"""``TeacherMixture`` under tensor parallelism (gloo, 2 and 3 ranks; tests/support/mixture_workers.py):
uneven vocabulary shards of every teacher's head or logits, a whole top-k cache, sequence parallelism:
every form (linear, mixed, views) equal to one device's loss and gradients (fp64, 1e-10)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("world_size", [2, 3])
def test_mixture_under_tensor_parallelism(world_size: int) -> None:
    from .support import mixture_workers
    from .support.distributed import run_distributed

    reports = run_distributed(world_size, mixture_workers.mixture_worker, timeout=300)
    problems = [f"rank {rank}: {p}" for rank, found in enumerate(reports) for p in found]
    assert not problems, "\n".join(problems[:40])


def test_collectives_of_a_mixture_call() -> None:
    """A mixture call of any form makes as many collectives as the one-teacher call with the same
    chunks (the teachers' statistics travel in the same record exchanges: round 1 once per chunk,
    round 2 once per chunk, the hidden gradient's sums per row group, the handshake), and one more
    under sequence parallelism (the teachers' hidden rows, gathered in one all-gather). The count
    is docs/architecture.md's ``2 + 2·chunks + row groups`` (+1 row gather, 1 reduce-scatter)."""
    from orda_tp.engine.workspace import CHUNKS_PER_GROUP

    from .support import mixture_workers
    from .support.distributed import run_distributed
    from .support.mixture_cases import ROWS
    from .support.tp_workers import TP_CHUNKS

    chunks = -(-ROWS // TP_CHUNKS.chunk_size.nrows)
    groups = -(-chunks // CHUNKS_PER_GROUP)
    for report in run_distributed(2, mixture_workers.counting_worker, timeout=300):
        for name, counts in report.items():
            sequence_parallel = name.endswith("sequence parallel")
            one_teacher = 2 + 2 * chunks + (2 if sequence_parallel else groups)
            assert report["one teacher" + name.removeprefix(name.split(" / ")[0])] == [one_teacher] * 2, report
            expected = one_teacher + (1 if sequence_parallel and name.split(" / ")[0] != "one teacher" else 0)
            assert counts == [expected, expected], f"{name}: {counts} collectives, expected {expected}"


def test_host_reads_of_a_mixture_call() -> None:
    """With host checks off (a CUDA call's default) a mixture of teachers read through heads, its
    weights n numbers, reads on the host exactly what one such teacher's call reads (the ranks'
    claims): no value check, no error columns. A mixture holding a cache adds the exchanged error
    columns' one read, as a cache alone does."""
    from dataclasses import fields

    from orda_tp.parallel.layout import ShardClaim

    from .support import mixture_workers
    from .support.distributed import run_distributed

    claims, errors = ("tolist", (2, len(fields(ShardClaim)))), ("tolist", (2, 3))
    for report in run_distributed(2, mixture_workers.host_reads_worker, timeout=300):
        assert report == {"one head": [claims], "heads": [claims], "heads and a cache": [claims, errors]}, report


@pytest.mark.parametrize("world_size", [2, 3])
def test_mixture_on_padded_shards_and_dtensors(world_size: int) -> None:
    from .support import mixture_workers
    from .support.distributed import run_distributed

    reports = run_distributed(world_size, mixture_workers.padded_and_dtensor_worker, timeout=300)
    problems = [f"rank {rank}: {p}" for rank, found in enumerate(reports) for p in found]
    assert not problems, "\n".join(problems[:40])
