"""Worker of tests/test_topk_temperature.py's tensor-parallel cases (importable by spawned ranks):
the temperature a top-k cache was made at, under ``tp_group``."""

from __future__ import annotations

import torch
import torch.distributed as dist

import orda_tp

from .tp_workers import chunk_ranges


def temperature_worker(rank: int, world: int) -> dict[str, object]:
    """Each rank holds its vocabulary shard of the student head and the whole cache: a cache made at
    the loss's temperature is read as it is (the single-device loss); a cut one read at another
    temperature raises the same error on every rank."""
    generator = torch.Generator().manual_seed(3)
    rows, hidden, vocab = 12, 8, 37
    student, head = (
        torch.randn(rows, hidden, generator=generator, dtype=torch.float64),
        torch.randn(vocab, hidden, generator=generator, dtype=torch.float64),
    )
    teacher_hidden = 3 * torch.randn(rows, hidden, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    start, stop = chunk_ranges(vocab, world)[rank]
    cache = orda_tp.teacher_topk(teacher_hidden, head, 6, temperature=2.0).teacher()
    keywords = dict(kl_weight=1.0, kl_temperature=2.0, backend="torch")
    local = orda_tp.distillation_loss(student, head[start:stop], labels, cache, tp_group=dist.group.WORLD, **keywords)
    alone = orda_tp.distillation_loss(student, head, labels, cache, **keywords)
    try:
        orda_tp.distillation_loss(student, head[start:stop], labels, cache, tp_group=dist.group.WORLD, kl_weight=1.0)
        error = ""
    except ValueError as raised:
        error = str(raised)
    return {"loss": float(local.loss), "alone": float(alone.loss), "error": error}
