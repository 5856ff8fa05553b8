"""The tensor-parallel contract simulated in one process.

The vocabulary is split into uneven column blocks; each block's record is computed alone, the
records are merged in shuffled order, and the rows' values and logit gradients equal the
reference for every variant. The records also survive packing into the one (rows, K) tensor
that ranks exchange.
"""

from __future__ import annotations

import random

import pytest
import torch

from orda_tp import KL_VARIANTS, TiedTeacher
from orda_tp.arguments.options import LossOptions
from orda_tp.arguments.plan import LossPlan
from orda_tp.engine.call import Call
from orda_tp.engine.logits import LogitGrads, LogitsBlock
from orda_tp.engine.records import merge_stacked_records, packed_columns
from orda_tp.engine.reference import reference_loss
from orda_tp.engine.row_walk import GradTarget, chunk_row_stats, stage_grads
from orda_tp.engine.torch_math import TorchBlockMath
from orda_tp.parallel.layout import VocabLayout

from .support.cases import COTRAINED, VARIANT_KWARGS, relative_error

BOUNDARIES = [0, 5, 6, 50, 51, 120, 203]  # blocks of 5, 1, 44, 1, 69 and 83 columns


def make_plan(variant: str, vocab: int, teacher: TiedTeacher):
    options = LossOptions(
        student_ce_weight=0.6,
        teacher_ce_weight=0.3,
        kl_weight=1.2,
        kl_temperature=1.8,
        kl_teacher_temperature=None if variant in COTRAINED else 1.3,
        kl_divergence=variant,
        ignore_index=-100,
        reduction="sum",
        backend="torch",
        **{key: VARIANT_KWARGS[variant].get(key) for key in ("kl_alpha", "kl_beta", "entropy_gate")},
    )
    return LossPlan.build(options, teacher, vocab)


@pytest.mark.parametrize("in_one_walk", [False, True], ids=["statistics-then-gradients", "one-walk"])
@pytest.mark.parametrize("variant", KL_VARIANTS)
def test_shuffled_uneven_blocks_merge_to_the_reference(variant: str, in_one_walk: bool) -> None:
    """Statistics and logit gradients of shuffled uneven blocks against the fp64 reference, the
    gradients formed after the statistics (the deferred path) or in the same walk (the eager
    path, where ``forward`` and ``mutual`` sum round 2 in their gradient pass)."""
    generator = torch.Generator().manual_seed(5)
    rows, vocab = 9, BOUNDARIES[-1]
    # With hidden = logits and weight = identity, the reference's hidden gradients are the
    # logit gradients.
    student = (2 * torch.randn(rows, vocab, dtype=torch.float64, generator=generator)).requires_grad_()
    teacher = (2 * torch.randn(rows, vocab, dtype=torch.float64, generator=generator)).requires_grad_()
    identity = torch.eye(vocab, dtype=torch.float64)
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    plan = make_plan(variant, vocab, TiedTeacher(teacher))
    assert plan.kl_sums_in_gradient_pass == (variant in ("forward", "mutual"))

    layout = VocabLayout(
        vocab_start=0,
        vocab_stop=vocab,
        total_columns=vocab,
        vocab_size=vocab,
        max_local_columns=vocab,
        local_columns=vocab,
        real_local_columns=vocab,
    )
    call = Call(plan, layout, TorchBlockMath(), None, labels, torch.ones(rows, dtype=torch.bool))
    expected = reference_loss(call, student, identity, teacher, None, None)
    expected_student_grad, expected_teacher_grad = torch.autograd.grad(expected[0], (student, teacher))

    blocks = [
        LogitsBlock(start, stop, student.detach()[:, start:stop], teacher.detach()[:, start:stop])
        for start, stop in zip(BOUNDARIES[:-1], BOUNDARIES[1:])
    ]
    random.Random(variant).shuffle(blocks)
    student_grad = torch.zeros_like(student)
    teacher_grad = torch.zeros_like(teacher)
    target = GradTarget(LogitGrads(student_grad, teacher_grad), 0, torch.ones((), dtype=torch.float64))
    if in_one_walk:
        stats = chunk_row_stats(call, blocks, labels, student, (target, 0, rows))
    else:
        stats = chunk_row_stats(call, blocks, labels, student)
        stage_grads(call, blocks, labels, stats.gradient_inputs(), (target, 0, rows), student)
    for actual, reference in zip((stats.student_ce, stats.teacher_ce, stats.kl), expected[1:]):
        assert relative_error(actual.sum(), reference) <= 1e-12
    assert relative_error(student_grad, expected_student_grad) <= 1e-12
    assert relative_error(teacher_grad, expected_teacher_grad) <= 1e-12


def columns_of(record: torch.Tensor, num_families: int) -> dict[str, torch.Tensor]:
    """A packed record's columns by name."""
    return dict(zip(packed_columns(num_families, record.shape[1] - 2 * num_families - 3), record.unbind(1)))


def test_records_merge_in_any_order() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(6, 40, dtype=torch.float64, generator=generator)
    logits[2, :20] = float("-inf")  # a block that sees only -inf on one row
    labels = torch.randint(0, 40, (6,), generator=generator)
    plan = make_plan("forward", 40, TiedTeacher(logits))
    records = [
        TorchBlockMath().partition(logits[:, a:b], logits[:, a:b], labels, a, plan.families)
        for a, b in [(0, 20), (20, 27), (27, 40)]
    ]
    families = len(plan.families)
    expected = torch.stack([torch.logsumexp(logits / f.temperature, 1) for f in plan.families], 1)
    for order in (records, records[::-1], [records[1], records[0], records[2]]):
        merged = columns_of(merge_stacked_records(torch.stack(order), families), families)
        lse = torch.stack([merged[f"m{f}"] + torch.log(merged[f"z{f}"]) for f in range(families)], 1)
        assert relative_error(lse, expected) <= 1e-14
        assert torch.equal(merged["hits"], torch.ones(6, dtype=torch.float64))
        assert torch.equal(merged["s_y"], logits.gather(1, labels[:, None]).squeeze(1))
        assert torch.equal(merged["t_y"], merged["s_y"])
