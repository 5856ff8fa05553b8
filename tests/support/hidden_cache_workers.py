"""Worker of tests/test_hidden_cache.py's tensor-parallel case (importable by spawned ranks): every
rank reads the same rows of a hidden-state cache and holds its vocabulary shard of the teacher's
head; the loss is the single-device loss, and the student head's gradient its shard's slice."""

from __future__ import annotations

import torch
import torch.distributed as dist

import orda_tp
from orda_tp.topk_cache import HiddenCacheReader

from .tp_workers import chunk_ranges


def hidden_cache_worker(rank: int, world: int, directory: str, seed: int) -> dict[str, object]:
    generator = torch.Generator().manual_seed(seed)
    rows, hidden, wide, vocab = 20, 8, 12, 41
    student = torch.randn(rows, hidden, generator=generator, dtype=torch.float64)
    head = torch.randn(vocab, hidden, generator=generator, dtype=torch.float64)
    teacher_head = torch.randn(vocab, wide, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    start, stop = chunk_ranges(vocab, world)[rank]
    reader = HiddenCacheReader(directory)
    keywords = dict(kl_weight=1.0, kl_temperature=2.0, kl_divergence="reverse", backend="torch")
    local_head = head[start:stop].clone().requires_grad_()
    teacher = reader.teacher(0, rows, teacher_head[start:stop])
    out = orda_tp.distillation_loss(student, local_head, labels, teacher, tp_group=dist.group.WORLD, **keywords)
    out.loss.backward()
    full_head = head.clone().requires_grad_()
    alone = orda_tp.distillation_loss(student, full_head, labels, reader.teacher(0, rows, teacher_head), **keywords)
    alone.loss.backward()
    assert local_head.grad is not None and full_head.grad is not None
    gap = float((local_head.grad - full_head.grad[start:stop]).abs().max())
    return {"loss": float(out.loss), "alone": float(alone.loss), "grad_gap": gap}
