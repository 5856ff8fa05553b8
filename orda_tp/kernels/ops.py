"""Launch the kernels on one block of logits (rows × columns; fp32 statistics).

Each function mirrors one step of the torch block math (``orda_tp.engine.block_math``) and
returns the same thing: a :class:`PartitionRecord`, the variant's (rows, num_sums) sums, the logit
gradients or a row step's outputs. The kernels are :mod:`.partition`, :mod:`.sums`,
:mod:`.grads`, :mod:`.rows` and :mod:`.scale`; the variant's formulas reach them as generated
functions (:mod:`.variant_terms`). A kernel is specialized on its ``tl.constexpr`` arguments
(the families' sides, the variant and its parameters, the gradient terms and the row constants
they read, the row step), never on the row count or the first column, so a new sequence length
(or a last, shorter chunk) compiles nothing.

Column splits (``program_id(1)``, :mod:`.tiles`) give enough programs for short, wide blocks;
their partial records and sums are merged here, with the merge of the tensor-parallel shards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
from torch import Tensor
from triton.runtime.jit import KernelInterface

from ..divergences import Divergence, DivergenceParams
from ..divergences.expr import Expr
from ..records import LogitFamily, PartitionRecord, block_partition_record
from . import variant_terms
from .grads import grads_kernel
from .partition import merge_kernel, partition_kernel
from .rows import rows_kernel
from .scale import scale_kernel
from .sums import sums_kernel
from .tiles import grid, tiles_for

__all__ = [
    "partition_record",
    "merge_stacked_records",
    "variant_sums",
    "logit_grads",
    "GradTerms",
    "row_program",
    "scale_in_place",
]

MERGE_BLOCK_R = 128
ROWS_BLOCK_R = 128
SCALE_BLOCK = 4096


def _launch(kernel: KernelInterface[Any], launch_grid: tuple[int, ...]) -> Callable[..., object]:
    """``kernel[launch_grid]``, called with torch tensors and Python numbers (the kernels'
    annotations give their arguments' types inside the kernel)."""
    launcher: Callable[..., object] = kernel[launch_grid]
    return launcher


def partition_record(
    student: Tensor, teacher: Tensor | None, labels: Tensor, col_start: int, families: Sequence[LogitFamily]
) -> PartitionRecord:
    """Round-1 record of a block (see :func:`orda_tp.records.block_partition_record`)."""
    rows, cols = student.shape
    count = len(families)
    if count == 0:
        return block_partition_record(student, teacher, labels, col_start, families)
    tiles = tiles_for("partition", cols)
    launch, per_split = grid(tiles, rows, cols)
    partial = torch.empty(launch[1], rows, 2 * count + 3, dtype=torch.float32, device=student.device)
    other = student if teacher is None else teacher
    _launch(partition_kernel, launch)(
        student,
        other,
        labels,
        partial,
        rows,
        cols,
        student.stride(0),
        other.stride(0),
        col_start,
        per_split,
        tuple(1.0 / family.temperature for family in families),
        READS_TEACHER=tuple(family.side == "teacher" for family in families),
        NUM_FAMILIES=count,
        HAS_T=teacher is not None,
        BLOCK_R=tiles.block_r,
        BLOCK_C=tiles.block_c,
        num_warps=tiles.num_warps,
    )
    if launch[1] == 1:
        return PartitionRecord.unpack(partial[0], count)
    return merge_stacked_records(partial, count)


def merge_stacked_records(stacked: Tensor, num_families: int) -> PartitionRecord:
    """Merge (S, rows, 2F+3) contiguous fp32 packed records (column splits, or the shards'
    gathered records) in one launch (see ``records.merge_stacked_partition_records``)."""
    splits, rows, width = stacked.shape
    merged = torch.empty(rows, width, dtype=torch.float32, device=stacked.device)
    _launch(merge_kernel, (triton.cdiv(max(rows, 1), MERGE_BLOCK_R),))(
        stacked, merged, rows, splits, NUM_FAMILIES=num_families, BLOCK_R=MERGE_BLOCK_R
    )
    return PartitionRecord.unpack(merged, num_families)


def variant_sums(
    divergence: Divergence,
    params: DivergenceParams,
    student: Tensor,
    teacher: Tensor,
    labels: Tensor,
    col_start: int,
    lse_u: Tensor,
    lse_v: Tensor,
    temperatures: tuple[float, float],
) -> Tensor:
    """(rows, num_sums) round-2 sums of a block (see ``Divergence.block_sums``); ``lse_u``,
    ``lse_v``: fp32 (rows,), any stride."""
    rows, cols = student.shape
    terms = variant_terms.column_terms(divergence, params)
    assert terms.outputs == divergence.num_sums, (divergence.name, terms.outputs)
    tiles = tiles_for("sums", cols)
    launch, per_split = grid(tiles, rows, cols)
    out = torch.empty(launch[1], rows, divergence.num_sums, dtype=torch.float32, device=student.device)
    _launch(sums_kernel, launch)(
        student,
        teacher,
        labels,
        lse_u,
        lse_v,
        out,
        rows,
        cols,
        student.stride(0),
        teacher.stride(0),
        lse_u.stride(0),
        lse_v.stride(0),
        col_start,
        per_split,
        1.0 / temperatures[0],
        1.0 / temperatures[1],
        COLUMN_TERMS=terms.function,
        NUM_SUMS=terms.outputs,
        HAS_T=True,
        BLOCK_R=tiles.block_r,
        BLOCK_C=tiles.block_c,
        num_warps=tiles.num_warps,
    )
    return out[0] if launch[1] == 1 else out.sum(dim=0)


@dataclass(frozen=True)
class GradTerms:
    """Which gradient terms a call forms; part of the gradient kernel's specialization."""

    student_ce: bool
    student_kl: bool
    teacher_ce: bool
    teacher_kl: bool
    has_teacher: bool

    @property
    def trains_teacher(self) -> bool:
        return self.teacher_ce or self.teacher_kl


def _grad_functions(
    divergence: Divergence | None, params: DivergenceParams, terms: GradTerms
) -> tuple[object | None, object | None]:
    """The variant's generated ``∂D/∂u`` and ``∂D/∂v`` functions that ``terms`` call for."""
    if not (terms.student_kl or terms.teacher_kl):
        return None, None
    assert divergence is not None
    student = variant_terms.student_grad(divergence, params).function if terms.student_kl else None
    teacher = variant_terms.teacher_grad(divergence, params).function if terms.teacher_kl else None
    return student, teacher


def logit_grads(
    divergence: Divergence | None,
    params: DivergenceParams,
    terms: GradTerms,
    student: Tensor,
    teacher: Tensor | None,
    labels: Tensor,
    col_start: int,
    rowc: Tensor,
    names: tuple[str, ...],
    temperatures: tuple[float, float],
    weights: tuple[float, float, float],
    out: tuple[Tensor, Tensor | None],
) -> None:
    """Write ``∂loss/∂s`` (and ``∂loss/∂t`` when the terms train the teacher) of a block into
    ``out`` (row-major views, any float dtype); ``rowc`` (rows, len(names)) fp32, contiguous,
    holds the row constants ``names`` the kernel reads, ``weights`` the coefficients
    ``(w_ce_s, w_kl_s, w_kl_t)`` of the student's CE, its KL and the teacher's KL term."""
    rows, cols = student.shape
    grad_s, grad_t = out
    assert (grad_t is not None) == terms.trains_teacher
    student_grad, teacher_grad = _grad_functions(divergence, params, terms)
    other = student if teacher is None else teacher
    out_t = grad_t if grad_t is not None else grad_s
    tiles = tiles_for("grads", cols)
    launch, per_split = grid(tiles, rows, cols)
    _launch(grads_kernel, launch)(
        student,
        other,
        labels,
        rowc,
        grad_s,
        out_t,
        rows,
        cols,
        student.stride(0),
        other.stride(0),
        grad_s.stride(0),
        out_t.stride(0),
        col_start,
        per_split,
        1.0 / temperatures[0],
        1.0 / temperatures[1],
        *weights,
        ROW_CONSTANTS=names,
        STUDENT_GRAD=student_grad,
        TEACHER_GRAD=teacher_grad,
        STUDENT_CE=terms.student_ce,
        STUDENT_KL=terms.student_kl,
        TEACHER_CE=terms.teacher_ce,
        TEACHER_KL=terms.teacher_kl,
        HAS_T=teacher is not None,
        BLOCK_R=tiles.block_r,
        BLOCK_C=tiles.block_c,
        num_warps=tiles.num_warps,
    )


def row_program(
    inputs: tuple[str, ...],
    scalars: tuple[str, ...],
    exprs: tuple[Expr, ...],
    values: Mapping[str, Tensor],
    scalar_values: Mapping[str, float],
    like: Tensor,
) -> Tensor:
    """Run row formulas ``exprs`` in one launch: ``values`` maps each input name to a (rows,)
    tensor of any stride (stride 0 broadcasts), ``scalar_values`` each scalar name to a float;
    returns the (rows, len(exprs)) results in ``like``'s dtype."""
    count = values[inputs[0]].shape[0]
    out = torch.empty(count, len(exprs), dtype=like.dtype, device=like.device)
    formulas = variant_terms.row_step(inputs, scalars, exprs)
    _launch(rows_kernel, (triton.cdiv(max(count, 1), ROWS_BLOCK_R),))(
        out,
        count,
        tuple((values[name], values[name].stride(0)) for name in inputs),
        tuple(float(scalar_values[name]) for name in scalars),
        FORMULAS=formulas.function,
        NUM_OUTPUTS=len(exprs),
        BLOCK_R=ROWS_BLOCK_R,
    )
    return out


def scale_in_place(tensors: Sequence[Tensor], scale: Tensor) -> None:
    """``t *= scale`` for contiguous CUDA tensors, ``scale`` a 0-d fp32 tensor read on the device."""
    factor = scale.float().reshape(1)
    for tensor in tensors:
        count = tensor.numel()
        if count:
            _launch(scale_kernel, (triton.cdiv(count, SCALE_BLOCK),))(tensor, factor, count, BLOCK=SCALE_BLOCK)
