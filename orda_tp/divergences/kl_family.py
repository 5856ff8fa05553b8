"""Forward, reverse and symmetric KL variants, and the entropy-gated blend.

``F = KL(q‖p) = Σ q (log q − log p)``, ``R = KL(p‖q) = Σ p (log p − log q)``.
``∂F/∂u = p − q``; ``∂R/∂u = p ⊙ (log p − log q − R)``; by symmetry ``∂R/∂v = q − p`` and
``∂F/∂v = q ⊙ (log q − log p − F)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import LOG_VOCAB, Divergence, DivergenceParams, EntropyGate, Finalized, Parameter, RowTargets, xlogratio
from .expr import LOGP, LOGQ, Expr, P, Q, equal, row, where

FORWARD_TERMS = xlogratio(Q, LOGQ, LOGP)
REVERSE_TERMS = xlogratio(P, LOGP, LOGQ)


def reverse_kl_grad(reverse_value: Expr) -> Expr:
    """``∂KL(p‖q)/∂u = p ⊙ (log p − log q − KL(p‖q))`` (0 where p = 0)."""
    return xlogratio(P, LOGP, LOGQ + reverse_value)


def forward_kl_teacher_grad(forward_value: Expr) -> Expr:
    """``∂KL(q‖p)/∂v = q ⊙ (log q − log p − KL(q‖p))`` (0 where q = 0)."""
    return xlogratio(Q, LOGQ, LOGP + forward_value)


class Forward(Divergence):
    """``D = KL(q‖p)``, ``∂D/∂u = p − q``."""

    name = "forward"

    def column_terms(self, params: DivergenceParams) -> tuple[Expr, ...]:
        return (FORWARD_TERMS,)

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        # No row constant: p − q reads nothing of round 2, which may then run in the gradient pass.
        return Finalized(sums[:, 0], {})

    def student_grad_expr(self, params: DivergenceParams) -> Expr:
        return P - Q


class Reverse(Divergence):
    """``D = KL(p‖q)``, ``∂D/∂u = p ⊙ (log p − log q − D)``."""

    name = "reverse"

    def column_terms(self, params: DivergenceParams) -> tuple[Expr, ...]:
        return (REVERSE_TERMS,)

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        # R itself is the gradient's one row constant: p ⊙ (log p − log q − R).
        return Finalized(sums[:, 0], {"reverse": sums[:, 0]})

    def student_grad_expr(self, params: DivergenceParams) -> Expr:
        return reverse_kl_grad(row("reverse"))

    def infinite_without_support(self, params: DivergenceParams) -> bool:
        return True


class Jeffreys(Divergence):
    """``D = KL(q‖p) + KL(p‖q)``; the gradient is the sum of the two."""

    name = "jeffreys"
    num_sums = 2

    def column_terms(self, params: DivergenceParams) -> tuple[Expr, ...]:
        return (FORWARD_TERMS, REVERSE_TERMS)

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        return Finalized(sums[:, 0] + sums[:, 1], {"forward": sums[:, 0], "reverse": sums[:, 1]})

    def student_grad_expr(self, params: DivergenceParams) -> Expr:
        return P - Q + reverse_kl_grad(row("reverse"))

    def infinite_without_support(self, params: DivergenceParams) -> bool:
        return True


class Mutual(Jeffreys):
    """Value of Jeffreys; objective ``KL(sg q‖p) + KL(sg p‖q)``: student ``p − q``, teacher ``q − p``."""

    name = "mutual"
    cotrains_teacher = True

    def student_grad_expr(self, params: DivergenceParams) -> Expr:
        # Each side's half of the detached objective: KL(sg q‖p) for the student, KL(sg p‖q) for the teacher.
        return P - Q

    def teacher_grad_expr(self, params: DivergenceParams) -> Expr:
        return Q - P


class CoJeffreys(Jeffreys):
    """Jeffreys with no detach: both sides receive the full symmetric gradient."""

    name = "cojeffreys"
    cotrains_teacher = True

    def teacher_grad_expr(self, params: DivergenceParams) -> Expr:
        # The full gradient of F + R in v: q − p from R, q ⊙ (log q − log p − F) from F.
        return Q - P + forward_kl_teacher_grad(row("forward"))


def weighted(weight: Tensor, value: Tensor) -> Tensor:
    """``weight·value`` with an exact 0 where the weight is 0 (so ``0·inf = 0``)."""
    return torch.where(weight == 0, torch.zeros_like(value), weight * value)


def weighted_expr(weight: Expr, value: Expr) -> Expr:
    """``weight·value`` with an exact 0 where the weight is 0 (so ``0·inf = 0``)."""
    return where(equal(weight, 0.0), 0.0, weight * value)


@dataclass(frozen=True)
class GateParameter(Parameter):
    """An :class:`EntropyGate`."""

    def check(self, value: object, variant: str) -> EntropyGate:
        if not isinstance(value, EntropyGate):
            raise TypeError(f"{self.keyword} must be an EntropyGate or None, got {type(value).__name__}")
        return value


def gate_of(params: DivergenceParams) -> EntropyGate:
    """The resolved ``entropy_gate`` of ``params``."""
    gate = params["entropy_gate"]
    assert isinstance(gate, EntropyGate)
    return gate


class EntropyAdaptive(Divergence):
    """``D = γ·KL(q‖p) + (1−γ)·KL(p‖q)``, with the detached gate
    ``γ = a_min + (a_max − a_min)·σ((H(q)/log V − τ)/scale)``, ``H(q) = −Σ q log q``."""

    name = "entropy_adaptive"
    parameters = (GateParameter("entropy_gate", EntropyGate()),)
    reads_log_vocab = True
    num_sums = 3

    def column_terms(self, params: DivergenceParams) -> tuple[Expr, ...]:
        # 0·log 0 = 0: a column without teacher mass (LOGQ = −inf) adds nothing to H(q), not NaN.
        entropy = -where(equal(Q, 0.0), 0.0, Q * LOGQ)
        return (FORWARD_TERMS, REVERSE_TERMS, entropy)

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        gate = gate_of(params)
        # H(q)/log V lies in [0, 1] whatever the vocabulary, so tau and scale mean the same for every V.
        normalized_entropy = sums[:, 2] / params.real(LOG_VOCAB)
        gamma = gate.alpha_min + (gate.alpha_max - gate.alpha_min) * torch.sigmoid(
            (normalized_entropy - gate.tau) / gate.scale
        )
        # A weight of exactly 0 drops its KL even where that KL is +inf (γ = 1 with a teacher lacking support).
        value = weighted(gamma, sums[:, 0]) + weighted(1.0 - gamma, sums[:, 1])
        return Finalized(value, {"gamma": gamma, "reverse": sums[:, 1]})

    def student_grad_expr(self, params: DivergenceParams) -> Expr:
        gamma = row("gamma")
        return weighted_expr(gamma, P - Q) + weighted_expr(1.0 - gamma, reverse_kl_grad(row("reverse")))

    def infinite_without_support(self, params: DivergenceParams) -> bool:
        gate = gate_of(params)  # γ = 1 on every row only when a_min = a_max = 1: then no reverse term
        return not gate.alpha_min == gate.alpha_max == 1.0
