"""``x *= scale`` in place over a flat tensor, the scale read on the device.

Used for the upstream gradient of a mean or sum loss: a 0-d CUDA tensor as the second operand of
torch's ``mul_`` takes a slow broadcasting path. With a scale of exactly 1 (``loss.backward()``'s
default) ``x·1`` rounds back to ``x``, so the kernel reads and writes nothing: a bf16 head's
gradient is 1 GiB read and written again at 128k × 4096 otherwise.
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
