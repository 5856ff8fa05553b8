"""How every kernel walks a block of logits: its row tile, its column split and its masked loads.

A block is ``R`` rows × ``C`` columns of student logits ``s`` (and teacher logits ``t``), the
columns ``col_start … col_start + C − 1`` of the vocabulary, rows ``stride_s`` (``stride_t``)
elements apart, columns contiguous. Program ``(i, j)`` takes rows ``i·BLOCK_R …`` and the ``j``-th
split of ``cols_per_split`` columns (a multiple of ``BLOCK_C``, :mod:`.tiles`), which it walks in
``BLOCK_R × BLOCK_C`` tiles.

Every load and store is masked by the rows that exist and the columns of the split; columns
outside read −inf. Logits are loaded in their stored dtype (fp32 products, or a bf16/fp16 cache)
and upcast to fp32.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

__all__ = [
    "count",
    "empty_tuple",
    "load_row_constants",
    "load_tile",
    "local_labels",
    "normalized",
    "position",
    "program_tile",
    "row_tile",
    "teacher_at",
]


@triton.jit
def row_tile(R: tl.tensor, BLOCK_R: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """This program's ``BLOCK_R`` rows (``program_id(0)``) as int64 indices, and which exist."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
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
    rows = rows.to(tl.int64)
    c_begin = pid_c * cols_per_split
    c_end = tl.minimum(C, c_begin + cols_per_split)
    return rows, row_ok, c_begin, c_end


@triton.jit
def local_labels(labels_ptr: tl.tensor, rows: tl.tensor, row_ok: tl.tensor, col_start: tl.tensor) -> tl.tensor:
    """Each row's label as a column of the block (outside ``[0, C)`` when another block owns it)."""
    return tl.load(labels_ptr + rows, mask=row_ok, other=-1) - col_start


@triton.jit
def softcap(x: tl.tensor, cap: tl.tensor) -> tl.tensor:
    """``cap·tanh(x/cap)`` in fp32 (``tanh|y| = (1 − e^{−2|y|})/(1 + e^{−2|y|})``, the sign put
    back): one ``exp`` and one division per element, ``1/cap`` formed once per tile."""
    inverse = 1.0 / cap
    decay: tl.tensor = tl.exp(-2.0 * inverse * tl.abs(x))
    magnitude = cap * (1.0 - decay) / (1.0 + decay)
    return tl.where(x < 0.0, -magnitude, magnitude)


@triton.jit
def teacher_at(
    t_ptr: tl.tensor,
    rows: tl.tensor,
    cols: tl.tensor,
    ok: tl.tensor,
    stride_t: tl.tensor,
    indexed: tl.tuple,
    other: tl.constexpr,
    INDEXED: tl.constexpr,
) -> tl.tensor:
    """The teacher's logits at ``rows × cols`` (broadcast together, like ``ok``), fp32, ``other``
    outside ``ok``: stored at ``t_ptr``, or, with ``INDEXED``, an indexed block
    (``orda_tp.teachers.source.IndexedLogits``): ``t_ptr`` its positions and ``indexed =
    (values_ptr, values_stride)``, each entry the row's value at its position."""
    if INDEXED:
        values_ptr, values_stride = indexed
        place = tl.load(t_ptr + rows * stride_t + cols, mask=ok, other=0).to(tl.int64)
        return tl.load(values_ptr + rows * values_stride + place, mask=ok, other=other).to(tl.float32)
    return tl.load(t_ptr + rows * stride_t + cols, mask=ok, other=other).to(tl.float32)


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
    cap_s: tl.tensor,
    cap_t: tl.tensor,
    indexed: tl.tuple,
    HAS_T: tl.constexpr,
    INDEXED: tl.constexpr,
    CAPPED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor, tl.tensor]:
    """``(cols, ok, s, t)`` of the tile at columns ``c0 … c0 + BLOCK_C − 1``: ``ok`` marks the
    entries inside the rows and the split, ``s`` and ``t`` are fp32 and −inf outside ``ok`` (``t``
    is −inf everywhere without a teacher; an indexed teacher block with ``INDEXED``, see
    :func:`teacher_at`); a side whose ``CAPPED`` flag is set (student, teacher) is soft-capped by
    ``cap_s`` or ``cap_t`` as it is loaded."""
    cols = c0 + tl.arange(0, BLOCK_C)
    ok = row_ok[:, None] & (cols[None, :] < c_end)
    s = tl.load(s_ptr + rows[:, None] * stride_s + cols[None, :], mask=ok, other=float("-inf")).to(tl.float32)
    if CAPPED[0]:
        s = tl.where(ok, softcap(s, cap_s), s)
    if HAS_T:
        t = teacher_at(t_ptr, rows[:, None], cols[None, :], ok, stride_t, indexed, float("-inf"), INDEXED)
        if CAPPED[1]:
            t = tl.where(ok, softcap(t, cap_t), t)
    else:
        t = tl.full([BLOCK_R, BLOCK_C], float("-inf"), dtype=tl.float32)
    return cols, ok, s, t


@triton.jit
def normalized(
    s: tl.tensor, t: tl.tensor, inv_ts: tl.tensor, inv_tt: tl.tensor, lse_u: tl.tensor, lse_v: tl.tensor
) -> tuple[tl.tensor, tl.tensor, tl.tensor, tl.tensor]:
    """``(log p, log q, p, q)``: ``log p = s/T_s − LSE(u)``, ``log q = t/T_t − LSE(v)``."""
    logp = s * inv_ts - lse_u
    logq = t * inv_tt - lse_v
    return logp, logq, tl.exp(logp), tl.exp(logq)


@triton.jit
def load_row_constants(
    rowc_ptr: tl.tensor, rows: tl.tensor, row_ok: tl.tensor, COUNT: tl.constexpr
) -> tuple[tl.tensor, ...]:
    """The ``COUNT`` row constants of the rows, the columns of a contiguous (R, COUNT) fp32
    tensor, each as a (BLOCK_R, 1) column (0 on rows that do not exist)."""
    constants = empty_tuple()
    for j in tl.static_range(COUNT):
        constants += (tl.load(rowc_ptr + rows * COUNT + j, mask=row_ok, other=0.0)[:, None],)
    return constants


@triton.jit
def accumulated(sums: tl.tuple, terms: tl.tuple, ok: tl.tensor, like: tl.tensor, COUNT: tl.constexpr) -> tl.tuple:
    """``sums[k] + terms[k]`` on the tile's entries inside ``ok`` (0 outside) for ``k < COUNT``;
    a term constant along the row (a (BLOCK_R, 1) column) is broadcast to the tile ``like`` first."""
    added = empty_tuple()
    for k in tl.static_range(COUNT):
        added += (sums[k] + tl.where(ok, terms[k] + tl.zeros_like(like), 0.0),)
    return added


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
