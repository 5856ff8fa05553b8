"""Worker of tests/test_topk_teacher.py's tensor-parallel case (importable by spawned ranks).

Every rank holds the whole top-k cache (global ids, like the labels) and its own vocabulary shard
of the student head (``distillation_loss``) or of the student logits (``KDLoss``); the call must
equal the single-device call (fp64 ≤ 1e-12, fp32 ≤ 1e-6), bitwise across ranks for
``distillation_loss``, with each rank's head or logit gradient the slice of the full one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import orda_tp

from .cases import VARIANT_KWARGS, make_problem, relative_error
from .topk_cases import topk_of
from .tp_workers import chunk_ranges, rank_disagreement

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-6}


def topk_worker(rank: int, world: int) -> list[str]:
    """Both tails, a few variants, padded and unpadded vocabularies, fp64 and fp32, the torch and
    (fp32) Triton backends."""
    problems: list[str] = []
    config = orda_tp.KernelConfig(chunk_size=orda_tp.ChunkSize(nrows=5), vocab_block=64)
    cases = [
        ("forward", "uniform", torch.float64, "torch", None),
        ("skew_js", "renormalize", torch.float64, "torch", 190),
        ("reverse", "uniform", torch.float32, "torch", 190),
        ("dkd", "renormalize", torch.float32, "triton", None),
        ("abkd", "uniform", torch.float32, "triton", 190),
    ]
    for variant, tail, dtype, backend, vocab_size in cases:
        label = f"{variant}/{tail}/{str(dtype)[6:]}/{backend}/vocab_size={vocab_size}"
        full = make_problem(rows=18, vocab=203, seed=11).to(dtype)
        if vocab_size is not None:
            full.labels[full.labels >= vocab_size] = 0
        ids, logprobs = topk_of(full.teacher_logits, 9, vocab_size)
        teacher = orda_tp.PrecomputedTeacher(topk_ids=ids, topk_logprobs=logprobs, tail=tail, retemper=True)
        kwargs = dict(
            kl_weight=1.0, kl_divergence=variant, kl_temperature=1.5, backend=backend, config=config,
            vocab_size=vocab_size, **VARIANT_KWARGS[variant],
        )  # fmt: skip
        expected = orda_tp.distillation_loss(full.student_hidden, full.weight, full.labels, teacher, **kwargs)
        expected_grads = torch.autograd.grad(expected.loss, [full.student_hidden, full.weight])
        start, stop = chunk_ranges(203, world)[rank]
        hidden = full.student_hidden.detach().clone().requires_grad_()
        weight = full.weight.detach()[start:stop].clone().requires_grad_()
        out = orda_tp.distillation_loss(hidden, weight, full.labels, teacher, tp_group=dist.group.WORLD, **kwargs)
        grads = torch.autograd.grad(out.loss, [hidden, weight])
        problems += rank_disagreement(label, out, 18, dist.group.WORLD)
        pairs = [*zip(out, expected), (grads[0], expected_grads[0]), (grads[1], expected_grads[1][start:stop])]
        for index, (actual, want) in enumerate(pairs):
            if (error := relative_error(actual, want)) > TOLERANCE[dtype]:
                problems.append(f"{label}: output {index} relative error {error:.2e}")
        problems += _kdloss_problems(label, full.teacher_logits, teacher, kwargs, (start, stop))
    return problems + _bad_cache_problems(rank, world)


def _bad_cache_problems(rank: int, world: int) -> list[str]:
    """A cache with an id past the vocabulary raises the same ValueError on every rank (no hang)."""
    full = make_problem(rows=6, vocab=203, seed=2)
    ids, logprobs = topk_of(full.teacher_logits, 4)
    ids[3, 1] = 203
    teacher = orda_tp.PrecomputedTeacher(topk_ids=ids, topk_logprobs=logprobs, retemper=True)
    start, stop = chunk_ranges(203, world)[rank]
    try:
        weight = full.weight.detach()[start:stop]
        orda_tp.distillation_loss(
            full.student_hidden.detach(), weight, full.labels, teacher, kl_weight=1.0, tp_group=dist.group.WORLD
        )
    except ValueError as error:
        return [] if "topk_ids must lie in [0, 203)" in str(error) else [f"bad cache: other error {error}"]
    return ["bad cache: no error"]


def _kdloss_problems(
    label: str, logits: torch.Tensor, teacher: orda_tp.PrecomputedTeacher, kwargs: dict[str, object],
    columns: tuple[int, int],
) -> list[str]:  # fmt: skip
    """KDLoss with the same cache on this rank's student logit columns against the single-device
    KDLoss (no padding: KDLoss's logits hold the real vocabulary)."""
    if kwargs["vocab_size"] is not None:
        return []
    variant = str(kwargs["kl_divergence"])
    keywords = dict(kl_divergence=variant, chunk_size=5, backend=kwargs["backend"], **VARIANT_KWARGS[variant])
    generator = torch.Generator().manual_seed(3)
    student = (torch.randn(logits.shape, generator=generator, dtype=torch.float64) * 2).to(logits.dtype)
    labels = torch.randint(0, logits.shape[1], (logits.shape[0],), generator=generator)
    weights = torch.rand(labels.shape, generator=generator, dtype=torch.float64)  # token weights too
    full = student.clone().requires_grad_()
    expected = orda_tp.KDLoss(**keywords)(full, teacher, labels, token_weights=weights)  # type: ignore[arg-type]
    (expected_grad,) = torch.autograd.grad(expected, full)
    local = student[:, columns[0] : columns[1]].clone().requires_grad_()
    sharded = orda_tp.KDLoss(tp_group=dist.group.WORLD, **keywords)  # type: ignore[arg-type]
    loss = sharded(local, teacher, labels, token_weights=weights)
    (grad,) = torch.autograd.grad(loss, local)
    problems = []
    pairs = ((loss, expected), (grad, expected_grad[:, columns[0] : columns[1]]))
    for name, (actual, want) in zip(("KDLoss loss", "KDLoss grad"), pairs):
        if (error := relative_error(actual, want)) > TOLERANCE[student.dtype]:
            problems.append(f"{label}: {name} relative error {error:.2e}")
    return problems
