"""The student's row terms: per-row losses of the student's own logits ``s`` (temperature 1).

A term is written once, here, and every backend runs it: its row value as a row formula
(:mod:`orda_tp.divergences.expr`), which the row steps of :mod:`orda_tp.engine.row_formulas` put
into their programs (torch interpreter or generated Triton row kernel); its column gradient as
three row coefficients of one shape that both block maths write,

    ∂L/∂s_j = c_p·softmax(s)_j − c_y·[j = y] − c_u        (j over the real vocabulary);

and its oracle, written again from its textbook definition for the reference backend (autograd
differentiates it). A term reads the row's log-partition ``LSE(s)`` (merged over blocks and
shards), its label logit ``s_y`` and, where it needs them, column sums ``Σ_j f(s_j)`` of its own
over the raw logits, which round 1 collects beside the log-partitions (one more column of its
record each, merged by addition; :meth:`StudentTerm.column_sums`).

Registered terms (:data:`STUDENT_TERMS`, whose order is the order of the output components):

- ``student_ce`` (weight ``student_ce_weight``), with ``label_smoothing = ε``:
  ``L = LSE(s) − (1−ε)·s_y − ε·Σ_j s_j / V``, i.e. ``(1−ε)·CE + ε·`` the CE against the uniform
  distribution (``torch.nn.functional.cross_entropy``'s ``label_smoothing``);
  ``c_p = 1``, ``c_y = 1 − ε``, ``c_u = ε / V``.
- ``z_loss`` (weight ``z_loss_weight``): ``L = LSE(s)²`` (PaLM's auxiliary loss);
  ``c_p = 2·LSE(s)``, ``c_y = c_u = 0``.

A term's runtime values (its weight, the keywords in ``parameters``, ``1/V`` as ``inv_vocab``) are
scalars of the row programs, so a new value compiles nothing; which ``parameters`` are nonzero
(``given``) is structure: a parameter at 0 drops its part of the formulas (and its column sums).
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
    """``LSE(s) − (1−ε)·s_y − ε·Σ_j s_j / V`` (``ε = label_smoothing``; the plain CE at 0)."""

    name: ClassVar[str] = "student_ce"
    weight: ClassVar[str] = "student_ce_weight"
    parameters: ClassVar[tuple[str, ...]] = ("label_smoothing",)

    @property
    def smoothed(self) -> bool:
        return "label_smoothing" in self.given

    def column_sums(self) -> tuple[Expr, ...]:
        return (RAW_STUDENT,) if self.smoothed else ()

    def value(self, x: RowSymbols) -> Expr:
        if not self.smoothed:
            return x.lse - x.label_logit
        epsilon = row("label_smoothing")
        return x.lse - (1.0 - epsilon) * x.label_logit - epsilon * x.sums[0] * row("inv_vocab")

    def grad(self, lse: Expr) -> SoftmaxGrad:
        if not self.smoothed:
            return SoftmaxGrad(wrap(1.0), wrap(1.0), wrap(0.0))
        epsilon = row("label_smoothing")
        return SoftmaxGrad(wrap(1.0), 1.0 - epsilon, epsilon * row("inv_vocab"))

    def oracle(self, logits: Tensor, labels: Tensor, scalars: Mapping[str, float]) -> Tensor:
        epsilon = scalars.get("label_smoothing", 0.0)
        return torch.nn.functional.cross_entropy(logits, labels, reduction="none", label_smoothing=epsilon)


@dataclass(frozen=True)
class ZLoss(StudentTerm):
    """``LSE(s)²``, which keeps the log-partition near 0."""

    name: ClassVar[str] = "z_loss"
    weight: ClassVar[str] = "z_loss_weight"

    def value(self, x: RowSymbols) -> Expr:
        return x.lse * x.lse

    def grad(self, lse: Expr) -> SoftmaxGrad:
        return SoftmaxGrad(2.0 * lse, wrap(0.0), wrap(0.0))

    def oracle(self, logits: Tensor, labels: Tensor, scalars: Mapping[str, float]) -> Tensor:
        return torch.logsumexp(logits, dim=-1) ** 2


#: The registered terms, in the order of the output components.
STUDENT_TERMS: tuple[type[StudentTerm], ...] = (CrossEntropy, ZLoss)
#: A loss's components after ``loss``, in output order: the CEs and the KL, then the other terms.
COMPONENTS = ("student_ce", "teacher_ce", "kl", *(term.name for term in STUDENT_TERMS[1:]))


@cache
def column_sums_of(terms: tuple[StudentTerm, ...]) -> tuple[Expr, ...]:
    """The column terms round 1 sums for ``terms``, each term's in its order, term after term."""
    return tuple(expr for term in terms for expr in term.column_sums())
