"""Launch the generated kernels on one block of logits (rows × columns, fp32).

Each function mirrors one step of the torch block math (``orda_tp.backends.block_math``) and
returns the same thing: a :class:`PartitionRecord`, the variant's (rows, num_sums) sums, or the
logit gradients.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from types import ModuleType

import torch
import triton
from torch import Tensor

from ..divergences import Divergence, DivergenceParams
from ..divergences.expr import Expr
from ..records import LogitFamily, PartitionRecord
from .codegen import compile_exprs
from .templates import (
    GRADS_TEMPLATE,
    MERGE_TEMPLATE,
    PARTITION_INIT,
    PARTITION_STORE,
    PARTITION_TEMPLATE,
    PARTITION_UPDATE,
    ROWS_TEMPLATE,
    SCALE_TEMPLATE,
    SUMS_TEMPLATE,
    load_kernel_module,
)
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


def _indent(lines: Sequence[str], depth: int) -> str:
    return "\n".join(" " * depth + line for line in lines)


def _packed(source: str, families: int) -> str:
    return source.replace("WIDTH", str(2 * families + 3)).replace("FAMILIES", str(families))


@cache
def _partition_module(sides: tuple[str, ...]) -> ModuleType:
    families = len(sides)
    source = PARTITION_TEMPLATE.format(
        scale_args=" ".join(f"scale{f}," for f in range(families)),
        init="\n".join(PARTITION_INIT.format(f=f) for f in range(families)),
        update="\n".join(
            PARTITION_UPDATE.format(f=f, side="s" if side == "student" else "t") for f, side in enumerate(sides)
        ),
        store="\n".join(PARTITION_STORE.format(f=f) for f in range(families)),
    )
    return load_kernel_module(_packed(source, families))


@cache
def _merge_module(families: int) -> ModuleType:
    return load_kernel_module(_packed(MERGE_TEMPLATE, families))


def partition_record(
    student: Tensor, teacher: Tensor | None, labels: Tensor, col_start: int, families: Sequence[LogitFamily]
) -> PartitionRecord:
    """Round-1 record of a block (see :func:`orda_tp.records.block_partition_record`)."""
    rows, cols = student.shape
    count = len(families)
    if count == 0:
        from ..records import block_partition_record

        return block_partition_record(student, teacher, labels, col_start, families)
    tiles = tiles_for("partition", cols)
    launch, per_split = grid(tiles, rows, cols)
    width = 2 * count + 3
    partial = torch.empty(launch[1], rows, width, dtype=torch.float32, device=student.device)
    has_teacher = teacher is not None
    other = student if teacher is None else teacher
    _partition_module(tuple(f.side for f in families)).kernel[launch](
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
        *[1.0 / f.temperature for f in families],
        HAS_T=has_teacher,
        BLOCK_R=tiles.block_r,
        BLOCK_C=tiles.block_c,
        num_warps=tiles.num_warps,
    )
    if launch[1] == 1:
        return PartitionRecord.unpack(partial[0], count)
    return merge_stacked_records(partial, count)


def merge_stacked_records(stacked: Tensor, num_families: int) -> PartitionRecord:
    """Merge (S, rows, 2F+3) contiguous fp32 packed records (column splits, or the shards'
    gathered records) in one launch (see ``statistics.merge_stacked_partition_records``)."""
    splits, rows, width = stacked.shape
    merged = torch.empty(rows, width, dtype=torch.float32, device=stacked.device)
    _merge_module(num_families).kernel[(triton.cdiv(max(rows, 1), MERGE_BLOCK_R),)](
        stacked, merged, rows, splits, BLOCK_R=MERGE_BLOCK_R
    )
    return PartitionRecord.unpack(merged, num_families)


@cache
def _sums_module(divergence: Divergence, params: DivergenceParams) -> ModuleType:
    exprs = divergence.column_terms(params)
    lines, results = compile_exprs(exprs, "v")
    count = len(exprs)
    source = SUMS_TEMPLATE.format(
        init=_indent([f"acc{k} = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)" for k in range(count)], 4),
        body=_indent(lines, 8),
        accumulate=_indent([f"acc{k} += tl.where(ok, {r} + tl.zeros_like(p), 0.0)" for k, r in enumerate(results)], 8),
        store=_indent([f"tl.store(base + {k}, tl.sum(acc{k}, axis=1), mask=row_ok)" for k in range(count)], 4),
    )
    return load_kernel_module(source.replace("NUM_SUMS", str(count)))


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
    tiles = tiles_for("sums", cols)
    launch, per_split = grid(tiles, rows, cols)
    out = torch.empty(launch[1], rows, divergence.num_sums, dtype=torch.float32, device=student.device)
    _sums_module(divergence, params).kernel[launch](
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
        HAS_T=True,
        BLOCK_R=tiles.block_r,
        BLOCK_C=tiles.block_c,
        num_warps=tiles.num_warps,
    )
    return out[0] if launch[1] == 1 else out.sum(dim=0)


class GradTerms:
    """Which gradient terms a call forms; part of the kernel's specialization."""

    def __init__(
        self, student_ce: bool, student_kl: bool, teacher_ce: bool, teacher_kl: bool, has_teacher: bool
    ) -> None:
        self.key = (student_ce, student_kl, teacher_ce, teacher_kl, has_teacher)

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GradTerms) and other.key == self.key


@cache
def _grads_module(
    divergence: Divergence | None, params: DivergenceParams, terms: GradTerms, names: tuple[str, ...]
) -> ModuleType:
    """The gradient kernel of these terms, reading the row constants ``names`` (in order) from
    ``rowc``.

    ``scale`` is the row's factor (0 on ignored rows, whose gradients come out exactly 0); the
    terms' weights arrive as runtime arguments (``w_ce_s``, ``w_kl_s``, ``w_kl_t``), so a change of
    ``kl_weight`` between calls compiles nothing. The teacher's CE coefficient ``c_ce_t`` carries
    its own masking of absent teacher rows."""
    student_ce, student_kl, teacher_ce, teacher_kl, _ = terms.key
    exprs = []
    if student_kl:
        assert divergence is not None
        exprs.append(divergence.student_grad_expr(params))
    if teacher_kl:
        assert divergence is not None
        exprs.append(divergence.teacher_grad_expr(params))
    lines, results = compile_exprs(exprs, "g")
    load_rows = [
        f"row_{name} = tl.load(rowc_ptr + rows * {len(names)} + {j}, mask=row_ok, other=0.0)[:, None]"
        for j, name in enumerate(names)
    ]
    load_rows += ["lse_u = row_lse_u", "lse_v = row_lse_v"] if exprs else ["lse_u = 0.0", "lse_v = 0.0"]
    body = list(lines)
    one_hot = "tl.where(is_target, 1.0, 0.0)"
    results_iter = iter(results)
    store = "tl.store({0}_ptr + rows[:, None] * stride_{0} + cols[None, :], {0}.to({0}_ptr.dtype.element_ty), mask=ok)"
    body.append("ds = tl.zeros_like(s)")
    if student_ce:
        body.append(f"ds += w_ce_s * (tl.exp(s - row_lse_s) - {one_hot})")
    if student_kl:
        body.append(f"ds += w_kl_s * tl.where(row_keep > 0.0, {next(results_iter)} + tl.zeros_like(s), 0.0)")
    body.append("ds = tl.where(row_scale != 0.0, ds * row_scale, 0.0)")
    body.append(store.format("ds"))
    if teacher_ce or teacher_kl:
        body.append("dt = tl.zeros_like(s)")
        if teacher_kl:
            body.append(f"dt += w_kl_t * tl.where(row_keep > 0.0, {next(results_iter)} + tl.zeros_like(s), 0.0)")
        body.append("dt = dt * row_scale")
        if teacher_ce:
            body.append(f"dt += row_c_ce_t * (tl.exp(t - row_lse_t) - {one_hot})")
        body.append("dt = tl.where(row_scale != 0.0, dt, 0.0)")
        body.append(store.format("dt"))
    source = GRADS_TEMPLATE.format(load_rows=_indent(load_rows, 4), body=_indent(body, 8))
    return load_kernel_module(source)


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
    module = _grads_module(divergence, params, terms, names)
    grad_s, grad_t = out
    trains_teacher = terms.key[2] or terms.key[3]
    assert (grad_t is not None) == trains_teacher
    has_teacher = teacher is not None
    other = student if teacher is None else teacher
    tiles = tiles_for("grads", cols)
    launch, per_split = grid(tiles, rows, cols)
    out_t = grad_t if grad_t is not None else grad_s
    module.kernel[launch](
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
        HAS_T=has_teacher,
        BLOCK_R=tiles.block_r,
        BLOCK_C=tiles.block_c,
        num_warps=tiles.num_warps,
    )


@cache
def _rows_module(inputs: tuple[str, ...], scalars: tuple[str, ...], exprs: tuple[Expr, ...]) -> ModuleType:
    lines, results = compile_exprs(exprs, "r")
    args = " ".join(f"in{i}_ptr, in{i}_stride," for i in range(len(inputs)))
    args += " ".join(f" row_{name}," for name in scalars)
    loads = [
        f"row_{name} = tl.load(in{i}_ptr + rows * in{i}_stride, mask=row_ok, other=0).to(tl.float32)"
        for i, name in enumerate(inputs)
    ]
    stores = [
        f"tl.store(out_ptr + rows * {len(exprs)} + {j}, ({result} + zero).to(out_ptr.dtype.element_ty), mask=row_ok)"
        for j, result in enumerate(results)
    ]
    source = ROWS_TEMPLATE.format(args=args, loads=_indent(loads, 4), body=_indent(lines, 4), stores=_indent(stores, 4))
    return load_kernel_module(source)


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
    pointers: list[object] = []
    for name in inputs:
        tensor = values[name]
        pointers += [tensor, tensor.stride(0)]
    module = _rows_module(inputs, scalars, exprs)
    module.kernel[(triton.cdiv(max(count, 1), ROWS_BLOCK_R),)](
        out, count, *pointers, *[float(scalar_values[name]) for name in scalars], BLOCK_R=ROWS_BLOCK_R
    )
    return out


def scale_in_place(tensors: Sequence[Tensor], scale: Tensor) -> None:
    """``t *= scale`` for contiguous CUDA tensors, ``scale`` a 0-d fp32 tensor read on the device."""
    module = load_kernel_module(SCALE_TEMPLATE)
    factor = scale.float().reshape(1)
    for tensor in tensors:
        count = tensor.numel()
        if count:
            module.kernel[(triton.cdiv(count, SCALE_BLOCK),)](tensor, factor, count, BLOCK=SCALE_BLOCK)
