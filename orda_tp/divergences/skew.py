"""Skew divergences against the mixture ``m = (1−β)·q + β·p``.

``∂ log m/∂u = β p ⊙ (δ − p)/m`` gives the gradients below; the per-row sums ``S = βΣ q p/m``
and ``R = βΣ p²/m`` are the mixture's share of the softmax Jacobian.
"""

from __future__ import annotations

import math

from torch import Tensor

from .base import Divergence, DivergenceParams, Finalized, Real, RowTargets, xlogratio
from .expr import LOGP, LOGQ, Expr, P, Q, equal, exp, logaddexp, row, where


def log_mixture(beta: float) -> Expr:
    """``log m = log((1−β) q + β p)``, computed in log space."""
    # log(1 − β) by log1p (exact for small β); the shares merged by logaddexp: m itself is never formed.
    return logaddexp(math.log1p(-beta) + LOGQ, math.log(beta) + LOGP)


def ratio_product(log_x: Expr, log_y: Expr, log_m: Expr, x: Expr) -> Expr:
    """Elementwise ``x·y/m`` (0 where x = 0)."""
    # x = 0 is also where both sides may lack mass: log m = −inf there, and the exponent would be NaN.
    return where(equal(x, 0.0), 0.0, exp(log_x + log_y - log_m))


class SkewBase(Divergence):
    parameters = (Real("kl_beta", 0.5, low=0.0, high=1.0, low_open=True, high_open=True),)
    num_sums = 2

    @staticmethod
    def beta(params: DivergenceParams) -> float:
        return params.real("kl_beta")


class SkewForward(SkewBase):
    """``D = KL(q‖m)``, ``∂D/∂u = p·S − β q p/m`` with ``S = βΣ q p/m``."""

    name = "skew_forward"

    def column_terms(self, params: DivergenceParams) -> tuple[Expr, ...]:
        log_m = log_mixture(self.beta(params))
        return (xlogratio(Q, LOGQ, log_m), ratio_product(LOGQ, LOGP, log_m, Q))

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        return Finalized(sums[:, 0], {"S": self.beta(params) * sums[:, 1]})

    def student_grad_expr(self, params: DivergenceParams) -> Expr:
        beta = self.beta(params)
        return P * row("S") - beta * ratio_product(LOGQ, LOGP, log_mixture(beta), Q)


class SkewReverse(SkewBase):
    """``D = KL(p‖m)``, ``∂D/∂u = p(log p − log m − (D − R)) − β p²/m`` with ``R = βΣ p²/m``."""

    name = "skew_reverse"

    def column_terms(self, params: DivergenceParams) -> tuple[Expr, ...]:
        log_m = log_mixture(self.beta(params))
        return (xlogratio(P, LOGP, log_m), ratio_product(LOGP, LOGP, log_m, P))

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        # D − R, one row constant: the gradient subtracts it from log p − log m in a single xlogratio.
        return Finalized(sums[:, 0], {"shift": sums[:, 0] - self.beta(params) * sums[:, 1]})

    def student_grad_expr(self, params: DivergenceParams) -> Expr:
        beta = self.beta(params)
        log_m = log_mixture(beta)
        return xlogratio(P, LOGP, log_m + row("shift")) - beta * ratio_product(LOGP, LOGP, log_m, P)


class SkewJS(SkewBase):
    """``D = (1−β)·KL(q‖m) + β·KL(p‖m)``, ``∂D/∂u = β p ⊙ (log p − log m − KL(p‖m))``."""

    name = "skew_js"

    def column_terms(self, params: DivergenceParams) -> tuple[Expr, ...]:
        log_m = log_mixture(self.beta(params))
        return (xlogratio(Q, LOGQ, log_m), xlogratio(P, LOGP, log_m))

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        beta = self.beta(params)
        return Finalized((1.0 - beta) * sums[:, 0] + beta * sums[:, 1], {"reverse": sums[:, 1]})

    def student_grad_expr(self, params: DivergenceParams) -> Expr:
        beta = self.beta(params)
        return beta * xlogratio(P, LOGP, log_mixture(beta) + row("reverse"))
