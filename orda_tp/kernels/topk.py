"""Each row's ``K`` largest scaled logits and its log-partition: one pass over its columns that
keeps the ``K`` best groups of ``GROUP`` columns, ranked by their largest element, then a short
pass over those groups' columns (docs/architecture.md, "The kernels"). ``K`` and ``GROUP`` are
powers of two, ``BLOCK ≥ K·GROUP``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .block_io import softcap
from .partition import online_lse_update

__all__ = ["order_keys", "topk_kernel"]

#: The key of no column, below every column's.
NO_KEY: tl.constexpr = tl.constexpr(-(2**63))


@triton.jit
def order_keys(x: tl.tensor, columns: tl.tensor, ok: tl.tensor) -> tl.tensor:
    """int64 keys of fp32 values ``x`` at local ``columns`` (``NO_KEY`` where not ``ok``): the
    value's bits, negative patterns with all but the sign flipped (monotone; ``−0.0`` as
    ``+0.0``), above ``2³² − 1 − column``."""
    # −0.0 as +0.0: the two compare equal, so they must tie and be ordered by their column alone.
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    # Negative floats' bit patterns order backwards as integers: flipping all but the sign bit turns them round.
    monotone = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    # The value in the high 32 bits, 2³² − 1 − column below: among equal values the lower column ranks first.
    keys = (monotone << 32) | (0xFFFFFFFF - columns.to(tl.int64))
    return tl.where(ok, keys, NO_KEY)


@triton.jit
def scaled_logits(
    row_ptr: tl.tensor,
    columns: tl.tensor,
    ok: tl.tensor,
    inv_temperature: tl.tensor,
    cap: tl.tensor,
    HAS_CAP: tl.constexpr,
) -> tl.tensor:
    """The row's logits at ``columns`` in fp32, soft-capped and divided by the temperature
    (``−inf`` where not ``ok``)."""
    x = tl.load(row_ptr + columns, mask=ok, other=0.0).to(tl.float32)
    if HAS_CAP:
        x = softcap(x, cap)
    # −inf where not ok, set after the cap and the scale: a padded column adds nothing to m, z or a group's max.
    return tl.where(ok, x * inv_temperature, float("-inf"))


@triton.jit
def merged_keys(a: tl.tensor, b: tl.tensor, K: tl.constexpr) -> tl.tensor:
    """The ``K`` largest of two (K,) key vectors."""
    return tl.topk(tl.reshape(tl.join(a, b), [2 * K]), K)


@triton.jit
def topk_kernel(
    logits_ptr: tl.tensor,
    row_stride: tl.tensor,
    columns: tl.tensor,
    keys_ptr: tl.tensor,
    log_sum_ptr: tl.tensor,
    inv_temperature: tl.tensor,
    cap: tl.tensor,
    HAS_CAP: tl.constexpr,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    """Row ``program_id(0)`` of the (rows, ``columns``) logits: its ``K`` best keys, largest first,
    into ``keys`` (rows, K) and ``log Σ_j e^{t_j − m}`` of its scaled logits ``t`` (``m`` their
    maximum, the best key's value) into ``log_sum`` (rows,)."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    best_groups = tl.full([K], NO_KEY, tl.int64)
    m = tl.full([1], float("-inf"), tl.float32)
    z = tl.zeros([1], tl.float32)
    for start in tl.range(0, columns, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        ok = offsets < columns
        x = scaled_logits(row_ptr, offsets, ok, inv_temperature, cap, HAS_CAP)
        # The row as a (1, BLOCK) tile and (m, z) as (1,) vectors: the shapes online_lse_update reduces over.
        m, z = online_lse_update(m, z, tl.reshape(x, [1, BLOCK]))
        group_starts = start + tl.arange(0, BLOCK // GROUP) * GROUP
        group_best = tl.max(tl.reshape(x, [BLOCK // GROUP, GROUP]), axis=1)
        # A group that starts past the row's end is no group: NO_KEY, below every real key.
        group_keys = order_keys(group_best, group_starts, group_starts < columns)
        # Sort only when a group beats the K-th best kept: most blocks of a long row change nothing.
        if tl.max(group_keys, axis=0) > tl.min(best_groups, axis=0):
            best_groups = merged_keys(best_groups, tl.topk(group_keys, K), K)
    # Each kept group's first column, back from its key's low 32 bits (2³² − 1 − column).
    group_starts = ((0xFFFFFFFF - (best_groups & 0xFFFFFFFF)) // GROUP) * GROUP
    offsets = group_starts[:, None] + tl.arange(0, GROUP)[None, :]
    # A slot still at NO_KEY (a row of fewer than K groups) reads nothing; its offsets are meaningless.
    ok = (best_groups != NO_KEY)[:, None] & (offsets < columns)
    x = scaled_logits(row_ptr, offsets, ok, inv_temperature, cap, HAS_CAP)
    best = tl.topk(tl.reshape(order_keys(x, offsets, ok), [K * GROUP]), K)
    tl.store(keys_ptr + row * K + tl.arange(0, K), best)
    # Only log z, not m + log z: m is the best key's value, and (t − m) − log z stays exact on a peaked row.
    tl.store(log_sum_ptr + row + tl.arange(0, 1), tl.log(z))
