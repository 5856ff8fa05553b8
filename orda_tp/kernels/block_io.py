"""How every kernel walks a block of ``R × C`` logits (global columns from ``col_start``, rows
``stride`` elements apart, columns contiguous): program ``(i, j)`` takes row tile ``i`` and column
split ``j`` in ``BLOCK_R × BLOCK_C`` tiles, every load and store masked (columns outside read −inf),
logits loaded in their stored dtype and upcast to fp32.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from .elementwise import LOG2E, divided, exp

__all__ = [
    "count",
    "empty_tuple",
    "listed_step",
    "load_row_constants",
    "load_tile",
    "local_labels",
    "normalized",
    "position",
    "program_tile",
    "row_tile",
    "sparse_at",
    "sparse_start",
    "sparse_tile",
    "store_sums",
    "zero_sums",
]


@triton.jit
def row_tile(R: tl.tensor, BLOCK_R: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """This program's ``BLOCK_R`` rows (``program_id(0)``) as int64 indices, and which exist."""
    # The last row tile runs past R: its missing rows are masked out of every load and store.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    # int64 before any pointer arithmetic: rows·stride can pass 2^31 elements (17k rows × a 128k vocabulary).
    return rows.to(tl.int64), row_ok


@triton.jit
def program_tile(
    R: tl.tensor, C: tl.tensor, cols_per_split: tl.tensor, BLOCK_R: tl.constexpr
) -> tuple[tl.tensor, tl.tensor, tl.tensor, tl.tensor]:
    """``(rows, row_ok, c_begin, c_end)``: this program's ``BLOCK_R`` rows (``program_id(0)``)
    as int64 indices and which of them exist, and the block columns ``[c_begin, c_end)`` of its
    split (``program_id(1)``)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    # int64, as in row_tile: rows·stride can pass 2^31 elements.
    rows = rows.to(tl.int64)
    c_begin = pid_c * cols_per_split
    # The last split stops at C; the splits are whole multiples of BLOCK_C, so only its last tile can be partial.
    c_end = tl.minimum(C, c_begin + cols_per_split)
    return rows, row_ok, c_begin, c_end


@triton.jit
def local_labels(labels_ptr: tl.tensor, rows: tl.tensor, row_ok: tl.tensor, col_start: tl.tensor) -> tl.tensor:
    """Each row's label as a column of the block (outside ``[0, C)`` when another block owns it)."""
    # A missing row reads −1: still negative after the shift, so no column of the block ever matches it.
    return tl.load(labels_ptr + rows, mask=row_ok, other=-1) - col_start


@triton.jit
def softcap(x: tl.tensor, cap: tl.tensor) -> tl.tensor:
    """``cap·tanh(x/cap)`` in fp32, as ``cap·(1 − d)/(1 + d)`` with ``d = e^{−2y}``, ``y = x/cap``
    clamped at −9 (``tanh y`` rounds to −1 there, and ``d ≤ e^18`` stays finite; NaN stays NaN):
    one ``exp2`` and one reciprocal per element (:func:`.elementwise.divided`, its divisor in
    [1, e^18]), seven instructions in all; the clamp and the factor of ``x`` are formed once."""
    # Only the low side needs the clamp: a large positive y drives d to 0 and the result to cap, no overflow.
    floor = -9.0 * cap
    # propagate_nan=ALL: the default leaves NaN handling unspecified; this keeps a NaN logit NaN, not the clamp.
    decay: tl.tensor = tl.math.exp2(tl.maximum(x, floor, propagate_nan=tl.PropagateNan.ALL) * (-2.0 * LOG2E / cap))
    return divided(cap - cap * decay, 1.0 + decay)


NO_ID = tl.constexpr(1 << 62)  # an id past every column: where a row's sorted ids end
SPARSE_STEP = tl.constexpr(32)  # a sparse block's ids read this many at a time when a row's are searched


@triton.jit
def listed_step(sparse: tl.tuple, rows: tl.tensor, mask: tl.tensor, m0: tl.tensor) -> tuple[tl.tensor, tl.tensor]:
    """Ids ``m0 … m0 + SPARSE_STEP − 1`` of each row of a sparse block and their values (fp32),
    (rows, SPARSE_STEP); :data:`NO_ID` and 0 past the row's ``k`` ids or outside ``mask``."""
    ids_ptr, values_ptr, stride, k = sparse
    m = m0 + tl.arange(0, SPARSE_STEP)
    # Past the row's k ids (or on a masked row) an entry reads NO_ID and 0: it lies inside no column range.
    present = mask[:, None] & (m[None, :] < k)
    ids = tl.load(ids_ptr + rows[:, None] * stride + m[None, :], mask=present, other=NO_ID)
    values = tl.load(values_ptr + rows[:, None] * stride + m[None, :], mask=present, other=0.0)
    return ids, values.to(tl.float32)


@triton.jit
def sparse_start(
    sparse: tl.tuple, rows: tl.tensor, row_ok: tl.tensor, first: tl.tensor, SPARSE: tl.constexpr
) -> tl.tensor:
    """Per row, how many of a sparse block's sorted ids lie before global column ``first``: where
    the row's walk over a split's tiles starts (zeros without ``SPARSE``). ``sparse = (ids_ptr,
    values_ptr, stride, k)`` (``orda_tp.teachers.source.SparseLogits``)."""
    ahead = tl.zeros(rows.shape, dtype=tl.int32)
    if SPARSE:
        ids_ptr, values_ptr, stride, k = sparse
        for m0 in tl.range(0, k, SPARSE_STEP):
            ids, values = listed_step(sparse, rows, row_ok, m0)
            # Ids ascend, so the count of those before `first` is the index of the row's first id at or past it.
            ahead += tl.sum(tl.where(ids < first, 1, 0), axis=1).to(tl.int32)
    return ahead


@triton.jit
def sparse_tile(
    fill_ptr: tl.tensor,
    sparse: tl.tuple,
    rows: tl.tensor,
    row_ok: tl.tensor,
    first: tl.tensor,
    ok: tl.tensor,
    ahead: tl.tensor,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    """``(t, ahead)``: a sparse block's tile at global columns ``first … first + BLOCK_C − 1``, fp32,
    −inf outside ``ok``: each row's fill, with the row's listed values at their columns. ``ahead``:
    per row, how many of its sorted ids lie before the tile; returned advanced past the tile's.
    Each row's next id is compared with the tile's columns until no row has one left inside it,
    so a tile costs one pass per listed id of its fullest row, and no load per entry."""
    ids_ptr, values_ptr, stride, k = sparse
    offsets = tl.arange(0, BLOCK_C)  # int32 columns of the tile, compared with each id's offset
    end = first + BLOCK_C
    fill = tl.load(fill_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    # Every column starts at its row's fill; the loop below overwrites the listed ones.
    t = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32) + fill[:, None]
    # Each row's next id: the ids before the tile were passed already (sparse_start, earlier tiles).
    listed = tl.load(ids_ptr + rows * stride + ahead, mask=row_ok & (ahead < k), other=NO_ID)
    inside = listed < end
    # Until no row has an id left in the tile; a row with none sits the remaining passes out.
    while tl.max(inside.to(tl.int32), axis=0) > 0:
        value = tl.load(values_ptr + rows * stride + ahead, mask=inside, other=0.0).to(tl.float32)
        # −1 matches no column of the tile: a row without an id inside leaves its tile as it is.
        offset = tl.where(inside, listed - first, -1).to(tl.int32)
        t = tl.where(offsets[None, :] == offset[:, None], value[:, None], t)
        # Only the rows that placed an id move on to their next one; past k, NO_ID ends a row's walk.
        ahead += inside.to(tl.int32)
        listed = tl.load(ids_ptr + rows * stride + ahead, mask=row_ok & (ahead < k), other=NO_ID)
        inside = listed < end
    # The padded entries hold the fill too: −inf there, as a dense load gives them.
    return tl.where(ok, t, float("-inf")), ahead


@triton.jit
def sparse_at(fill_ptr: tl.tensor, sparse: tl.tuple, rows: tl.tensor, column: tl.tensor, mask: tl.tensor) -> tl.tensor:
    """A sparse block's value at one global ``column`` per row (its listed value, else its fill),
    fp32, 0 outside ``mask``."""
    found = tl.load(fill_ptr + rows, mask=mask, other=0.0).to(tl.float32)
    ids_ptr, values_ptr, stride, k = sparse
    for m0 in tl.range(0, k, SPARSE_STEP):
        ids, values = listed_step(sparse, rows, mask, m0)
        hit = ids == column[:, None]
        # A row's ids are distinct, so this masked sum is the one listed value at the column.
        listed = tl.sum(tl.where(hit, values, 0.0), axis=1)
        found = tl.where(tl.max(hit.to(tl.int32), axis=1) > 0, listed, found)
    # 0 outside mask: a split that does not own the label adds nothing when the records are summed.
    return tl.where(mask, found, 0.0)


@triton.jit
def load_tile(
    s_ptr: tl.tensor,
    t_ptr: tl.tensor,
    rows: tl.tensor,
    row_ok: tl.tensor,
    stride_s: tl.tensor,
    stride_t: tl.tensor,
    c0: tl.tensor,
    c_end: tl.tensor,
    col_start: tl.tensor,
    caps: tl.tuple,
    sparse: tl.tuple,
    ahead: tl.tensor,
    HAS_T: tl.constexpr,
    SPARSE: tl.constexpr,
    CAPPED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor, tl.tensor, tl.tensor]:
    """``(cols, ok, s, t, ahead)`` of the tile at columns ``c0 … c0 + BLOCK_C − 1``: ``ok`` marks
    the entries inside the rows and the split, ``s`` and ``t`` are fp32 and −inf outside ``ok``
    (``t`` is −inf everywhere without a teacher); a side whose ``CAPPED`` flag is set (student,
    teacher) is soft-capped by its ``caps = (cap_s, cap_t)`` as it is loaded. With ``SPARSE`` the
    teacher is a sparse block (``t_ptr`` its fill, ``sparse`` its ids and values,
    :func:`sparse_tile`, which advances ``ahead``; block column 0 is global column ``col_start``)."""
    cap_s, cap_t = caps
    cols = c0 + tl.arange(0, BLOCK_C)
    ok = row_ok[:, None] & (cols[None, :] < c_end)
    # −inf outside ok: a padded entry adds nothing to a max, and e^(−inf) = 0 to a sum.
    s = tl.load(s_ptr + rows[:, None] * stride_s + cols[None, :], mask=ok, other=float("-inf")).to(tl.float32)
    if CAPPED[0]:
        # Capped only inside ok: softcap(−inf) is the finite −cap, which would give padded entries mass.
        s = tl.where(ok, softcap(s, cap_s), s)
    if HAS_T:
        if SPARSE:
            # A sparse block's ids are global vocabulary columns: the tile starts at global column col_start + c0.
            t, ahead = sparse_tile(t_ptr, sparse, rows, row_ok, col_start + c0, ok, ahead, BLOCK_R, BLOCK_C)
        else:
            t = tl.load(t_ptr + rows[:, None] * stride_t + cols[None, :], mask=ok, other=float("-inf"))
            t = t.to(tl.float32)
        if CAPPED[1]:
            # As for the student: padded entries keep −inf rather than softcap(−inf) = −cap.
            t = tl.where(ok, softcap(t, cap_t), t)
    else:
        # No teacher tile: −inf, the value of an entry with no logit, so the stand-in carries no mass (q = 0).
        t = tl.full([BLOCK_R, BLOCK_C], float("-inf"), dtype=tl.float32)
    return cols, ok, s, t, ahead


@triton.jit
def normalized(
    s: tl.tensor, t: tl.tensor, inv_temperatures: tl.tuple, lse_u: tl.tensor, lse_v: tl.tensor
) -> tuple[tl.tensor, tl.tensor, tl.tensor, tl.tensor]:
    """``(log p, log q, p, q)``: ``log p = s/T_s − LSE(u)``, ``log q = t/T_t − LSE(v)``;
    ``inv_temperatures = (1/T_s, 1/T_t)``."""
    inv_ts, inv_tt = inv_temperatures
    # −inf entries (padded, or no teacher) give log p = −inf and p = 0; callers drop the padded ones by ok.
    logp = s * inv_ts - lse_u
    logq = t * inv_tt - lse_v
    return logp, logq, exp(logp), exp(logq)


@triton.jit
def load_row_constants(
    rowc_ptr: tl.tensor, rows: tl.tensor, row_ok: tl.tensor, COUNT: tl.constexpr
) -> tuple[tl.tensor, ...]:
    """The ``COUNT`` row constants of the rows, the columns of a contiguous (R, COUNT) fp32
    tensor, each as a (BLOCK_R, 1) column (0 on rows that do not exist)."""
    constants = empty_tuple()
    for j in tl.static_range(COUNT):
        # Each constant as a (BLOCK_R, 1) column, so that it broadcasts along the tile's columns.
        constants += (tl.load(rowc_ptr + rows * COUNT + j, mask=row_ok, other=0.0)[:, None],)
    return constants


@triton.jit
def accumulated(sums: tl.tuple, terms: tl.tuple, ok: tl.tensor, like: tl.tensor, COUNT: tl.constexpr) -> tl.tuple:
    """``sums[k] + terms[k]`` on the tile's entries inside ``ok`` (0 outside) for ``k < COUNT``;
    a term constant along the row (a (BLOCK_R, 1) column) is broadcast to the tile ``like`` first."""
    added = empty_tuple()
    for k in tl.static_range(COUNT):
        # A where, not a product with ok: a padded entry's term may be NaN (0·(−inf − (−inf))), and 0·NaN is NaN.
        added += (sums[k] + tl.where(ok, terms[k] + tl.zeros_like(like), 0.0),)
    return added


@triton.jit
def zero_sums(COUNT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr) -> tl.tuple:
    """``COUNT`` fp32 tiles of zeros, the per-element accumulators of a pass's column sums."""
    sums = empty_tuple()
    for _ in tl.static_range(COUNT):
        # Per element, not per row: the cross-lane reduction then runs once per split (store_sums), not once a tile.
        sums += (tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32),)
    return sums


@triton.jit
def store_sums(
    out_ptr: tl.tensor, sums: tl.tuple, rows: tl.tensor, row_ok: tl.tensor, R: tl.tensor, COUNT: tl.constexpr
) -> None:
    """Each accumulator of ``sums`` reduced over its columns, into split ``program_id(1)`` of
    ``out`` (splits, R, COUNT)."""
    # Each split writes its own slot, with no atomic add: the slots are summed afterwards, the same way each run.
    base = out_ptr + tl.program_id(1) * R * COUNT + rows * COUNT
    for k in tl.static_range(COUNT):
        tl.store(base + k, tl.sum(sums[k], axis=1), mask=row_ok)


@triton.jit
def empty_tuple() -> tuple[Any, ...]:
    """``()``, to grow a tuple in a ``tl.static_range`` loop (mypy types a literal ``()`` as the
    empty tuple for good)."""
    return ()


@triton.constexpr_function
def count(values: tuple[object, ...]) -> int:
    """``len(values)`` of a constexpr tuple, at compile time."""
    return len(values)


@triton.constexpr_function
def position(names: tuple[str, ...], name: str) -> int:
    """Where row constant ``name`` is among ``names`` (the columns of a row-constants tensor), at
    compile time."""
    return names.index(name)
