"""Power divergences: alpha, Rényi (both directions) and AB.

They share the power mean ``A = Σ a^r b^{1−r}`` (``a, b`` = p, q in some order), evaluated as
``A − 1 = Σ power_gap(a, b, r)`` so that nothing cancels when p ≈ q.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import EntropyGate
from .base import (
    BlockTerms,
    Divergence,
    DivergenceParams,
    Finalized,
    RowTargets,
    check_range,
    power_gap,
    zero_where_both_zero,
)


def power_product(log_a: Tensor, log_b: Tensor, a: Tensor, b: Tensor, r: float) -> Tensor:
    """Elementwise ``a^r b^{1−r}`` (0 where both vanish)."""
    return zero_where_both_zero(torch.exp(r * log_a + (1.0 - r) * log_b), a, b)


class AlphaDivergence(Divergence):
    """``D = (1 − Σ p^α q^{1−α}) / (α(1−α))``, ``∂D/∂u = (A·p − p^α q^{1−α}) / (1−α)``."""

    name = "alpha_divergence"
    parameters = ("kl_alpha",)

    def resolve(self, kl_alpha: float | None, kl_beta: float | None, gate: EntropyGate | None) -> DivergenceParams:
        alpha = 0.5 if kl_alpha is None else kl_alpha
        check_range("kl_alpha", alpha, 0.0, 1.0, low_open=True, high_open=True, variant=self.name)
        return DivergenceParams(alpha=float(alpha))

    def block_sums(self, terms: BlockTerms, params: DivergenceParams) -> Tensor:
        assert params.alpha is not None
        return power_gap(terms.logp, terms.logq, terms.p, terms.q, params.alpha).sum(1, keepdim=True)

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        alpha = params.alpha
        assert alpha is not None
        a_minus_one = sums[:, 0]
        return Finalized(-a_minus_one / (alpha * (1.0 - alpha)), {"A": 1.0 + a_minus_one})

    def student_grad(self, terms: BlockTerms, consts: dict[str, Tensor], params: DivergenceParams) -> Tensor:
        alpha = params.alpha
        assert alpha is not None
        mixed = power_product(terms.logp, terms.logq, terms.p, terms.q, alpha)
        return (consts["A"][:, None] * terms.p - mixed) / (1.0 - alpha)


def resolve_renyi_order(kl_alpha: float | None, variant: str) -> DivergenceParams:
    order = 0.5 if kl_alpha is None else kl_alpha
    check_range("kl_alpha", order, 0.0, 2.0, low_open=True, high_open=False, variant=variant)
    if abs(order - 1.0) < 0.01:
        raise ValueError(
            f"kl_alpha (the Rényi order r) must satisfy |r − 1| >= 0.01 for kl_divergence={variant!r}, got {order!r}; "
            "use kl_divergence='forward' or 'reverse' for the r → 1 limit"
        )
    return DivergenceParams(alpha=float(order))


class Renyi(Divergence):
    """``D = D_r(q‖p) = log(Σ q^r p^{1−r}) / (r−1)``, ``∂D/∂u = p − q^r p^{1−r} / A``."""

    name = "renyi"
    parameters = ("kl_alpha",)

    def resolve(self, kl_alpha: float | None, kl_beta: float | None, gate: EntropyGate | None) -> DivergenceParams:
        return resolve_renyi_order(kl_alpha, self.name)

    def block_sums(self, terms: BlockTerms, params: DivergenceParams) -> Tensor:
        assert params.alpha is not None
        return power_gap(terms.logq, terms.logp, terms.q, terms.p, params.alpha).sum(1, keepdim=True)

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        order = params.alpha
        assert order is not None
        return Finalized(torch.log1p(sums[:, 0]) / (order - 1.0), {"A": 1.0 + sums[:, 0]})

    def student_grad(self, terms: BlockTerms, consts: dict[str, Tensor], params: DivergenceParams) -> Tensor:
        assert params.alpha is not None
        mixed = power_product(terms.logq, terms.logp, terms.q, terms.p, params.alpha)
        return terms.p - mixed / consts["A"][:, None]


class RenyiReverse(Divergence):
    """``D = D_r(p‖q) = log(Σ p^r q^{1−r}) / (r−1)``, ``∂D/∂u = r/(r−1)·(p^r q^{1−r}/A − p)``."""

    name = "renyi_reverse"
    parameters = ("kl_alpha",)

    def resolve(self, kl_alpha: float | None, kl_beta: float | None, gate: EntropyGate | None) -> DivergenceParams:
        return resolve_renyi_order(kl_alpha, self.name)

    def block_sums(self, terms: BlockTerms, params: DivergenceParams) -> Tensor:
        assert params.alpha is not None
        return power_gap(terms.logp, terms.logq, terms.p, terms.q, params.alpha).sum(1, keepdim=True)

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        order = params.alpha
        assert order is not None
        return Finalized(torch.log1p(sums[:, 0]) / (order - 1.0), {"A": 1.0 + sums[:, 0]})

    def student_grad(self, terms: BlockTerms, consts: dict[str, Tensor], params: DivergenceParams) -> Tensor:
        order = params.alpha
        assert order is not None
        mixed = power_product(terms.logp, terms.logq, terms.p, terms.q, order)
        return order / (order - 1.0) * (mixed / consts["A"][:, None] - terms.p)


def ab_gap(log_p: Tensor, log_q: Tensor, p: Tensor, q: Tensor, alpha: float, beta: float) -> Tensor:
    """Elementwise ``p^α q^β − α/(α+β)·p^{α+β} − β/(α+β)·q^{α+β}`` (≤ 0 by weighted AM–GM).

    With ``d = log p − log q`` and ``s = α+β``, factor out the larger of p^s, q^s:
    d ≤ 0: ``q^s·(expm1(α d) − α/s·expm1(s d))``; d > 0: ``p^s·(expm1(−β d) − β/s·expm1(−s d))``.
    """
    total = alpha + beta
    d = log_p - log_q
    low = torch.exp(total * log_q) * (torch.expm1(alpha * d) - alpha / total * torch.expm1(total * d))
    high = torch.exp(total * log_p) * (torch.expm1(-beta * d) - beta / total * torch.expm1(-total * d))
    return zero_where_both_zero(torch.where(d > 0, high, low), p, q)


def ab_gradient_terms(log_p: Tensor, log_q: Tensor, p: Tensor, alpha: float, beta: float) -> Tensor:
    """Elementwise ``h = p^α (p^β − q^β)``; the ``expm1`` form where p^β ≈ q^β."""
    exponent = beta * (log_q - log_p)
    near = -torch.exp((alpha + beta) * log_p) * torch.expm1(exponent)
    far = torch.exp((alpha + beta) * log_p) - torch.exp(alpha * log_p + beta * log_q)
    h = torch.where(exponent.abs() < 1.0, near, far)
    return torch.where(p == 0, torch.zeros_like(h), h)


class ABDivergence(Divergence):
    """``D = −1/(αβ)·Σ [p^α q^β − α/(α+β) p^{α+β} − β/(α+β) q^{α+β}]``,
    ``∂D/∂u = (h − p·Σh)/β`` with ``h = p^α (p^β − q^β)``."""

    name = "abkd"
    parameters = ("kl_alpha", "kl_beta")
    num_sums = 2

    def resolve(self, kl_alpha: float | None, kl_beta: float | None, gate: EntropyGate | None) -> DivergenceParams:
        alpha = 0.5 if kl_alpha is None else kl_alpha
        beta = 0.5 if kl_beta is None else kl_beta
        check_range("kl_alpha", alpha, 0.05, 2.0, low_open=False, high_open=False, variant=self.name)
        check_range("kl_beta", beta, 0.05, 2.0, low_open=False, high_open=False, variant=self.name)
        return DivergenceParams(alpha=float(alpha), beta=float(beta))

    def block_sums(self, terms: BlockTerms, params: DivergenceParams) -> Tensor:
        alpha, beta = params.alpha, params.beta
        assert alpha is not None and beta is not None
        gap = ab_gap(terms.logp, terms.logq, terms.p, terms.q, alpha, beta).sum(1)
        h = ab_gradient_terms(terms.logp, terms.logq, terms.p, alpha, beta).sum(1)
        return torch.stack([gap, h], dim=1)

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        alpha, beta = params.alpha, params.beta
        assert alpha is not None and beta is not None
        return Finalized(-sums[:, 0] / (alpha * beta), {"h_sum": sums[:, 1]})

    def student_grad(self, terms: BlockTerms, consts: dict[str, Tensor], params: DivergenceParams) -> Tensor:
        alpha, beta = params.alpha, params.beta
        assert alpha is not None and beta is not None
        h = ab_gradient_terms(terms.logp, terms.logq, terms.p, alpha, beta)
        return (h - terms.p * consts["h_sum"][:, None]) / beta
