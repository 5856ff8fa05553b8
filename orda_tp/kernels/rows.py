"""One per-row step of a chunk between its column passes (``orda_tp.engine.row_formulas``), in one
launch: (R,) inputs and runtime floats into (R,) outputs, by the generated ``FORMULAS``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .block_io import empty_tuple, row_tile

__all__ = ["rows_kernel"]


# R changes with every chunk: not specialized on, so a new row count compiles nothing.
@triton.jit(do_not_specialize=["R"])
def rows_kernel(
    out_ptr: tl.tensor,
    R: tl.tensor,
    inputs: tl.tuple,
    scalars: tl.tuple,
    FORMULAS: tl.constexpr,
    NUM_OUTPUTS: tl.constexpr,
    BLOCK_R: tl.constexpr,
) -> None:
    """``out[:, j] = FORMULAS(inputs, scalars)[j]`` for ``j < NUM_OUTPUTS``, ``out`` (R,
    NUM_OUTPUTS) contiguous, in its dtype. Input ``i`` is a (pointer, stride) pair, read at
    ``pointer + row·stride`` (a stride 0 broadcasts one value) in its dtype, booleans included,
    and upcast to fp32."""
    rows, row_ok = row_tile(R, BLOCK_R)
    zero = tl.zeros([BLOCK_R], dtype=tl.float32)
    values = empty_tuple()
    for i in tl.static_range(len(inputs)):
        pointer, stride = inputs[i]
        # A missing row reads 0 (log 0 = −inf in a formula is harmless: the row is never stored).
        values += (tl.load(pointer + rows * stride, mask=row_ok, other=0).to(tl.float32),)
    results = FORMULAS(values, scalars)
    for j in tl.static_range(NUM_OUTPUTS):
        # A constant result is broadcast to the rows by the added zero.
        tl.store(out_ptr + rows * NUM_OUTPUTS + j, (results[j] + zero).to(out_ptr.dtype.element_ty), mask=row_ok)
