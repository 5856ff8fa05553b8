"""Elementwise kernels in place over a flat tensor.

- :func:`scale_kernel`: ``x *= scale``, the scale read on the device; used for the upstream
  gradient of a mean or sum loss (a 0-d CUDA tensor as the second operand of torch's ``mul_``
  takes a slow broadcasting path).
- :func:`softcap_kernel` (:func:`softcap_in_place`): ``x = cap·tanh(x/cap)`` in one read and one
  write, where torch's ``div_``, ``tanh_``, ``mul_`` would take three: the torch backend's capped
  blocks on CUDA (the Triton kernels cap a tile as they load it).
"""

from __future__ import annotations

from collections.abc import Callable

import triton
import triton.language as tl
from torch import Tensor

from .block_io import softcap

__all__ = ["scale_kernel", "softcap_in_place", "softcap_kernel"]

SOFTCAP_BLOCK = 4096


@triton.jit(do_not_specialize=["n"])
def scale_kernel(x_ptr: tl.tensor, scale_ptr: tl.tensor, n: tl.tensor, BLOCK: tl.constexpr) -> None:
    """``x[i] = x[i]·scale[0]`` for ``i < n``, in fp32, stored back in ``x``'s dtype."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < n
    x = tl.load(x_ptr + offsets, mask=ok)
    scale = tl.load(scale_ptr)
    tl.store(x_ptr + offsets, (x.to(tl.float32) * scale).to(x.dtype), mask=ok)


@triton.jit(do_not_specialize=["n"])
def softcap_kernel(x_ptr: tl.tensor, n: tl.tensor, cap: tl.tensor, BLOCK: tl.constexpr) -> None:
    """``x[i] = cap·tanh(x[i]/cap)`` for ``i < n`` in fp32 (:func:`.block_io.softcap`), stored back
    in ``x``'s dtype."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < n
    x = tl.load(x_ptr + offsets, mask=ok).to(tl.float32)
    tl.store(x_ptr + offsets, softcap(x, cap).to(x_ptr.dtype.element_ty), mask=ok)


def softcap_in_place(tensor: Tensor, cap: float) -> Tensor:
    """``tensor = cap·tanh(tensor/cap)`` in one launch (a contiguous CUDA tensor); returns it."""
    count = tensor.numel()
    if count:
        launch: Callable[..., object] = softcap_kernel[(triton.cdiv(count, SOFTCAP_BLOCK),)]
        launch(tensor, count, float(cap), BLOCK=SOFTCAP_BLOCK)
    return tensor
