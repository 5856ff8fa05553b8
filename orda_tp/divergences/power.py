"""Power divergences: alpha, Rényi (both directions) and AB.

They share the power mean ``A = Σ a^r b^{1−r}`` (``a, b`` = p, q in some order), evaluated as
``A − 1 = Σ power_gap(a, b, r)`` so that nothing cancels when p ≈ q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Divergence, DivergenceParams, Finalized, Real, RowTargets, power_gap, zero_where_both_zero
from .expr import LOGP, LOGQ, Expr, P, Q, absolute, equal, exp, expm1, greater, less, row, where


def power_product(log_a: Expr, log_b: Expr, a: Expr, b: Expr, r: float) -> Expr:
    """Elementwise ``a^r b^{1−r}`` (0 where both vanish)."""
    return zero_where_both_zero(exp(r * log_a + (1.0 - r) * log_b), a, b)


class AlphaDivergence(Divergence):
    """``D = (1 − Σ p^α q^{1−α}) / (α(1−α))``, ``∂D/∂u = (A·p − p^α q^{1−α}) / (1−α)``."""

    name = "alpha_divergence"
    parameters = (Real("kl_alpha", 0.5, low=0.0, high=1.0, low_open=True, high_open=True),)

    def column_terms(self, params: DivergenceParams) -> tuple[Expr, ...]:
        return (power_gap(LOGP, LOGQ, P, Q, params.real("kl_alpha")),)

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        alpha = params.real("kl_alpha")
        # D from the summed A − 1 itself: 1 − A formed from A would cancel where p ≈ q.
        a_minus_one = sums[:, 0]
        return Finalized(-a_minus_one / (alpha * (1.0 - alpha)), {"A": 1.0 + a_minus_one})

    def student_grad_expr(self, params: DivergenceParams) -> Expr:
        alpha = params.real("kl_alpha")
        return (row("A") * P - power_product(LOGP, LOGQ, P, Q, alpha)) / (1.0 - alpha)


@dataclass(frozen=True)
class RenyiOrder(Real):
    """The order ``r`` in (0, 2], away from the ``r → 1`` limit (where the ``1/(r − 1)`` of ``D``
    cancels catastrophically)."""

    def check(self, value: object, variant: str) -> float:
        order = super().check(value, variant)
        if abs(order - 1.0) < 0.01:
            raise ValueError(
                f"{self.keyword} (the Rényi order r) must satisfy |r − 1| >= 0.01 for kl_divergence={variant!r}, "
                f"got {value!r}; use kl_divergence='forward' or 'reverse' for the r → 1 limit"
            )
        return order


RENYI_ORDER = RenyiOrder("kl_alpha", 0.5, low=0.0, high=2.0, low_open=True, high_open=False)


class Renyi(Divergence):
    """``D = D_r(q‖p) = log(Σ q^r p^{1−r}) / (r−1)``, ``∂D/∂u = p − q^r p^{1−r} / A``."""

    name = "renyi"
    parameters = (RENYI_ORDER,)

    def column_terms(self, params: DivergenceParams) -> tuple[Expr, ...]:
        return (power_gap(LOGQ, LOGP, Q, P, params.real("kl_alpha")),)

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        order = params.real("kl_alpha")
        # log A = log1p(A − 1): exact where A ≈ 1, that is p ≈ q.
        return Finalized(torch.log1p(sums[:, 0]) / (order - 1.0), {"A": 1.0 + sums[:, 0]})

    def student_grad_expr(self, params: DivergenceParams) -> Expr:
        return P - power_product(LOGQ, LOGP, Q, P, params.real("kl_alpha")) / row("A")


class RenyiReverse(Divergence):
    """``D = D_r(p‖q) = log(Σ p^r q^{1−r}) / (r−1)``, ``∂D/∂u = r/(r−1)·(p^r q^{1−r}/A − p)``."""

    name = "renyi_reverse"
    parameters = (RENYI_ORDER,)

    def column_terms(self, params: DivergenceParams) -> tuple[Expr, ...]:
        return (power_gap(LOGP, LOGQ, P, Q, params.real("kl_alpha")),)

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        order = params.real("kl_alpha")
        return Finalized(torch.log1p(sums[:, 0]) / (order - 1.0), {"A": 1.0 + sums[:, 0]})

    def student_grad_expr(self, params: DivergenceParams) -> Expr:
        order = params.real("kl_alpha")
        return order / (order - 1.0) * (power_product(LOGP, LOGQ, P, Q, order) / row("A") - P)

    def infinite_without_support(self, params: DivergenceParams) -> bool:
        # q^{1−r} = +inf where q = 0 < p for r > 1.
        return params.real("kl_alpha") > 1.0


def ab_gap(log_p: Expr, log_q: Expr, p: Expr, q: Expr, alpha: float, beta: float) -> Expr:
    """Elementwise ``p^α q^β − α/(α+β)·p^{α+β} − β/(α+β)·q^{α+β}`` (≤ 0 by weighted AM–GM).

    With ``d = log p − log q`` and ``s = α+β``, factor out the larger of p^s, q^s:
    d ≤ 0: ``q^s·(expm1(α d) − α/s·expm1(s d))``; d > 0: ``p^s·(expm1(−β d) − β/s·expm1(−s d))``.
    """
    total = alpha + beta
    d = log_p - log_q
    low = exp(total * log_q) * (expm1(alpha * d) - alpha / total * expm1(total * d))
    high = exp(total * log_p) * (expm1(-beta * d) - beta / total * expm1(-total * d))
    return zero_where_both_zero(where(greater(d, 0.0), high, low), p, q)


def ab_gradient_terms(log_p: Expr, log_q: Expr, p: Expr, alpha: float, beta: float) -> Expr:
    """Elementwise ``h = p^α (p^β − q^β)``; the ``expm1`` form where p^β ≈ q^β."""
    exponent = beta * (log_q - log_p)
    # |exponent| < 1: the expm1 form, exact where p^β ≈ q^β; beyond it the plain difference, whose exponents are
    # ≤ 0 (expm1 of a large exponent could overflow, and times a vanishing p^{α+β} give NaN).
    near = -exp((alpha + beta) * log_p) * expm1(exponent)
    far = exp((alpha + beta) * log_p) - exp(alpha * log_p + beta * log_q)
    return where(equal(p, 0.0), 0.0, where(less(absolute(exponent), 1.0), near, far))


class ABDivergence(Divergence):
    """``D = −1/(αβ)·Σ [p^α q^β − α/(α+β) p^{α+β} − β/(α+β) q^{α+β}]``,
    ``∂D/∂u = (h − p·Σh)/β`` with ``h = p^α (p^β − q^β)``."""

    name = "abkd"
    parameters = tuple(
        Real(keyword, 0.5, low=0.05, high=2.0, low_open=False, high_open=False) for keyword in ("kl_alpha", "kl_beta")
    )
    num_sums = 2

    def column_terms(self, params: DivergenceParams) -> tuple[Expr, ...]:
        alpha, beta = params.real("kl_alpha"), params.real("kl_beta")
        return (ab_gap(LOGP, LOGQ, P, Q, alpha, beta), ab_gradient_terms(LOGP, LOGQ, P, alpha, beta))

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        alpha, beta = params.real("kl_alpha"), params.real("kl_beta")
        return Finalized(-sums[:, 0] / (alpha * beta), {"h_sum": sums[:, 1]})

    def student_grad_expr(self, params: DivergenceParams) -> Expr:
        alpha, beta = params.real("kl_alpha"), params.real("kl_beta")
        return (ab_gradient_terms(LOGP, LOGQ, P, alpha, beta) - P * row("h_sum")) / beta
