"""The student's row terms: per-row losses ``L(s)`` of the student's own logits (temperature 1), each
written once as row formulas that every backend runs, with a column gradient of one form,

    ∂L/∂s_j = c_p·softmax(s)_j − c_y·[j = y] − c_u        (j over the real vocabulary),

and an oracle from its textbook definition for the reference backend (docs/architecture.md, "… a
loss term of the student's logits"). :data:`STUDENT_TERMS` orders the output components.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import ClassVar

import torch
from torch import Tensor

from .expr import Expr, row, wrap

__all__ = [
    "COMPONENTS",
    "RAW_STUDENT",
    "RAW_TEACHER",
    "STUDENT_TERMS",
    "CrossEntropy",
    "RowSymbols",
    "SoftmaxGrad",
    "StudentTerm",
    "ZLoss",
    "column_sums_of",
]

#: The column symbol of the student's raw logit ``s_j``, read by the terms' column sums.
RAW_STUDENT = Expr("column", value="s")
#: The column symbol of the teacher's raw logit ``t_j`` (−inf without a teacher), which a column sum
#: of round 1 may read besides ``s_j`` (``orda_tp.arguments.plan.UNSUPPORTED``).
RAW_TEACHER = Expr("column", value="t")


@dataclass(frozen=True)
class RowSymbols:
    """What a term's row value reads: ``lse = LSE(s)``, ``label_logit = s_y`` and ``sums``, the
    row's totals of the term's own :meth:`StudentTerm.column_sums`, in their order."""

    lse: Expr
    label_logit: Expr
    sums: tuple[Expr, ...]


@dataclass(frozen=True)
class SoftmaxGrad:
    """A term's column gradient, the module's form, as row formulas of ``LSE(s)`` and the scalars."""

    softmax: Expr
    label: Expr
    uniform: Expr


@dataclass(frozen=True)
class StudentTerm:
    """One per-row loss ``L(s)`` of the student's logits, weighted by the keyword ``weight``.

    ``name``: its output component; ``parameters``: the keywords it reads as runtime scalars
    (``row(keyword)`` in its formulas); ``given``: those that are nonzero in this call.
    """

    name: ClassVar[str]
    weight: ClassVar[str]
    parameters: ClassVar[tuple[str, ...]] = ()
    given: frozenset[str] = frozenset()

    def column_sums(self) -> tuple[Expr, ...]:
        """Column terms ``f(s_j)`` over ``RAW_STUDENT`` whose row sums the value reads."""
        return ()

    def value(self, x: RowSymbols) -> Expr:
        """The row's unweighted value ``L``."""
        raise NotImplementedError

    def grad(self, lse: Expr) -> SoftmaxGrad:
        """``∂L/∂s_j`` as ``(c_p, c_y, c_u)``."""
        raise NotImplementedError

    def oracle(self, logits: Tensor, labels: Tensor, scalars: Mapping[str, float]) -> Tensor:
        """``L`` per row from its definition, on full (rows, V) logits (the reference backend)."""
        raise NotImplementedError


@dataclass(frozen=True)
class CrossEntropy(StudentTerm):
    """``LSE(s) − (1−ε)·s_y − ε·Σ_j s_j / V`` (``ε = label_smoothing``, as ``F.cross_entropy``'s; the
    plain CE at 0): ``c_p = 1``, ``c_y = 1 − ε``, ``c_u = ε / V``."""

    name: ClassVar[str] = "student_ce"
    weight: ClassVar[str] = "student_ce_weight"
    parameters: ClassVar[tuple[str, ...]] = ("label_smoothing",)

    @property
    def smoothed(self) -> bool:
        return "label_smoothing" in self.given

    def column_sums(self) -> tuple[Expr, ...]:
        # ε = 0 is structure: the plain CE reads no column sum, and round 1's record has no column for it.
        return (RAW_STUDENT,) if self.smoothed else ()

    def value(self, x: RowSymbols) -> Expr:
        if not self.smoothed:
            return x.lse - x.label_logit
        epsilon = row("label_smoothing")
        # Σ_j s_j is round 1's column sum over the real vocabulary; 1/V a runtime scalar, so V compiles nothing.
        return x.lse - (1.0 - epsilon) * x.label_logit - epsilon * x.sums[0] * row("inv_vocab")

    def grad(self, lse: Expr) -> SoftmaxGrad:
        if not self.smoothed:
            return SoftmaxGrad(wrap(1.0), wrap(1.0), wrap(0.0))
        epsilon = row("label_smoothing")
        # ∂/∂s_j of LSE(s) − (1−ε)·s_y − ε·Σ_k s_k / V: softmax(s)_j − (1−ε)·[j = y] − ε/V.
        return SoftmaxGrad(wrap(1.0), 1.0 - epsilon, epsilon * row("inv_vocab"))

    def oracle(self, logits: Tensor, labels: Tensor, scalars: Mapping[str, float]) -> Tensor:
        epsilon = scalars.get("label_smoothing", 0.0)
        return torch.nn.functional.cross_entropy(logits, labels, reduction="none", label_smoothing=epsilon)


@dataclass(frozen=True)
class ZLoss(StudentTerm):
    """``LSE(s)²`` (PaLM's auxiliary loss), which keeps the log-partition near 0: ``c_p = 2·LSE(s)``,
    ``c_y = c_u = 0``."""

    name: ClassVar[str] = "z_loss"
    weight: ClassVar[str] = "z_loss_weight"

    def value(self, x: RowSymbols) -> Expr:
        return x.lse * x.lse

    def grad(self, lse: Expr) -> SoftmaxGrad:
        # ∂LSE(s)²/∂s_j = 2·LSE(s)·softmax(s)_j.
        return SoftmaxGrad(2.0 * lse, wrap(0.0), wrap(0.0))

    def oracle(self, logits: Tensor, labels: Tensor, scalars: Mapping[str, float]) -> Tensor:
        return torch.logsumexp(logits, dim=-1) ** 2


#: The registered terms, in the order of the output components.
STUDENT_TERMS: tuple[type[StudentTerm], ...] = (CrossEntropy, ZLoss)
#: A loss's components after ``loss``, in output order: the CEs and the KL, then the other terms, then
#: the student's entropy (a report of no weight: orda_tp.divergences.entropy).
COMPONENTS = ("student_ce", "teacher_ce", "kl", *(term.name for term in STUDENT_TERMS[1:]), "student_entropy")


@cache
def column_sums_of(terms: tuple[StudentTerm, ...]) -> tuple[Expr, ...]:
    """The column terms round 1 sums for ``terms``, each term's in its order, term after term."""
    return tuple(expr for term in terms for expr in term.column_sums())
