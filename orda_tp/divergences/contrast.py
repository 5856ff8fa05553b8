"""Decoupled KD (target vs non-target) and the triangular discrimination."""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import EntropyGate
from .base import BlockTerms, Divergence, DivergenceParams, Finalized, RowTargets, check_range, xlogratio


class DecoupledKD(Divergence):
    """``D = λ_t·KL(b^q‖b^p) + λ_n·KL(q̂‖p̂)``: ``b^x = (x_y, 1 − x_y)`` is the binary
    target/non-target split and ``x̂`` the distribution renormalized over the classes ≠ y.

    With ``P_n = Σ_{i≠y} p_i``, ``Q_n = Σ_{i≠y} q_i`` and ``K = Σ_{i≠y} q_i(log q_i − log p_i)``:
    ``KL(q̂‖p̂) = K/Q_n − log Q_n + log P_n`` (0 when Q_n = 0). Gradient: at y,
    ``λ_t(p_y − q_y)``; elsewhere ``λ_t(q_y − p_y)·p̂_i + λ_n(p̂_i − q̂_i)``.
    """

    name = "dkd"
    parameters = ("kl_alpha", "kl_beta")
    needs_target = True
    num_sums = 3

    def resolve(self, kl_alpha: float | None, kl_beta: float | None, gate: EntropyGate | None) -> DivergenceParams:
        target_weight = 1.0 if kl_alpha is None else kl_alpha
        nontarget_weight = 1.0 if kl_beta is None else kl_beta
        check_range("kl_alpha", target_weight, 0.0, 16.0, low_open=True, high_open=False, variant=self.name)
        check_range("kl_beta", nontarget_weight, 0.0, 16.0, low_open=True, high_open=False, variant=self.name)
        return DivergenceParams(alpha=float(target_weight), beta=float(nontarget_weight))

    def block_sums(self, terms: BlockTerms, params: DivergenceParams) -> Tensor:
        assert terms.is_target is not None
        others = ~terms.is_target
        zero = torch.zeros_like(terms.p)
        p_rest = torch.where(others, terms.p, zero).sum(1)
        q_rest = torch.where(others, terms.q, zero).sum(1)
        kl_rest = torch.where(others, xlogratio(terms.q, terms.logq, terms.logp), zero).sum(1)
        return torch.stack([p_rest, q_rest, kl_rest], dim=1)

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        target_weight, nontarget_weight = params.alpha, params.beta
        assert target_weight is not None and nontarget_weight is not None
        p_rest, q_rest, kl_rest = sums[:, 0], sums[:, 1], sums[:, 2]
        log_p_rest, log_q_rest = torch.log(p_rest), torch.log(q_rest)
        q_y = torch.exp(targets.logq_y)
        binary = xlogratio(q_y, targets.logq_y, targets.logp_y) + xlogratio(q_rest, log_q_rest, log_p_rest)
        has_rest = q_rest != 0
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

    def student_grad(self, terms: BlockTerms, consts: dict[str, Tensor], params: DivergenceParams) -> Tensor:
        target_weight, nontarget_weight = params.alpha, params.beta
        assert target_weight is not None and nontarget_weight is not None and terms.is_target is not None
        p_y, q_y = consts["p_y"][:, None], consts["q_y"][:, None]
        p_hat = terms.p * consts["inv_p_rest"][:, None]
        q_hat = terms.q * consts["inv_q_rest"][:, None]
        rest = target_weight * (q_y - p_y) * p_hat + nontarget_weight * (p_hat - q_hat)
        at_target = (target_weight * (p_y - q_y)).expand_as(rest)
        return torch.where(terms.is_target, at_target, rest)


class Triangular(Divergence):
    """``D = Σ (p−q)²/(p+q)`` (columns with p+q = 0 skipped), ``∂D/∂u = p(G − Σ pG)`` with
    ``G = (p−q)(p+3q)/(p+q)²``."""

    name = "triangular"
    num_sums = 2

    @staticmethod
    def _column_terms(terms: BlockTerms) -> tuple[Tensor, Tensor]:
        total = terms.p + terms.q
        diff = terms.p - terms.q
        empty = total == 0
        safe_total = torch.where(empty, torch.ones_like(total), total)
        value = torch.where(empty, torch.zeros_like(total), diff * diff / safe_total)
        slope = torch.where(
            empty, torch.zeros_like(total), diff * (terms.p + 3.0 * terms.q) / (safe_total * safe_total)
        )
        return value, slope

    def block_sums(self, terms: BlockTerms, params: DivergenceParams) -> Tensor:
        value, slope = self._column_terms(terms)
        return torch.stack([value.sum(1), (terms.p * slope).sum(1)], dim=1)

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        return Finalized(sums[:, 0], {"mean_slope": sums[:, 1]})

    def student_grad(self, terms: BlockTerms, consts: dict[str, Tensor], params: DivergenceParams) -> Tensor:
        _, slope = self._column_terms(terms)
        return terms.p * (slope - consts["mean_slope"][:, None])
