"""Log-space helpers that keep the edge cases (all ``-inf`` rows, ``P = 1``) exact."""

from __future__ import annotations

import math

import torch

__all__ = ["log1mexp", "log_normalize"]

_LOG_HALF = -math.log(2.0)


def log_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x − LSE(x)`` over the last dimension (the log-softmax); a row that is all ``-inf`` (the zero
    measure) stays all ``-inf``, a row holding NaN or ``+inf`` comes out NaN."""
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    # An all −inf row has LSE −inf: subtracting it would give NaN, subtracting 0 keeps the row −inf.
    return x - torch.where(lse == -math.inf, torch.zeros_like(lse), lse)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 − eˣ)`` for ``x ≤ 0``, accurate over the whole range; ``x = 0`` gives ``-inf`` (and an
    infinite derivative): callers mask it."""
    # Mächler's split: log(−expm1(x)) above −log 2, log1p(−eˣ) below. Each branch is fed only arguments of
    # its own side (the other's are replaced by −log 2), so the unused one sends no NaN or inf into the gradient.
    near_zero = x > _LOG_HALF
    near = torch.log(-torch.expm1(torch.where(near_zero, x, _LOG_HALF)))
    far = torch.log1p(-torch.exp(torch.where(near_zero, _LOG_HALF, x)))
    return torch.where(near_zero, near, far)
