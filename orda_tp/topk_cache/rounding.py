"""How a top-k cache stores log-probabilities in 16 bits: rounded so that no row's mass exceeds 1."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["rounded_down", "stored_logprobs"]

_SMALLEST_NEGATIVE = -32767  # int16 bits 0x8001: the negative float16 / bfloat16 closest to 0


def stored_logprobs(logprobs: Tensor, dtype: torch.dtype) -> Tensor:
    """``logprobs`` (rows, k) as stored in ``dtype``: rounded to nearest, except in the rows whose
    rounded mass ``Σ e^l`` would exceed 1 (a peaked teacher's top-k holds nearly all the mass; to
    nearest its k values can sum past 1 by ``Σ p·|l|·2⁻¹¹`` in float16, which
    :class:`~orda_tp.PrecomputedTeacher` refuses), which are rounded toward −inf (:func:`rounded_down`)."""
    stored = logprobs.to(dtype)
    # Only the rows whose rounded mass exceeds 1 are rounded down: the rest keep round-to-nearest's accuracy.
    over = torch.exp(stored.double()).sum(dim=1) > 1
    if bool(over.any()):
        stored[over] = rounded_down(logprobs[over], dtype)  # in place: only those rows change
    return stored


def rounded_down(logprobs: Tensor, dtype: torch.dtype) -> Tensor:
    """``logprobs`` (≤ 0) in ``dtype``, rounded toward −inf: each stored probability is at most
    the given one, so a row's mass never rounds above what it was. Values below the dtype's range
    become −inf."""
    stored = logprobs.to(dtype)
    if dtype not in (torch.float16, torch.bfloat16):
        return (
            stored
            if dtype == logprobs.dtype
            else stored.where(stored.to(logprobs.dtype) <= logprobs, stored.nextafter(stored.new_tensor(float("-inf"))))
        )
    # Sign and magnitude: for y ≤ 0 the next value down has bits + 1; from ±0, the smallest negative subnormal.
    bits = stored.view(torch.int16)
    lower = torch.where(stored == 0, torch.full_like(bits, _SMALLEST_NEGATIVE), bits + 1).view(dtype)
    # Stepped down only where rounding to nearest went up.
    return torch.where(stored.to(logprobs.dtype) > logprobs, lower, stored)
