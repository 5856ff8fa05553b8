"""``TeacherMixture``'s errors on one device: each names the argument (the fault-injection test
covers the same checks as tests/support/fault_cases.py's "mixture" faults); what is not built yet
raises and says so."""

from __future__ import annotations

import math

import pytest
import torch

import orda_tp

from .support.mixture_cases import ROWS, make_problem

PROBLEM = make_problem(3)
ARGS = PROBLEM.student_hidden, PROBLEM.weight, PROBLEM.labels
TIED, LOGITS = PROBLEM.teachers["tied"], PROBLEM.teachers["logits"]


def raises(mixture: orda_tp.TeacherMixture, error: type[Exception], match: str, **kwargs: object) -> None:
    with pytest.raises(error, match=match):
        orda_tp.distillation_loss(*ARGS, mixture, kl_weight=1.0, backend="torch", **kwargs)


def rows(fill: float, row: int = 4, column: int = 1, value: float = 0.0) -> torch.Tensor:
    weights = torch.full((ROWS, 2), fill, dtype=torch.float64)
    weights[row, column] = value
    return weights


@pytest.mark.parametrize(
    ("teachers", "error", "match"),
    [
        ([], TypeError, r"TeacherMixture.teachers must be a non-empty list"),
        ((TIED, "logits"), TypeError, r"TeacherMixture.teachers\[1\] must be a TiedTeacher"),
        ([orda_tp.TeacherMixture([TIED], [1.0])], TypeError, r"teachers\[0\] is a TeacherMixture"),
    ],
)
def test_teachers(teachers: list[object], error: type[Exception], match: str) -> None:
    raises(orda_tp.TeacherMixture(teachers, [1.0] * len(teachers)), error, match)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("weights", "combine", "error", "match"),
    [
        ([1.0], "divergences", ValueError, r"weights must be 2 numbers"),
        ([1.0, True], "divergences", TypeError, r"weights\[1\] must be a real number"),
        ([-1.0, 1.0], "log_probabilities", ValueError, r"weights\[0\] is -1.0: weights must be finite and >= 0"),
        ([math.inf, 1.0], "log_probabilities", ValueError, r"weights\[0\] is inf"),
        ([0.0, 0.0], "log_probabilities", ValueError, r"weights are all 0"),
        ([0.5, 0.6], "probabilities", ValueError, r"weights sums to 1.1.*must sum to 1"),
        (torch.ones(ROWS, 2, dtype=torch.int64), "divergences", TypeError, r"weights must be a floating-point"),
        (torch.ones(ROWS, 3), "divergences", ValueError, r"weights must have shape \(2,\).*or \(24, 2\)"),
        (torch.ones(ROWS, 2, requires_grad=True), "divergences", ValueError, r"weights must not require grad"),
        (rows(0.5, value=math.nan), "probabilities", ValueError, r"weights\[4, 1\] is nan"),
        (rows(0.5, value=-0.5), "log_probabilities", ValueError, r"weights\[4, 1\] is -0.5"),
        (rows(0.5, value=0.4), "probabilities", ValueError, r"weights\[4\] sums to 0.9"),
    ],
)
def test_weights(weights: object, combine: str, error: type[Exception], match: str) -> None:
    raises(orda_tp.TeacherMixture([TIED, LOGITS], weights, combine), error, "TeacherMixture." + match)  # type: ignore[arg-type]


def test_weights_on_another_device() -> None:
    mixture = orda_tp.TeacherMixture([TIED, LOGITS], torch.ones(ROWS, 2, dtype=torch.float64, device="meta"))
    raises(mixture, ValueError, r"teacher.weights")


def test_combine() -> None:
    raises(orda_tp.TeacherMixture([TIED], [1.0], "average"), ValueError, r"TeacherMixture.combine must be one of")


@pytest.mark.parametrize(
    ("teachers", "kwargs", "match"),
    [
        ([TIED], {"teacher_ce_weight": 0.5}, r"teacher_ce_weight=0.5 trains a teacher"),
        ([TIED], {"kl_divergence": "cojeffreys"}, r"kl_divergence='cojeffreys' co-trains the teacher"),
        (
            [orda_tp.TiedTeacher(TIED.hidden, mode="cotrained")],
            {},
            r"teachers\[0\] is a TiedTeacher\(mode='cotrained'\)",
        ),
    ],
)
def test_a_mixture_trains_no_teacher(teachers: list[object], kwargs: dict[str, object], match: str) -> None:
    raises(orda_tp.TeacherMixture(teachers, [1.0]), ValueError, match, **kwargs)  # type: ignore[arg-type]


def test_vocabularies_differ() -> None:
    narrow = orda_tp.SeparateTeacher(torch.randn(ROWS, 5, dtype=torch.float64), torch.randn(30, 5, dtype=torch.float64))
    raises(orda_tp.TeacherMixture([TIED, narrow], [0.5, 0.5]), ValueError, r"teacher.teachers\[1\].weight must have")


def test_each_teacher_is_checked_as_alone() -> None:
    topk = make_problem(4).teachers["topk"]
    renormalized = orda_tp.PrecomputedTeacher(
        topk_ids=topk.topk_ids, topk_logprobs=topk.topk_logprobs, tail="renormalize"
    )
    mixture = orda_tp.TeacherMixture([TIED, renormalized], [0.5, 0.5], "log_probabilities")
    raises(
        mixture, ValueError, r"TeacherMixture.teachers\[1\]: kl_divergence='reverse' is \+inf", kl_divergence="reverse"
    )
