"""torch.autograd.gradcheck of the chunked backend on tiny fp64 problems, every variant.

Finite differences check the hand-derived gradients of both the eager ("mean": gradient formed
in the forward) and the deferred ("none": recomputed in backward) paths. Gradcheck needs the
gradient to be the derivative of the returned value, so:

- teacher-detached variants are checked w.r.t. the student's tensors with a constant teacher;
- cojeffreys (no detach) is checked w.r.t. student and teacher through one tied head;
- the teacher CE is checked on a tied head with no KL;
- mutual is left out: its gradient is by definition not the derivative of its value (stop-gradient
  on each side); tests/test_equivalence.py checks it against autograd of its objective.
"""

from __future__ import annotations

import pytest
import torch

import orda_tp
from orda_tp import KL_VARIANTS, KernelConfig, SeparateTeacher, TiedTeacher

from .support.cases import VARIANT_KWARGS

TINY = KernelConfig(chunk_size=orda_tp.ChunkSize(nrows=3), vocab_block=4)
ROWS, HIDDEN, VOCAB = 5, 3, 11


def tensors(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=torch.float64, generator=generator).requires_grad_()

    labels = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    labels[1] = -100
    return randn(ROWS, HIDDEN), randn(VOCAB, HIDDEN), randn(ROWS, HIDDEN), randn(VOCAB, HIDDEN), labels


def check(function, inputs) -> None:
    assert torch.autograd.gradcheck(function, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("variant", [v for v in KL_VARIANTS if v not in ("mutual", "cojeffreys")])
def test_gradcheck_student_side(variant: str, reduction: str) -> None:
    student_hidden, weight, teacher_hidden, teacher_weight, labels = tensors(11)
    teacher = SeparateTeacher(teacher_hidden.detach(), teacher_weight.detach())

    def loss(student_hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return orda_tp.distillation_loss(
            student_hidden,
            weight,
            labels,
            teacher,
            student_ce_weight=0.5,
            kl_weight=1.5,
            kl_temperature=1.7,
            kl_teacher_temperature=0.8,
            kl_divergence=variant,
            reduction=reduction,
            backend="torch",
            config=TINY,
            **VARIANT_KWARGS[variant],
        ).loss

    check(loss, (student_hidden, weight))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gradcheck_cojeffreys_trains_both_sides(reduction: str) -> None:
    student_hidden, weight, teacher_hidden, _, labels = tensors(12)

    def loss(student_hidden: torch.Tensor, weight: torch.Tensor, teacher_hidden: torch.Tensor) -> torch.Tensor:
        return orda_tp.distillation_loss(
            student_hidden,
            weight,
            labels,
            TiedTeacher(teacher_hidden),
            student_ce_weight=0.5,
            teacher_ce_weight=0.25,
            kl_weight=1.5,
            kl_temperature=1.7,
            kl_divergence="cojeffreys",
            reduction=reduction,
            backend="torch",
            config=TINY,
        ).loss

    check(loss, (student_hidden, weight, teacher_hidden))


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_gradcheck_teacher_cross_entropy_on_a_tied_head(reduction: str) -> None:
    student_hidden, weight, teacher_hidden, _, labels = tensors(13)

    def loss(student_hidden: torch.Tensor, weight: torch.Tensor, teacher_hidden: torch.Tensor) -> torch.Tensor:
        return orda_tp.distillation_loss(
            student_hidden,
            weight,
            labels,
            TiedTeacher(teacher_hidden),
            student_ce_weight=0.5,
            teacher_ce_weight=0.75,
            reduction=reduction,
            backend="torch",
            config=TINY,
        ).loss

    check(loss, (student_hidden, weight, teacher_hidden))
