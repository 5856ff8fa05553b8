"""Fused Triton kernels (GPU). Reserved: the fused kernels arrive with a later release; until then
:func:`unavailable_reason` says why the Triton backend cannot run."""

from __future__ import annotations

__all__ = ["unavailable_reason"]


def unavailable_reason() -> str | None:
    """Why ``backend="triton"`` cannot run here, or None when it can."""
    return "the fused Triton kernels are not part of this orda_tp release yet (use backend='torch' or 'auto')"
