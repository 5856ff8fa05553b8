"""Elementwise functions of the kernels and of the generated variant functions; libdevice only in
compiled kernels (Triton's CPU interpreter, which the tests use, has none).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

__all__ = ["LOG2E", "divided", "exp", "expm1", "logaddexp"]

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e)
# Triton decides at decoration (import) time whether its kernels run under the CPU interpreter.
COMPILED = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def exp(x: tl.tensor) -> tl.tensor:
    """``e^x``. Compiled, ``2^{x·log2 e}`` in one ``ex2.approx.ftz``: results below 2^−126 are
    flushed to 0, where ``tl.exp`` spends three more instructions per element on subnormal results
    (its ``ex2`` does not flush; the two agree elsewhere). The kernels' sums and gradients are fp32
    and at least 1 or 2^−126 apart from such terms, and an exponential that underflows was already 0
    below e^−103. The interpreter computes ``tl.exp``, as torch does."""
    if COMPILED:
        power: tl.tensor = tl.math.exp2(x * LOG2E)
    else:
        power = tl.exp(x)
    return power


@triton.jit
def divided(a: tl.tensor, b: tl.tensor) -> tl.tensor:
    """``a/b`` as ``a·rcp(b)`` (``div.approx.ftz``: 2 ulp for ``|b|`` in [2^−126, 2^126]) in a
    compiled kernel, for a divisor known to lie in that range; Triton's ``/`` adds a range check
    and two rescalings to the same reciprocal. The interpreter divides."""
    if COMPILED:
        quotient = libdevice.fast_dividef(a, b)
    else:
        quotient = a / b
    return quotient


@triton.jit
def expm1(x: tl.tensor) -> tl.tensor:
    """``e^x − 1`` without cancellation near 0 (Kahan): with ``u = e^x``,
    ``(u − 1)·x / log u``; ``x`` where ``u`` rounds to 1, −1 where ``u − 1`` does, ``u`` once
    ``u`` is so large that the ratio would overflow."""
    u: tl.tensor = exp(x)
    um1 = u - 1.0
    # log u is 0 where u rounds to 1: log 2 there keeps the unused quotient finite instead of 0/0 = NaN.
    accurate = um1 * x / tl.log(tl.where(u == 1.0, 2.0, u))
    return tl.where(u == 1.0, x, tl.where(um1 == -1.0, -1.0, tl.where(u > 3.0e38, u, accurate)))


@triton.jit
def logaddexp(a: tl.tensor, b: tl.tensor) -> tl.tensor:
    """``log(e^a + e^b)`` shifted by ``max(a, b)``; ``logaddexp(−inf, −inf) = −inf``."""
    m = tl.maximum(a, b)
    # Both −inf: shifted by 0, so a − shift stays −inf, its exponential 0, and the result log 0 = −inf, not NaN.
    shift = tl.where(m == float("-inf"), 0.0, m)
    return shift + tl.log(exp(a - shift) + exp(b - shift))
