"""Round 2: the variant's column sums over a block, its generated ``COLUMN_TERMS`` of ``log p``,
``log q``, ``p`` and ``q`` (:meth:`orda_tp.divergences.Divergence.column_terms`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .block_io import (
    accumulated,
    load_tile,
    local_labels,
    normalized,
    program_tile,
    sparse_start,
    store_sums,
    zero_sums,
)

__all__ = ["sums_kernel"]


# R and col_start change with every chunk and shard: not specialized on, so a new value compiles nothing.
@triton.jit(do_not_specialize=["R", "col_start"])
def sums_kernel(
    s_ptr: tl.tensor,
    t_ptr: tl.tensor,
    labels_ptr: tl.tensor,
    lse_u_ptr: tl.tensor,
    lse_v_ptr: tl.tensor,
    out_ptr: tl.tensor,
    R: tl.tensor,
    C: tl.tensor,
    stride_s: tl.tensor,
    stride_t: tl.tensor,
    stride_lu: tl.tensor,
    stride_lv: tl.tensor,
    col_start: tl.tensor,
    cols_per_split: tl.tensor,
    caps: tl.tuple,
    sparse: tl.tuple,
    inv_temperatures: tl.tuple,
    COLUMN_TERMS: tl.constexpr,
    NUM_SUMS: tl.constexpr,
    HAS_T: tl.constexpr,
    SPARSE: tl.constexpr,
    CAPPED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
) -> None:
    """``Σ_columns COLUMN_TERMS(log p, log q, p, q, is_target)[k]`` for ``k < NUM_SUMS`` over this
    program's column split, written to split ``program_id(1)`` of ``out`` (splits, R, NUM_SUMS).
    ``lse_u``, ``lse_v``: the rows' merged log-partitions, any stride. The terms are accumulated
    per tile element and reduced across the columns once, at the end."""
    rows, row_ok, c_begin, c_end = program_tile(R, C, cols_per_split, BLOCK_R)
    local_label = local_labels(labels_ptr, rows, row_ok, col_start)[:, None]
    # Read through their strides: lse_u, lse_v are columns of the row step's (rows, outputs) result, not copied.
    # A missing row reads a finite 0; nothing of it is stored.
    lse_u = tl.load(lse_u_ptr + rows * stride_lu, mask=row_ok, other=0.0)[:, None]
    lse_v = tl.load(lse_v_ptr + rows * stride_lv, mask=row_ok, other=0.0)[:, None]
    sums = zero_sums(NUM_SUMS, BLOCK_R, BLOCK_C)
    ahead = sparse_start(sparse, rows, row_ok, col_start + c_begin, SPARSE)
    for c0 in tl.range(c_begin, c_end, BLOCK_C):
        cols, ok, s, t, ahead = load_tile(
            s_ptr, t_ptr, rows, row_ok, stride_s, stride_t, c0, c_end, col_start, caps,
            sparse, ahead, HAS_T, SPARSE, CAPPED, BLOCK_R, BLOCK_C,
        )  # fmt: skip
        # A label outside this split matches no entry inside ok (at most a padded one, which is masked).
        is_target = cols[None, :] == local_label
        # Padded entries give log p = log q = −inf and p = q = 0: accumulated drops them by ok, whatever the terms.
        logp, logq, p, q = normalized(s, t, inv_temperatures, lse_u, lse_v)
        sums = accumulated(sums, COLUMN_TERMS(logp, logq, p, q, is_target), ok, p, NUM_SUMS)
    # One slot per split (program_id(1)): the engine adds the splits' slots, and the shards' sums after them.
    store_sums(out_ptr, sums, rows, row_ok, R, NUM_SUMS)
