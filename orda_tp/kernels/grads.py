"""The logit gradients of a block, those of ``BlockMath.stage_logit_grads``, written once in the
staging dtype of the gradient GEMMs; ``∂D/∂u`` and ``∂D/∂v`` are the variant's generated
``STUDENT_GRAD`` and ``TEACHER_GRAD``, and with ``COLUMN_TERMS`` the kernel also sums round 2 as it
goes (``LossPlan.kl_sums_in_gradient_pass``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .block_io import (
    accumulated,
    count,
    load_row_constants,
    load_tile,
    local_labels,
    normalized,
    position,
    program_tile,
    sparse_start,
    store_sums,
    zero_sums,
)
from .elementwise import exp

__all__ = ["grads_kernel"]


@triton.jit
def softmax_minus_onehot(x: tl.tensor, lse: tl.tensor, is_target: tl.tensor) -> tl.tensor:
    """The CE gradient ``softmax(x) − onehot_y``, from the row's ``LSE(x)``."""
    return exp(x - lse) - tl.where(is_target, 1.0, 0.0)


@triton.jit
def kept(keep: tl.tensor, grad: tl.tensor, like: tl.tensor) -> tl.tensor:
    """``keep·grad`` (broadcast to the tile ``like``) on rows whose ``keep`` is positive (1, or a
    teacher mixture's weight w_i), else 0."""
    # A where, then ·keep: on a row not kept (no teacher, or D = +inf) ∂D may be inf or NaN, and 0·inf is NaN.
    return tl.where(keep > 0.0, grad + tl.zeros_like(like), 0.0) * keep


@triton.jit
def student_grads(
    s: tl.tensor,
    is_target: tl.tensor,
    grad_u: tl.tensor | None,
    rowc: tl.tuple,
    w_kl: tl.tuple,
    caps: tl.tuple,
    ROW_CONSTANTS: tl.constexpr,
    STUDENT_TERMS: tl.constexpr,
    STUDENT_KL: tl.constexpr,
    CAPPED: tl.constexpr,
) -> tl.tensor:
    """``∂loss/∂s = scale·(c_p·softmax(s) − c_y·onehot_y − c_u + w_kl_s·keep·∂D/∂u)`` of a tile, the
    terms chosen by the switches, through the student's soft-cap ``caps[0]`` when ``CAPPED[0]``;
    exactly 0 on rows whose scale is 0. ``grad_u``: ``∂D/∂u``; ``w_kl = (w_kl_s, w_kl_t)``."""
    scale = rowc[position(ROW_CONSTANTS, "scale")]
    ds = tl.zeros_like(s)
    # Constexpr switches: a call without a term compiles none of its code.
    if STUDENT_TERMS:
        # The terms' coefficients arrive weighted and summed over the terms (GradRows): one softmax serves them all.
        softmax: tl.tensor = exp(s - rowc[position(ROW_CONSTANTS, "lse_s")])
        ds += rowc[position(ROW_CONSTANTS, "c_p")] * softmax - rowc[position(ROW_CONSTANTS, "c_u")]
        # The one-hot part, on the label's column alone (in the one split that holds it).
        ds -= tl.where(is_target, rowc[position(ROW_CONSTANTS, "c_y")], 0.0)
    if STUDENT_KL:
        w_kl_s, w_kl_t = w_kl
        ds += w_kl_s * kept(rowc[position(ROW_CONSTANTS, "keep")], grad_u, s)
    # A where, not ds·scale alone: an ignored row (scale 0) gets exactly 0 even where ds is inf or NaN,
    # while an unowned row's NaN scale (NaN != 0) still makes its gradient NaN.
    ds = tl.where(scale != 0.0, ds * scale, 0.0)
    cap_s, cap_t = caps
    # The soft-cap's derivative last (the chain rule through s = c·tanh(z/c)), from the capped s the tile holds.
    return through_softcap(ds, s, cap_s) if CAPPED[0] else ds


@triton.jit
def teacher_grads(
    t: tl.tensor,
    is_target: tl.tensor,
    grad_v: tl.tensor | None,
    rowc: tl.tuple,
    w_kl: tl.tuple,
    caps: tl.tuple,
    ROW_CONSTANTS: tl.constexpr,
    TEACHER_CE: tl.constexpr,
    TEACHER_KL: tl.constexpr,
    CAPPED: tl.constexpr,
) -> tl.tensor:
    """``∂loss/∂t = scale·w_kl_t·keep·∂D/∂v + c_ce_t·(softmax(t) − onehot_y)`` of a tile, the
    terms chosen by the switches, through the teacher's soft-cap ``caps[1]`` when ``CAPPED[1]``;
    exactly 0 on rows whose scale is 0. ``grad_v``: ``∂D/∂v``; ``w_kl = (w_kl_s, w_kl_t)``."""
    scale = rowc[position(ROW_CONSTANTS, "scale")]
    dt = tl.zeros_like(t)
    if TEACHER_KL:
        w_kl_s, w_kl_t = w_kl
        dt += w_kl_t * kept(rowc[position(ROW_CONSTANTS, "keep")], grad_v, t)
    # Only the KL part is scaled here: c_ce_t already is w_t·scale (GradRows).
    dt = dt * scale
    if TEACHER_CE:
        dt += rowc[position(ROW_CONSTANTS, "c_ce_t")] * softmax_minus_onehot(
            t, rowc[position(ROW_CONSTANTS, "lse_t")], is_target
        )
    # As for the student: exactly 0 on ignored rows whatever dt holds; a NaN scale keeps the row NaN.
    dt = tl.where(scale != 0.0, dt, 0.0)
    cap_s, cap_t = caps
    return through_softcap(dt, t, cap_t) if CAPPED[1] else dt


@triton.jit
def through_softcap(grad: tl.tensor, capped: tl.tensor, cap: tl.tensor) -> tl.tensor:
    """The gradient with respect to ``z`` of ``grad`` with respect to ``s = cap·tanh(z/cap)``,
    from the capped values: ``grad·(1 − (s/cap)²)``."""
    # d/dz c·tanh(z/c) = 1 − tanh² = 1 − (s/c)²: the capped value suffices, the raw logit is not kept.
    # 1/cap is formed once: a multiply per element rather than a division.
    ratio = capped * (1.0 / cap)
    return grad * (1.0 - ratio * ratio)


@triton.jit
def store_tile(
    ptr: tl.tensor,
    stride: tl.tensor,
    rows: tl.tensor,
    cols: tl.tensor,
    x: tl.tensor,
    ok: tl.tensor,
    ACCUMULATE: tl.constexpr,
) -> None:
    """``x`` into the tile at ``rows × cols`` of a row-major tensor, in its dtype; with
    ``ACCUMULATE`` added to what the tile holds (a teacher mixture's views, one after another)."""
    pointers = ptr + rows[:, None] * stride + cols[None, :]
    if ACCUMULATE:  # the sum formed in fp32, then rounded once into the tile's dtype
        x += tl.load(pointers, mask=ok, other=0.0).to(tl.float32)
    # Rounded once, from fp32 into the staging dtype the gradient GEMMs read (bf16 where all their operands are).
    # Masked: a padded entry (s = −inf) is never written.
    tl.store(pointers, x.to(ptr.dtype.element_ty), mask=ok)


# R and col_start change with every chunk and shard: not specialized on, so a new value compiles nothing.
@triton.jit(do_not_specialize=["R", "col_start"])
def grads_kernel(
    s_ptr: tl.tensor,
    t_ptr: tl.tensor,
    labels_ptr: tl.tensor,
    rowc_ptr: tl.tensor,
    ds_ptr: tl.tensor,
    dt_ptr: tl.tensor,
    sums_ptr: tl.tensor,
    R: tl.tensor,
    C: tl.tensor,
    stride_s: tl.tensor,
    stride_t: tl.tensor,
    stride_ds: tl.tensor,
    stride_dt: tl.tensor,
    col_start: tl.tensor,
    cols_per_split: tl.tensor,
    caps: tl.tuple,
    sparse: tl.tuple,
    inv_temperatures: tl.tuple,
    w_kl: tl.tuple,
    ROW_CONSTANTS: tl.constexpr,
    STUDENT_GRAD: tl.constexpr,
    TEACHER_GRAD: tl.constexpr,
    COLUMN_TERMS: tl.constexpr,
    NUM_SUMS: tl.constexpr,
    STUDENT_TERMS: tl.constexpr,
    STUDENT_KL: tl.constexpr,
    TEACHER_CE: tl.constexpr,
    TEACHER_KL: tl.constexpr,
    HAS_T: tl.constexpr,
    SPARSE: tl.constexpr,
    CAPPED: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
) -> None:
    """``ds`` (and ``dt`` when a teacher term is on) of this program's rows and column split;
    ``rowc`` (R, len(ROW_CONSTANTS)), contiguous fp32, holds the row constants named
    ``ROW_CONSTANTS`` (:class:`orda_tp.engine.stats.GradRows`), each read by its name; with
    ``NUM_SUMS > 0`` also the split's round-2 sums ``Σ_columns COLUMN_TERMS(log p, log q, p, q,
    is_target)[k]`` into split ``program_id(1)`` of ``sums`` (splits, R, NUM_SUMS), accumulated per
    tile element and reduced once, at the end; with ``ACCUMULATE``, ``ds`` added to what it holds."""
    rows, row_ok, c_begin, c_end = program_tile(R, C, cols_per_split, BLOCK_R)
    local_label = local_labels(labels_ptr, rows, row_ok, col_start)[:, None]
    # The row constants once per program: they do not change along the columns.
    rowc = load_row_constants(rowc_ptr, rows, row_ok, count(ROW_CONSTANTS))
    sums = zero_sums(NUM_SUMS, BLOCK_R, BLOCK_C)
    ahead = sparse_start(sparse, rows, row_ok, col_start + c_begin, SPARSE)
    for c0 in tl.range(c_begin, c_end, BLOCK_C):
        cols, ok, s, t, ahead = load_tile(
            s_ptr, t_ptr, rows, row_ok, stride_s, stride_t, c0, c_end, col_start, caps,
            sparse, ahead, HAS_T, SPARSE, CAPPED, BLOCK_R, BLOCK_C,
        )  # fmt: skip
        # A label outside this split matches no entry inside ok (at most a padded one, which is masked).
        is_target = cols[None, :] == local_label
        # log p, log q, p, q only for a KL term; the student's own terms need the plain softmax of s alone.
        if STUDENT_KL or TEACHER_KL:
            lse_u, lse_v = rowc[position(ROW_CONSTANTS, "lse_u")], rowc[position(ROW_CONSTANTS, "lse_v")]
            logp, logq, p, q = normalized(s, t, inv_temperatures, lse_u, lse_v)
            if NUM_SUMS > 0:
                # Round 2 from the p and q formed here anyway (forward): one read pass of the chunk's logits fewer.
                sums = accumulated(sums, COLUMN_TERMS(logp, logq, p, q, is_target), ok, p, NUM_SUMS)
        # Constexpr conditions: without the KL term the generated call is never compiled, and logp need not exist.
        grad_u = STUDENT_GRAD(logp, logq, p, q, is_target, rowc, ROW_CONSTANTS) if STUDENT_KL else None
        grad_v = TEACHER_GRAD(logp, logq, p, q, is_target, rowc, ROW_CONSTANTS) if TEACHER_KL else None
        ds = student_grads(s, is_target, grad_u, rowc, w_kl, caps, ROW_CONSTANTS, STUDENT_TERMS, STUDENT_KL, CAPPED)
        store_tile(ds_ptr, stride_ds, rows, cols, ds, ok, ACCUMULATE)
        # Without a teacher gradient dt_ptr is a stand-in (the student's buffer): this branch is not compiled.
        if TEACHER_CE or TEACHER_KL:
            dt = teacher_grads(t, is_target, grad_v, rowc, w_kl, caps, ROW_CONSTANTS, TEACHER_CE, TEACHER_KL, CAPPED)
            store_tile(dt_ptr, stride_dt, rows, cols, dt, ok, False)
    # NUM_SUMS = 0 stores nothing: sums_ptr is then a stand-in (the row constants), never written.
    store_sums(sums_ptr, sums, rows, row_ok, R, NUM_SUMS)
