"""Decoupled KD (target vs non-target) and the triangular discrimination."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Divergence, DivergenceParams, Finalized, Real, RowTargets, xlogratio
from .expr import IS_TARGET, LOGP, LOGQ, Expr, P, Q, equal, row, where


def _xlogratio_rows(x: Tensor, log_x: Tensor, log_y: Tensor) -> Tensor:
    """Per row ``x·(log x − log y)`` with ``0·(…) = 0`` where x = 0."""
    return torch.where(x == 0, torch.zeros_like(x), x * (log_x - log_y))


class DecoupledKD(Divergence):
    """``D = λ_t·KL(b^q‖b^p) + λ_n·KL(q̂‖p̂)``: ``b^x = (x_y, 1 − x_y)`` is the binary
    target/non-target split and ``x̂`` the distribution renormalized over the classes ≠ y.

    With ``P_n = Σ_{i≠y} p_i = −expm1(log p_y)``, ``Q_n = −expm1(log q_y)`` and
    ``K = Σ_{i≠y} q_i(log q_i − log p_i)``: ``KL(q̂‖p̂) = K/Q_n − log Q_n + log P_n`` (0 when
    Q_n = 0). Gradient: at y ``λ_t(p_y − q_y)``; elsewhere ``λ_t(q_y − p_y)·p̂_i + λ_n(p̂_i − q̂_i)``.
    """

    name = "dkd"
    parameters = tuple(
        Real(keyword, 1.0, low=0.0, high=16.0, low_open=True, high_open=False) for keyword in ("kl_alpha", "kl_beta")
    )
    needs_target = True

    def column_terms(self, params: DivergenceParams) -> tuple[Expr, ...]:
        # K sums over i ≠ y: the label's column is masked out (the one variant whose sums read the label).
        return (where(IS_TARGET, 0.0, xlogratio(Q, LOGQ, LOGP)),)

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        target_weight, nontarget_weight = params.real("kl_alpha"), params.real("kl_beta")
        kl_rest = sums[:, 0]
        # The non-target masses from the label's log-probability, exact to rounding: a sum over the vocabulary
        # would carry V roundings into the logs below.
        p_rest, q_rest = -torch.expm1(targets.logp_y), -torch.expm1(targets.logq_y)
        log_p_rest, log_q_rest = torch.log(p_rest), torch.log(q_rest)
        q_y = torch.exp(targets.logq_y)
        binary = _xlogratio_rows(q_y, targets.logq_y, targets.logp_y) + _xlogratio_rows(q_rest, log_q_rest, log_p_rest)
        has_rest = q_rest != 0
        # Q_n = 0 (all the teacher's mass on the label): KL(q̂‖p̂) is 0, and a stand-in 1 keeps the division finite.
        safe_q_rest = torch.where(has_rest, q_rest, torch.ones_like(q_rest))
        nontarget = torch.where(has_rest, kl_rest / safe_q_rest - log_q_rest + log_p_rest, torch.zeros_like(q_rest))
        value = target_weight * binary + nontarget_weight * nontarget
        consts = {
            "p_y": torch.exp(targets.logp_y),
            "q_y": q_y,
            "inv_p_rest": 1.0 / p_rest,
            "inv_q_rest": torch.where(has_rest, 1.0 / safe_q_rest, torch.zeros_like(q_rest)),
        }
        return Finalized(value, consts)

    def student_grad_expr(self, params: DivergenceParams) -> Expr:
        target_weight, nontarget_weight = params.real("kl_alpha"), params.real("kl_beta")
        p_y, q_y = row("p_y"), row("q_y")
        p_hat = P * row("inv_p_rest")
        q_hat = Q * row("inv_q_rest")
        rest = target_weight * (q_y - p_y) * p_hat + nontarget_weight * (p_hat - q_hat)
        return where(IS_TARGET, target_weight * (p_y - q_y), rest)


class Triangular(Divergence):
    """``D = Σ (p−q)²/(p+q)`` (columns with p+q = 0 skipped), ``∂D/∂u = p(G − Σ pG)`` with
    ``G = (p−q)(p+3q)/(p+q)²``."""

    name = "triangular"
    num_sums = 2

    @staticmethod
    def _value_and_slope() -> tuple[Expr, Expr]:
        total = P + Q
        diff = P - Q
        empty = equal(total, 0.0)
        # p + q = 0: the column is skipped; dividing by a stand-in 1 keeps the unused branch of where finite.
        safe_total = where(empty, 1.0, total)
        value = where(empty, 0.0, diff * diff / safe_total)
        slope = where(empty, 0.0, diff * (P + 3.0 * Q) / (safe_total * safe_total))
        return value, slope

    def column_terms(self, params: DivergenceParams) -> tuple[Expr, ...]:
        value, slope = self._value_and_slope()
        return (value, P * slope)

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        return Finalized(sums[:, 0], {"mean_slope": sums[:, 1]})

    def student_grad_expr(self, params: DivergenceParams) -> Expr:
        _, slope = self._value_and_slope()
        return P * (slope - row("mean_slope"))
