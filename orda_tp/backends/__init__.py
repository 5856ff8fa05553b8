"""Backends: ``reference`` (full logits, the oracle), ``torch`` (chunked), ``triton`` (chunked, with
generated Triton kernels for the per-block math)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from ..kernels import unavailable_reason

if TYPE_CHECKING:
    from .block_math import BlockMath

__all__ = ["block_math_of", "select_backend"]

_warned_fallback = False


def select_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend that runs a call: ``requested``, or for "auto" the best one available.

    "auto" takes the Triton kernels on a CUDA device with fp16/bf16/fp32 inputs, and otherwise the
    chunked torch backend; on a CUDA device it says once why it fell back.
    """
    global _warned_fallback
    if requested in ("reference", "torch"):
        return requested
    reason = unavailable_reason(device, dtype)
    if requested == "triton":
        if reason is not None:
            raise ValueError(f"backend='triton' is unavailable on this machine: {reason}")
        return "triton"
    if reason is None and device.type == "cuda":
        return "triton"
    if device.type == "cuda" and not _warned_fallback:
        _warned_fallback = True
        warnings.warn(f"orda_tp: backend='auto' runs the chunked torch backend because {reason}", stacklevel=3)
    return "torch"


def block_math_of(backend: str) -> BlockMath:
    """The per-block math of a selected chunked backend ("torch" or "triton")."""
    if backend == "triton":
        from .triton_math import TritonBlockMath

        return TritonBlockMath()
    from .block_math import TorchBlockMath

    return TorchBlockMath()
