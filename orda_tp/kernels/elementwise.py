"""Elementwise functions that the generated variant functions call (:mod:`.variant_terms`).

Written with ``tl.exp`` and ``tl.log`` alone: Triton's CPU interpreter, which the tests use, has
no libdevice.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["expm1", "logaddexp"]


@triton.jit
def expm1(x: tl.tensor) -> tl.tensor:
    """``e^x − 1`` without cancellation near 0 (Kahan): with ``u = e^x``,
    ``(u − 1)·x / log u``; ``x`` where ``u`` rounds to 1, −1 where ``u − 1`` does, ``u`` once
    ``u`` is so large that the ratio would overflow."""
    u: tl.tensor = tl.exp(x)
    um1 = u - 1.0
    accurate = um1 * x / tl.log(tl.where(u == 1.0, 2.0, u))
    return tl.where(u == 1.0, x, tl.where(um1 == -1.0, -1.0, tl.where(u > 3.0e38, u, accurate)))


@triton.jit
def logaddexp(a: tl.tensor, b: tl.tensor) -> tl.tensor:
    """``log(e^a + e^b)`` shifted by ``max(a, b)``; ``logaddexp(−inf, −inf) = −inf``."""
    m = tl.maximum(a, b)
    shift = tl.where(m == float("-inf"), 0.0, m)
    return shift + tl.log(tl.exp(a - shift) + tl.exp(b - shift))
