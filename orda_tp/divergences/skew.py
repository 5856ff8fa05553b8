"""Skew divergences against the mixture ``m = (1−β)·q + β·p``.

``∂ log m/∂u = β p ⊙ (δ − p)/m`` gives the gradients below; the per-row sums ``S = βΣ q p/m``
and ``R = βΣ p²/m`` are the mixture's share of the softmax Jacobian.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..config import EntropyGate
from .base import BlockTerms, Divergence, DivergenceParams, Finalized, RowTargets, check_range, xlogratio


def log_mixture(terms: BlockTerms, beta: float) -> Tensor:
    """``log m = log((1−β) q + β p)``, computed in log space."""
    return torch.logaddexp(math.log1p(-beta) + terms.logq, math.log(beta) + terms.logp)


def ratio_product(log_x: Tensor, log_y: Tensor, log_m: Tensor, x: Tensor) -> Tensor:
    """Elementwise ``x·y/m`` (0 where x = 0)."""
    value = torch.exp(log_x + log_y - log_m)
    return torch.where(x == 0, torch.zeros_like(value), value)


class SkewBase(Divergence):
    parameters = ("kl_beta",)
    num_sums = 2

    def resolve(self, kl_alpha: float | None, kl_beta: float | None, gate: EntropyGate | None) -> DivergenceParams:
        beta = 0.5 if kl_beta is None else kl_beta
        check_range("kl_beta", beta, 0.0, 1.0, low_open=True, high_open=True, variant=self.name)
        return DivergenceParams(beta=float(beta))


class SkewForward(SkewBase):
    """``D = KL(q‖m)``, ``∂D/∂u = p·S − β q p/m`` with ``S = βΣ q p/m``."""

    name = "skew_forward"

    def block_sums(self, terms: BlockTerms, params: DivergenceParams) -> Tensor:
        assert params.beta is not None
        log_m = log_mixture(terms, params.beta)
        value = xlogratio(terms.q, terms.logq, log_m).sum(1)
        overlap = ratio_product(terms.logq, terms.logp, log_m, terms.q).sum(1)
        return torch.stack([value, overlap], dim=1)

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        assert params.beta is not None
        return Finalized(sums[:, 0], {"S": params.beta * sums[:, 1]})

    def student_grad(self, terms: BlockTerms, consts: dict[str, Tensor], params: DivergenceParams) -> Tensor:
        beta = params.beta
        assert beta is not None
        log_m = log_mixture(terms, beta)
        return terms.p * consts["S"][:, None] - beta * ratio_product(terms.logq, terms.logp, log_m, terms.q)


class SkewReverse(SkewBase):
    """``D = KL(p‖m)``, ``∂D/∂u = p(log p − log m − (D − R)) − β p²/m`` with ``R = βΣ p²/m``."""

    name = "skew_reverse"

    def block_sums(self, terms: BlockTerms, params: DivergenceParams) -> Tensor:
        assert params.beta is not None
        log_m = log_mixture(terms, params.beta)
        value = xlogratio(terms.p, terms.logp, log_m).sum(1)
        self_overlap = ratio_product(terms.logp, terms.logp, log_m, terms.p).sum(1)
        return torch.stack([value, self_overlap], dim=1)

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        assert params.beta is not None
        return Finalized(sums[:, 0], {"shift": sums[:, 0] - params.beta * sums[:, 1]})

    def student_grad(self, terms: BlockTerms, consts: dict[str, Tensor], params: DivergenceParams) -> Tensor:
        beta = params.beta
        assert beta is not None
        log_m = log_mixture(terms, beta)
        return xlogratio(terms.p, terms.logp, log_m + consts["shift"][:, None]) - beta * ratio_product(
            terms.logp, terms.logp, log_m, terms.p
        )


class SkewJS(SkewBase):
    """``D = (1−β)·KL(q‖m) + β·KL(p‖m)``, ``∂D/∂u = β p ⊙ (log p − log m − KL(p‖m))``."""

    name = "skew_js"

    def block_sums(self, terms: BlockTerms, params: DivergenceParams) -> Tensor:
        assert params.beta is not None
        log_m = log_mixture(terms, params.beta)
        forward = xlogratio(terms.q, terms.logq, log_m).sum(1)
        reverse = xlogratio(terms.p, terms.logp, log_m).sum(1)
        return torch.stack([forward, reverse], dim=1)

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        beta = params.beta
        assert beta is not None
        return Finalized((1.0 - beta) * sums[:, 0] + beta * sums[:, 1], {"reverse": sums[:, 1]})

    def student_grad(self, terms: BlockTerms, consts: dict[str, Tensor], params: DivergenceParams) -> Tensor:
        beta = params.beta
        assert beta is not None
        log_m = log_mixture(terms, beta)
        return beta * xlogratio(terms.p, terms.logp, log_m + consts["reverse"][:, None])
