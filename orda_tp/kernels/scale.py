"""``x *= scale`` in place over a flat tensor, the scale read on the device: an eager call's
gradients scaled by the upstream gradient in backward, where a 0-d CUDA tensor as ``mul_``'s
operand takes a slow broadcasting path.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["scale_kernel"]


@triton.jit(do_not_specialize=["n"])
def scale_kernel(x_ptr: tl.tensor, scale_ptr: tl.tensor, n: tl.tensor, BLOCK: tl.constexpr) -> None:
    """``x[i] = x[i]·scale[0]`` for ``i < n``, in fp32, stored back in ``x``'s dtype; nothing is
    read or written where ``scale[0] = 1`` (the product would round back to ``x[i]``). A few
    programs stride over the blocks of ``BLOCK`` elements, so that skipping costs a few loads."""
    scale = tl.load(scale_ptr)
    # 1, loss.backward()'s default, is skipped: no 1 GiB read and write of a bf16 128k × 4096 head's gradient.
    # Decided on the device: the host never reads the scale, so the skip costs no synchronization.
    if scale != 1.0:
        # int64 offsets: a head's gradient comes near 2^31 elements (128256 × 16384 ≈ 2.1·10^9), where int32 wraps.
        first = tl.program_id(0).to(tl.int64) * BLOCK
        for start in tl.range(first, n, tl.num_programs(0).to(tl.int64) * BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            ok = offsets < n
            x = tl.load(x_ptr + offsets, mask=ok)
            # In fp32, rounded once back into x's dtype; the tail's masked lanes are neither read nor written.
            tl.store(x_ptr + offsets, (x.to(tl.float32) * scale).to(x.dtype), mask=ok)
