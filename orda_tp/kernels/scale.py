"""``x *= scale`` in place over a flat tensor, the scale read on the device.

Used for the upstream gradient of a mean or sum loss: a 0-d CUDA tensor as the second operand of
torch's ``mul_`` takes a slow broadcasting path.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["scale_kernel"]


@triton.jit(do_not_specialize=["n"])
def scale_kernel(x_ptr: tl.tensor, scale_ptr: tl.tensor, n: tl.tensor, BLOCK: tl.constexpr) -> None:
    """``x[i] = x[i]·scale[0]`` for ``i < n``, in fp32, stored back in ``x``'s dtype."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < n
    x = tl.load(x_ptr + offsets, mask=ok)
    scale = tl.load(scale_ptr)
    tl.store(x_ptr + offsets, (x.to(tl.float32) * scale).to(x.dtype), mask=ok)
