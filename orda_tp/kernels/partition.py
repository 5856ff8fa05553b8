"""Round 1: a block's packed partition record (:func:`partition_kernel`), and the merge of a stack
of records (:func:`merge_kernel`: column splits, or the shards' gathered records); the record and
its merge: docs/architecture.md, "Round 1".
"""

from __future__ import annotations

import triton
import triton.language as tl

from .block_io import (
    SPARSE_STEP,
    accumulated,
    empty_tuple,
    listed_step,
    load_tile,
    local_labels,
    program_tile,
    row_tile,
    softcap,
    sparse_at,
    sparse_start,
    zero_sums,
)
from .elementwise import exp

__all__ = [
    "label_logits",
    "listed_partition",
    "merge_kernel",
    "nothing_seen",
    "online_lse_update",
    "partition_kernel",
    "store_record",
    "tile_update",
    "with_listed_teacher",
]


@triton.jit
def online_lse_update(m: tl.tensor, z: tl.tensor, x: tl.tensor) -> tuple[tl.tensor, tl.tensor]:
    """``(m, z)`` of the columns seen so far, updated with a (BLOCK_R, BLOCK_C) tile ``x``:
    ``m' = max(m, max x)``, ``z' = z·e^{m−m'} + Σ e^{x−m'}`` (shifted by 0 while ``m'`` is −inf)."""
    new = tl.maximum(m, tl.max(x, axis=1))
    # A row with nothing finite yet (new = −inf) shifts by 0: x − new would be −inf − (−inf) = NaN.
    shift = tl.where(new == float("-inf"), 0.0, new)
    # Nothing seen before this tile (m = −inf): z is 0 and stays 0, whatever the shift.
    z = tl.where(m == float("-inf"), 0.0, z * exp(m - shift))
    # Padded entries are −inf: e^(−inf − shift) = 0 adds nothing.
    z += tl.sum(exp(x - shift[:, None]), axis=1)
    return new, z


@triton.jit
def listed_partition(
    fill_ptr: tl.tensor,
    sparse: tl.tuple,
    rows: tl.tensor,
    row_ok: tl.tensor,
    first: tl.tensor,
    end: tl.tensor,
    inv_temperature: tl.tensor,
) -> tuple[tl.tensor, tl.tensor]:
    """``(m, z)`` of ``x = t/T`` over global columns ``first … end − 1`` of a sparse block, from
    its rows alone: the listed values inside the range, and ``n`` unlisted columns at the fill
    ``τ`` (``z += n·e^{τ/T − m}``), so no tile of the teacher is formed."""
    # No soft-cap here: the plan refuses a teacher soft-cap on a cache, whose values are taken as capped.
    m = tl.full(rows.shape, float("-inf"), dtype=tl.float32)
    z = tl.zeros(rows.shape, dtype=tl.float32)
    listed = tl.zeros(rows.shape, dtype=tl.int32)
    ids_ptr, values_ptr, stride, k = sparse
    for m0 in tl.range(0, k, SPARSE_STEP):
        ids, values = listed_step(sparse, rows, row_ok, m0)
        # Ids of other splits (and NO_ID) count neither as listed here nor in the partition: −inf adds nothing.
        inside = (ids >= first) & (ids < end)
        listed += tl.sum(inside.to(tl.int32), axis=1)
        m, z = online_lse_update(m, z, tl.where(inside, values * inv_temperature, float("-inf")))
    # A missing row reads a −inf fill, so it has no unlisted columns.
    fill = tl.load(fill_ptr + rows, mask=row_ok, other=float("-inf")).to(tl.float32) * inv_temperature
    # The range's other columns all hold the fill; a −inf fill (no mass off the list) counts none of them.
    unlisted = tl.where(row_ok & (fill > float("-inf")), end - first - listed, 0).to(tl.float32)
    # The fill counts toward the max only where some column holds it, not when the list covers the range.
    top = tl.where(unlisted > 0.0, tl.maximum(m, fill), m)
    # As in online_lse_update: an all −inf row shifts by 0, so no −inf − (−inf).
    shift = tl.where(top == float("-inf"), 0.0, top)
    z = tl.where(m == float("-inf"), 0.0, z * exp(m - shift))
    # The n unlisted columns in one term, n·e^(τ/T − top), instead of one exponential each.
    z += tl.where(unlisted > 0.0, unlisted * exp(fill - shift), 0.0)
    return top, z


@triton.jit
def label_logits(
    s_ptr: tl.tensor,
    t_ptr: tl.tensor,
    rows: tl.tensor,
    stride_s: tl.tensor,
    stride_t: tl.tensor,
    label: tl.tensor,
    owned: tl.tensor,
    caps: tl.tuple,
    col_start: tl.tensor,
    sparse: tl.tuple,
    HAS_T: tl.constexpr,
    SPARSE: tl.constexpr,
    CAPPED: tl.constexpr,
    BLOCK_R: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    """The rows' student and teacher logits at their label where ``owned`` (0 elsewhere, and for
    a missing teacher), fp32, soft-capped as the tiles are; with ``SPARSE`` the teacher's is looked
    up among the row's listed ids (:func:`.block_io.sparse_at`; block column 0 is global column
    ``col_start``)."""
    cap_s, cap_t = caps
    # Masked to the owner: every other split and shard reads 0, so the summed records hold the owner's logit.
    target_s = tl.load(s_ptr + rows * stride_s + label, mask=owned, other=0.0).to(tl.float32)
    if CAPPED[0]:
        # softcap(0) = 0: the 0 of a row that does not own the label stays 0.
        target_s = softcap(target_s, cap_s)
    if HAS_T:
        if SPARSE:
            # Looked up among the row's listed ids, which are global columns: no teacher tile is needed.
            target_t = sparse_at(t_ptr, sparse, rows, col_start + label, owned)
        else:
            target_t = tl.load(t_ptr + rows * stride_t + label, mask=owned, other=0.0).to(tl.float32)
        if CAPPED[1]:
            target_t = softcap(target_t, cap_t)
    else:
        # No teacher: t_y is 0, as on a row whose label another split owns.
        target_t = tl.zeros([BLOCK_R], dtype=tl.float32)
    return target_s, target_t


@triton.jit
def nothing_seen(
    NUM_FAMILIES: tl.constexpr, NUM_COLUMN_SUMS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
) -> tuple[tl.tuple, tl.tuple]:
    """A record before its first column: per family ``(m, z) = (−inf, 0)``, and per column sum a
    (BLOCK_R, BLOCK_C) tile of zeros (accumulated per element, reduced once at the end)."""
    partials = empty_tuple()
    for _ in tl.static_range(NUM_FAMILIES):
        # (−inf, 0) is the identity of the merge: merged with any (m, z) it gives (m, z) back.
        partials += ((tl.full([BLOCK_R], float("-inf"), dtype=tl.float32), tl.zeros([BLOCK_R], dtype=tl.float32)),)
    return partials, zero_sums(NUM_COLUMN_SUMS, BLOCK_R, BLOCK_C)


@triton.jit
def with_listed_teacher(
    partials: tl.tuple,
    fill_ptr: tl.tensor,
    sparse: tl.tuple,
    rows: tl.tensor,
    row_ok: tl.tensor,
    first: tl.tensor,
    end: tl.tensor,
    inv_temperatures: tl.tuple,
    READS_TEACHER: tl.constexpr,
    NUM_FAMILIES: tl.constexpr,
) -> tl.tuple:
    """``partials`` with each teacher family's ``(m, z)`` over global columns ``first … end − 1``
    taken from a sparse block's rows (:func:`listed_partition`); the student's families as given."""
    families = empty_tuple()
    for f in tl.static_range(NUM_FAMILIES):
        # READS_TEACHER is constexpr: each family's branch is chosen when the kernel is compiled.
        if READS_TEACHER[f]:
            families += (listed_partition(fill_ptr, sparse, rows, row_ok, first, end, inv_temperatures[f]),)
        else:
            families += (partials[f],)
    return families


@triton.jit
def tile_update(
    partials: tl.tuple,
    s: tl.tensor,
    t: tl.tensor,
    inv_temperatures: tl.tuple,
    READS_TEACHER: tl.constexpr,
    TEACHER_LISTED: tl.constexpr,
    NUM_FAMILIES: tl.constexpr,
) -> tl.tuple:
    """Each family's ``(m, z)`` updated with a tile (:func:`online_lse_update` on ``s/T`` or
    ``t/T``); the teacher's families are left alone where ``TEACHER_LISTED`` formed them already."""
    updated = empty_tuple()
    for f in tl.static_range(NUM_FAMILIES):
        m, z = partials[f]
        if READS_TEACHER[f] and TEACHER_LISTED:
            # Already formed over the whole split from the listed values; this tile's t is only the −inf stand-in.
            updated += ((m, z),)
        else:
            updated += (online_lse_update(m, z, (t if READS_TEACHER[f] else s) * inv_temperatures[f]),)
    return updated


@triton.jit
def store_record(
    base: tl.tensor,
    partials: tl.tuple,
    label_columns: tl.tuple,
    sums: tl.tuple,
    row_ok: tl.tensor,
    NUM_FAMILIES: tl.constexpr,
    NUM_COLUMN_SUMS: tl.constexpr,
) -> None:
    """A record's columns at ``base`` (one row per pointer): each family's ``m`` then its ``z``,
    the three ``label_columns`` (``s_y``, ``t_y``, ``hits``), then each column sum reduced over
    its tile."""
    for f in tl.static_range(NUM_FAMILIES):
        m, z = partials[f]
        tl.store(base + f, m, mask=row_ok)
        tl.store(base + NUM_FAMILIES + f, z, mask=row_ok)
    for j in tl.static_range(3):
        tl.store(base + 2 * NUM_FAMILIES + j, label_columns[j], mask=row_ok)
    for k in tl.static_range(NUM_COLUMN_SUMS):
        tl.store(base + 2 * NUM_FAMILIES + 3 + k, tl.sum(sums[k], axis=1), mask=row_ok)


# R and col_start change with every chunk and shard: not specialized on, so a new value compiles nothing.
@triton.jit(do_not_specialize=["R", "col_start"])
def partition_kernel(
    s_ptr: tl.tensor,
    t_ptr: tl.tensor,
    labels_ptr: tl.tensor,
    out_ptr: tl.tensor,
    R: tl.tensor,
    C: tl.tensor,
    stride_s: tl.tensor,
    stride_t: tl.tensor,
    col_start: tl.tensor,
    cols_per_split: tl.tensor,
    caps: tl.tuple,
    sparse: tl.tuple,
    inv_temperatures: tl.tuple,
    READS_TEACHER: tl.constexpr,
    NUM_FAMILIES: tl.constexpr,
    COLUMN_SUMS: tl.constexpr,
    NUM_COLUMN_SUMS: tl.constexpr,
    WIDTH: tl.constexpr,
    HAS_T: tl.constexpr,
    SPARSE: tl.constexpr,
    TEACHER_LISTED: tl.constexpr,
    CAPPED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
) -> None:
    """The record of this program's rows over its column split, written to split
    ``program_id(1)`` of ``out`` (splits, R, WIDTH), in the packed layout
    (:func:`orda_tp.engine.records.packed_columns`). Family ``f`` reads ``t`` when
    ``READS_TEACHER[f]``, else ``s``, times ``inv_temperatures[f] = 1/T``. The label's logits are
    loaded once per row, by the split that owns the label column. A side whose ``CAPPED`` flag is
    set is soft-capped by its ``caps = (cap_s, cap_t)`` as it is read. ``COLUMN_SUMS(s, t)``: the
    ``E = NUM_COLUMN_SUMS`` column terms, accumulated per tile element and reduced once. With
    ``TEACHER_LISTED`` (a sparse teacher whose tiles no column sum reads) the teacher's families
    come from its listed values and fill (:func:`listed_partition`) and the tiles hold the
    student alone."""
    # The teacher's tiles are loaded only when something reads them: not when its families come from its list.
    TILE_T: tl.constexpr = tl.constexpr(HAS_T and not TEACHER_LISTED)
    TILE_SPARSE: tl.constexpr = SPARSE and TILE_T
    rows, row_ok, c_begin, c_end = program_tile(R, C, cols_per_split, BLOCK_R)
    label = local_labels(labels_ptr, rows, row_ok, col_start)
    # A label's column lies in one split of one block only, so the merged s_y, t_y and hits count it once.
    owned = row_ok & (label >= c_begin) & (label < c_end)
    target_s, target_t = label_logits(
        s_ptr, t_ptr, rows, stride_s, stride_t, label, owned, caps, col_start, sparse,
        HAS_T, SPARSE, CAPPED, BLOCK_R,
    )  # fmt: skip
    partials, sums = nothing_seen(NUM_FAMILIES, NUM_COLUMN_SUMS, BLOCK_R, BLOCK_C)
    if TEACHER_LISTED:
        # The split's teacher partition from each row's k listed values and its fill, before any tile.
        partials = with_listed_teacher(
            partials, t_ptr, sparse, rows, row_ok, col_start + c_begin, col_start + c_end, inv_temperatures,
            READS_TEACHER, NUM_FAMILIES,
        )  # fmt: skip
    # Where each row's sorted ids reach the split's first global column; zeros unless the tiles walk them.
    ahead = sparse_start(sparse, rows, row_ok, col_start + c_begin, TILE_SPARSE)
    for c0 in tl.range(c_begin, c_end, BLOCK_C):
        cols, ok, s, t, ahead = load_tile(
            s_ptr, t_ptr, rows, row_ok, stride_s, stride_t, c0, c_end, col_start, caps,
            sparse, ahead, TILE_T, TILE_SPARSE, CAPPED, BLOCK_R, BLOCK_C,
        )  # fmt: skip
        partials = tile_update(partials, s, t, inv_temperatures, READS_TEACHER, TEACHER_LISTED, NUM_FAMILIES)
        # A constexpr test: a plan without column sums compiles no call of COLUMN_SUMS at all.
        if NUM_COLUMN_SUMS > 0:
            sums = accumulated(sums, COLUMN_SUMS(s, t), ok, s, NUM_COLUMN_SUMS)
    # Each split writes its own record, no atomics: merge_kernel then folds them in split order.
    base = out_ptr + tl.program_id(1) * R * WIDTH + rows * WIDTH
    # hits is 1 from the owner alone: summed over splits and shards, 1 where some block owns the label, else 0.
    store_record(
        base, partials, (target_s, target_t, tl.where(owned, 1.0, 0.0)), sums, row_ok, NUM_FAMILIES, NUM_COLUMN_SUMS
    )


# R and S (the splits, or the shards gathered) vary between calls: not specialized on, so nothing recompiles.
@triton.jit(do_not_specialize=["R", "S"])
def merge_kernel(
    in_ptr: tl.tensor,
    out_ptr: tl.tensor,
    R: tl.tensor,
    S: tl.tensor,
    NUM_FAMILIES: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_R: tl.constexpr,
) -> None:
    """Fold ``S`` stacked packed records (S, R, WIDTH), contiguous fp32, into one
    (R, WIDTH): per family ``M = max_k m_k`` and ``z = Σ_k z_k·e^{m_k−M}`` (0 for ``m_k = −inf``),
    then the sums of ``s_y``, ``t_y``, ``hits`` and the column sums; the same merge as
    :func:`orda_tp.engine.records.merge_stacked_records`."""
    rows, row_ok = row_tile(R, BLOCK_R)
    # Two passes per family: the overall max first, so each z_k is rescaled once, as the torch merge does.
    for f in tl.static_range(NUM_FAMILIES):
        top = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        # The splits in index order, in every loop here: one stack always merges to the same bits, on any rank.
        for split in tl.range(S):
            top = tl.maximum(top, tl.load(in_ptr + split * R * WIDTH + rows * WIDTH + f, mask=row_ok, other=0.0))
        total = tl.zeros([BLOCK_R], dtype=tl.float32)
        for split in tl.range(S):
            m = tl.load(in_ptr + split * R * WIDTH + rows * WIDTH + f, mask=row_ok, other=0.0)
            z = tl.load(in_ptr + split * R * WIDTH + rows * WIDTH + NUM_FAMILIES + f, mask=row_ok, other=0.0)
            # A split that saw nothing finite adds 0: where top is −inf too, m − top would be −inf − (−inf) = NaN.
            total += tl.where(m == float("-inf"), 0.0, z * exp(m - top))
        tl.store(out_ptr + rows * WIDTH + f, top, mask=row_ok)
        tl.store(out_ptr + rows * WIDTH + NUM_FAMILIES + f, total, mask=row_ok)
    # s_y, t_y, hits and the column sums add up: a split that does not own the label holds 0 in the first three.
    for k in tl.static_range(2 * NUM_FAMILIES, WIDTH):
        total = tl.zeros([BLOCK_R], dtype=tl.float32)
        for split in tl.range(S):
            total += tl.load(in_ptr + split * R * WIDTH + rows * WIDTH + k, mask=row_ok, other=0.0)
        tl.store(out_ptr + rows * WIDTH + k, total, mask=row_ok)
