"""Forward, reverse and symmetric KL variants, and the entropy-gated blend.

``F = KL(q‖p) = Σ q (log q − log p)``, ``R = KL(p‖q) = Σ p (log p − log q)``.
``∂F/∂u = p − q``; ``∂R/∂u = p ⊙ (log p − log q − R)``; by symmetry ``∂R/∂v = q − p`` and
``∂F/∂v = q ⊙ (log q − log p − F)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import EntropyGate
from .base import BlockTerms, Divergence, DivergenceParams, Finalized, RowTargets, xlogratio


def forward_kl_terms(terms: BlockTerms) -> Tensor:
    return xlogratio(terms.q, terms.logq, terms.logp)


def reverse_kl_terms(terms: BlockTerms) -> Tensor:
    return xlogratio(terms.p, terms.logp, terms.logq)


def reverse_kl_grad(terms: BlockTerms, reverse_value: Tensor) -> Tensor:
    """``∂KL(p‖q)/∂u = p ⊙ (log p − log q − KL(p‖q))`` (0 where p = 0)."""
    return xlogratio(terms.p, terms.logp, terms.logq + reverse_value[:, None])


def forward_kl_teacher_grad(terms: BlockTerms, forward_value: Tensor) -> Tensor:
    """``∂KL(q‖p)/∂v = q ⊙ (log q − log p − KL(q‖p))`` (0 where q = 0)."""
    return xlogratio(terms.q, terms.logq, terms.logp + forward_value[:, None])


class Forward(Divergence):
    """``D = KL(q‖p)``, ``∂D/∂u = p − q``."""

    name = "forward"

    def block_sums(self, terms: BlockTerms, params: DivergenceParams) -> Tensor:
        return forward_kl_terms(terms).sum(1, keepdim=True)

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        return Finalized(sums[:, 0], {})

    def student_grad(self, terms: BlockTerms, consts: dict[str, Tensor], params: DivergenceParams) -> Tensor:
        return terms.p - terms.q


class Reverse(Divergence):
    """``D = KL(p‖q)``, ``∂D/∂u = p ⊙ (log p − log q − D)``."""

    name = "reverse"

    def block_sums(self, terms: BlockTerms, params: DivergenceParams) -> Tensor:
        return reverse_kl_terms(terms).sum(1, keepdim=True)

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        return Finalized(sums[:, 0], {"reverse": sums[:, 0]})

    def student_grad(self, terms: BlockTerms, consts: dict[str, Tensor], params: DivergenceParams) -> Tensor:
        return reverse_kl_grad(terms, consts["reverse"])


class Jeffreys(Divergence):
    """``D = KL(q‖p) + KL(p‖q)``; the gradient is the sum of the two."""

    name = "jeffreys"
    num_sums = 2

    def block_sums(self, terms: BlockTerms, params: DivergenceParams) -> Tensor:
        return torch.stack([forward_kl_terms(terms).sum(1), reverse_kl_terms(terms).sum(1)], dim=1)

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        return Finalized(sums[:, 0] + sums[:, 1], {"forward": sums[:, 0], "reverse": sums[:, 1]})

    def student_grad(self, terms: BlockTerms, consts: dict[str, Tensor], params: DivergenceParams) -> Tensor:
        return terms.p - terms.q + reverse_kl_grad(terms, consts["reverse"])


class Mutual(Jeffreys):
    """Value of Jeffreys; objective ``KL(sg q‖p) + KL(sg p‖q)``: student ``p − q``, teacher ``q − p``."""

    name = "mutual"
    cotrains_teacher = True

    def student_grad(self, terms: BlockTerms, consts: dict[str, Tensor], params: DivergenceParams) -> Tensor:
        return terms.p - terms.q

    def teacher_grad(self, terms: BlockTerms, consts: dict[str, Tensor], params: DivergenceParams) -> Tensor:
        return terms.q - terms.p


class CoJeffreys(Jeffreys):
    """Jeffreys with no detach: both sides receive the full symmetric gradient."""

    name = "cojeffreys"
    cotrains_teacher = True

    def teacher_grad(self, terms: BlockTerms, consts: dict[str, Tensor], params: DivergenceParams) -> Tensor:
        return terms.q - terms.p + forward_kl_teacher_grad(terms, consts["forward"])


def weighted(weight: Tensor, value: Tensor) -> Tensor:
    """``weight·value`` with an exact 0 where the weight is 0 (so ``0·inf = 0``)."""
    return torch.where(weight == 0, torch.zeros_like(value), weight * value)


class EntropyAdaptive(Divergence):
    """``D = γ·KL(q‖p) + (1−γ)·KL(p‖q)``, with the detached gate
    ``γ = a_min + (a_max − a_min)·σ((H(q)/log V − τ)/scale)``, ``H(q) = −Σ q log q``."""

    name = "entropy_adaptive"
    parameters = ("entropy_gate",)
    num_sums = 3

    def resolve(self, kl_alpha: float | None, kl_beta: float | None, gate: EntropyGate | None) -> DivergenceParams:
        if gate is None:
            gate = EntropyGate()
        if not isinstance(gate, EntropyGate):
            raise TypeError(f"entropy_gate must be an EntropyGate or None, got {type(gate).__name__}")
        return DivergenceParams(gate=gate)

    def block_sums(self, terms: BlockTerms, params: DivergenceParams) -> Tensor:
        entropy = -torch.where(terms.q == 0, torch.zeros_like(terms.q), terms.q * terms.logq)
        return torch.stack([forward_kl_terms(terms).sum(1), reverse_kl_terms(terms).sum(1), entropy.sum(1)], dim=1)

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        gate = params.gate
        assert gate is not None
        normalized_entropy = sums[:, 2] / params.log_vocab
        gamma = gate.alpha_min + (gate.alpha_max - gate.alpha_min) * torch.sigmoid(
            (normalized_entropy - gate.tau) / gate.scale
        )
        value = weighted(gamma, sums[:, 0]) + weighted(1.0 - gamma, sums[:, 1])
        return Finalized(value, {"gamma": gamma, "reverse": sums[:, 1]})

    def student_grad(self, terms: BlockTerms, consts: dict[str, Tensor], params: DivergenceParams) -> Tensor:
        gamma = consts["gamma"][:, None]
        return weighted(gamma, terms.p - terms.q) + weighted(1.0 - gamma, reverse_kl_grad(terms, consts["reverse"]))
