"""The Triton backend's block math (:class:`TritonBlockMath`): one launch of ``orda_tp.kernels``
per step of the :class:`.block_math.BlockMath` protocol, on fp32 statistics, returning what the
torch block math returns (docs/architecture.md, "The Triton backend: kernel design").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import triton
from torch import Tensor
from triton.runtime.jit import KernelInterface

from ..arguments.plan import LogitFamily, LossPlan
from ..divergences.expr import Expr, column_names
from ..kernels import tiles, variant_terms
from ..kernels.grads import grads_kernel
from ..kernels.partition import merge_kernel, partition_kernel
from ..kernels.rows import rows_kernel
from ..kernels.scale import scale_kernel
from ..kernels.sums import sums_kernel
from ..kernels.topk import topk_kernel
from ..teachers.source import SparseLogits
from .logits import LogitGrads, TeacherBlock
from .records import packed_columns
from .row_formulas import RowProgram
from .stats import GradRows
from .topk_rows import TopKRows, decode_keys
from .torch_math import TorchBlockMath

__all__ = ["KERNEL_BLOCK", "KERNEL_GROUP", "KERNEL_WARPS", "TritonBlockMath", "grid_launcher", "scale_in_place"]

MERGE_BLOCK_R = 128
ROWS_BLOCK_R = 128
SCALE_BLOCK = 4096
SCALE_PROGRAMS = 1056  # 8 per SM of an H200 (132 SMs): each strides over the blocks (kernels/scale.py)
#: The top-k kernel's group of columns ranked by their best element, its block of columns per step
#: and its warps per row (measured on an H200: docs/benchmarks.md, "Top-k teacher extraction").
KERNEL_GROUP, KERNEL_BLOCK, KERNEL_WARPS = 4, 512, 1
# Triton decides at decoration (import) time whether its kernels run under the CPU interpreter.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def grid_launcher(kernel: KernelInterface[Any], launch_grid: tuple[int, ...]) -> Callable[..., object]:
    """``kernel[launch_grid]``, called with torch tensors and Python numbers (the kernels'
    annotations give their arguments' types inside the kernel)."""
    launcher: Callable[..., object] = kernel[launch_grid]
    return launcher


def _tiles_and_grid(kind: str, block: Tensor, sparse: bool = False) -> tuple[tiles.Tiles, tuple[int, int], int]:
    """Kernel ``kind``'s tiles for a (rows, cols) ``block`` of student logits (``sparse``: for a top-k
    cache's teacher), its launch grid (row tiles × column splits) and one split's columns."""
    rows, cols = block.shape
    # The tables are read at every launch, so that benchmarks/tune_kernels.py can try others.
    key = (kind, cols >= 1 << 15)
    half = tiles.HALF_PRECISION_TILES.get(key) if block.element_size() == 2 else None
    listed = tiles.SPARSE_TEACHER_TILES.get(key) if sparse else None
    chosen = tiles.INTERPRETED if INTERPRETED else half or listed or tiles.CUDA_TILES[key]
    row_tiles = triton.cdiv(max(rows, 1), chosen.block_r)
    wanted_splits = max(1, min(triton.cdiv(cols, chosen.block_c), triton.cdiv(chosen.programs, row_tiles)))
    # A whole number of column tiles per split: only the last split's last tile can be partial.
    per_split = triton.cdiv(triton.cdiv(max(cols, 1), wanted_splits), chosen.block_c) * chosen.block_c
    return chosen, (row_tiles, triton.cdiv(max(cols, 1), per_split)), per_split


Caps = tuple[float | None, float | None]  # the soft-caps of the student's and the teacher's logits


def _caps(caps: Caps) -> tuple[tuple[float, float], tuple[bool, bool]]:
    """The kernels' ``caps`` (runtime values, 1.0 where none) and ``CAPPED`` (constexpr flags)."""
    return (caps[0] or 1.0, caps[1] or 1.0), (caps[0] is not None, caps[1] is not None)


def _teacher_operand(
    teacher: TeacherBlock | None, student: Tensor
) -> tuple[Tensor, int, tuple[Tensor, Tensor, int, int], bool]:
    """The kernels' teacher arguments ``(t, stride_t, sparse, SPARSE)``: the tensor ``t_ptr`` reads
    and its row stride; for a :class:`SparseLogits` block its fill at ``t_ptr`` and ``sparse =
    (ids, values, row stride, k)``."""
    if isinstance(teacher, SparseLogits):
        ids, values, fill = teacher
        assert ids.stride() == values.stride() and ids.stride(1) == 1
        return fill, fill.stride(0), (ids, values, ids.stride(0), ids.shape[1]), True
    # The student's block stands in for a missing teacher (HAS_T off) and the unused sparse operands.
    other = student if teacher is None else teacher
    return other, other.stride(0), (student, student, 0, 0), False


class TritonBlockMath:
    """The kernels on whole chunks: one block per chunk, since they tile the columns themselves;
    they read raw blocks and apply the soft-caps as they load a tile."""

    reads_stored_cache = True
    applies_softcap = True
    whole_blocks = True

    def partition(
        self,
        student: Tensor,
        teacher: TeacherBlock | None,
        labels: Tensor,
        col_start: int,
        families: Sequence[LogitFamily],
        column_sums: tuple[Expr, ...],
        caps: Caps = (None, None),
    ) -> Tensor:
        """The protocol's packed round-1 record of a block, of the logits soft-capped by ``caps``."""
        rows, cols = student.shape
        count = len(families)
        if count == 0:  # no family: no student term and no teacher term, so no column sums or t_y
            return TorchBlockMath().partition(student, None, labels, col_start, families)
        sums = variant_terms.record_column_sums(column_sums).function if column_sums else None
        chosen, launch, per_split = _tiles_and_grid("partition", student)
        width = len(packed_columns(count, len(column_sums)))
        # One record per column split, each written whole by its programs: no atomics, no zero-fill.
        partial = torch.empty(launch[1], rows, width, dtype=torch.float32, device=student.device)
        other, stride_t, sparse, is_sparse = _teacher_operand(teacher, student)
        cap_values, capped = _caps(caps)
        grid_launcher(partition_kernel, launch)(
            student, other, labels, partial, rows, cols, student.stride(0), stride_t, col_start, per_split,
            cap_values, sparse, tuple(1.0 / family.temperature for family in families),
            READS_TEACHER=tuple(family.side == "teacher" for family in families),
            NUM_FAMILIES=count,
            COLUMN_SUMS=sums,
            NUM_COLUMN_SUMS=len(column_sums),
            WIDTH=width,
            HAS_T=teacher is not None,
            SPARSE=is_sparse,
            TEACHER_LISTED=is_sparse and "t" not in column_names(column_sums),
            CAPPED=capped,
            BLOCK_R=chosen.block_r,
            BLOCK_C=chosen.block_c,
            num_warps=chosen.num_warps,
        )  # fmt: skip
        if launch[1] == 1:
            return partial[0]
        # The splits folded in split order: one block always merges to the same bits.
        return self.merge_stacked(partial, count)

    def merge_stacked(self, stacked: Tensor, num_families: int) -> Tensor:
        """Merge an (S, rows, width) stack of contiguous fp32 packed records (column splits, or the
        shards' gathered records) in one launch (see :func:`.records.merge_stacked_records`)."""
        splits, rows, width = stacked.shape
        merged = torch.empty(rows, width, dtype=torch.float32, device=stacked.device)
        grid_launcher(merge_kernel, (triton.cdiv(max(rows, 1), MERGE_BLOCK_R),))(
            stacked, merged, rows, splits, NUM_FAMILIES=num_families, WIDTH=width, BLOCK_R=MERGE_BLOCK_R
        )
        return merged

    def topk(self, logits: Tensor, k: int, first_id: int, temperature: float, cap: float | None) -> TopKRows:
        """The protocol's top-k of ``logits`` (columns contiguous; any float dtype, read as fp32), for
        ``k`` ≤ ``topk_rows.KERNEL_MAX_K``."""
        rows, columns = logits.shape
        width = max(2, 1 << (k - 1).bit_length())  # the kernel's K: a power of two
        keys = torch.empty(rows, width, dtype=torch.int64, device=logits.device)
        log_sum = torch.empty(rows, dtype=torch.float32, device=logits.device)
        if rows:
            block = max(KERNEL_BLOCK, width * KERNEL_GROUP)
            grid_launcher(topk_kernel, (rows,))(
                logits, logits.stride(0), columns, keys, log_sum, 1.0 / temperature, 1.0 if cap is None else cap,
                HAS_CAP=cap is not None, K=width, GROUP=KERNEL_GROUP, BLOCK=block, num_warps=KERNEL_WARPS,
            )  # fmt: skip
        values, ids = decode_keys(keys[:, :k], first_id)  # the kernel's K ≥ k keys, largest first: the best k
        return TopKRows(values, ids, log_sum)

    def kl_sums(
        self, plan: LossPlan, student: Tensor, teacher: TeacherBlock | None, labels: Tensor, col_start: int,
        lse_u: Tensor, lse_v: Tensor,
    ) -> Tensor:  # fmt: skip
        """The protocol's round-2 sums of a block; ``lse_u``, ``lse_v``: fp32 (rows,), any stride."""
        rows, cols = student.shape
        # The plan's round_two_terms: the variant's (with a KL term), then the entropy's (reported).
        divergence = plan.divergence if plan.computes_kl else None
        terms = variant_terms.column_terms(divergence, plan.params, plan.student_entropy)
        chosen, launch, per_split = _tiles_and_grid("sums", student)
        out = torch.empty(launch[1], rows, terms.outputs, dtype=torch.float32, device=student.device)
        cap_values, capped = _caps((plan.student_softcap, plan.teacher_softcap))
        other, stride_t, sparse, is_sparse = _teacher_operand(teacher, student)
        grid_launcher(sums_kernel, launch)(
            student, other, labels, lse_u, lse_v, out, rows, cols, student.stride(0), stride_t,
            lse_u.stride(0), lse_v.stride(0), col_start, per_split, cap_values, sparse,
            (1.0 / plan.student_temperature, 1.0 / plan.teacher_temperature),
            COLUMN_TERMS=terms.function,
            NUM_SUMS=terms.outputs,
            HAS_T=teacher is not None,
            SPARSE=is_sparse,
            CAPPED=capped,
            BLOCK_R=chosen.block_r,
            BLOCK_C=chosen.block_c,
            num_warps=chosen.num_warps,
        )  # fmt: skip
        # The splits' slots added afterwards by one torch sum, no atomics: the same bits every run.
        return out[0] if launch[1] == 1 else out.sum(dim=0)

    def rows(
        self, program: RowProgram, values: Mapping[str, Tensor], scalars: Mapping[str, float], like: Tensor
    ) -> Tensor:
        """The protocol's row program, in one launch (an input of stride 0 broadcasts)."""
        count = values[program.inputs[0]].shape[0]
        out = torch.empty(count, len(program.exprs), dtype=like.dtype, device=like.device)  # every entry stored
        formulas = variant_terms.row_step(program.inputs, program.scalars, program.exprs)
        grid_launcher(rows_kernel, (triton.cdiv(max(count, 1), ROWS_BLOCK_R),))(
            out,
            count,
            tuple((values[name], values[name].stride(0)) for name in program.inputs),
            tuple(float(scalars[name]) for name in program.scalars),
            FORMULAS=formulas.function,
            NUM_OUTPUTS=len(program.exprs),
            BLOCK_R=ROWS_BLOCK_R,
        )
        return out

    def stage_logit_grads(
        self, plan: LossPlan, rows: GradRows, student: Tensor, teacher: TeacherBlock | None, labels: Tensor,
        col_start: int, out: LogitGrads, sums_out: Tensor | None = None, accumulate: bool = False,
    ) -> None:  # fmt: skip
        """The protocol's logit gradients of a block, written (or with ``accumulate`` added) into
        ``out`` (row-major views, any float dtype) by one launch that reads ``rows.packed`` as it is;
        with ``sums_out``, also the block's round-2 sums added into it."""
        n_rows, cols = student.shape
        student_kl, teacher_kl = plan.computes_kl, plan.kl_trains_teacher
        assert (out.teacher is not None) == (plan.teacher_ce_trains_teacher or teacher_kl)
        assert sums_out is None or plan.kl_sums_in_gradient_pass
        divergence = plan.divergence
        student_grad = variant_terms.kl_grad(divergence, plan.params, "student").function if student_kl else None
        teacher_grad = variant_terms.kl_grad(divergence, plan.params, "teacher").function if teacher_kl else None
        with_sums = sums_out is not None and divergence is not None  # the gradient pass sums round 2 (a KL term)
        terms = variant_terms.column_terms(divergence, plan.params, plan.student_entropy) if with_sums else None
        other, stride_t, sparse, is_sparse = _teacher_operand(teacher, student)
        # Without a teacher gradient, a stand-in pointer that the kernel never writes (no teacher term compiled).
        out_t = out.student if out.teacher is None else out.teacher
        chosen, launch, per_split = _tiles_and_grid("grads", student, is_sparse)
        num_sums = 0 if terms is None else terms.outputs
        sums = rows.packed  # without sums, a stand-in for the unused pointer: no allocation per launch
        if terms is not None:
            sums = torch.empty(launch[1], n_rows, num_sums, dtype=torch.float32, device=student.device)
        cap_values, capped = _caps((plan.student_softcap, plan.teacher_softcap if teacher is not None else None))
        grid_launcher(grads_kernel, launch)(
            student, other, labels, rows.packed, out.student, out_t, sums, n_rows, cols, student.stride(0),
            stride_t, out.student.stride(0), out_t.stride(0), col_start, per_split, cap_values, sparse,
            (1.0 / plan.student_temperature, 1.0 / plan.teacher_temperature), plan.kl_grad_weights,
            ROW_CONSTANTS=rows.names,
            STUDENT_GRAD=student_grad,
            TEACHER_GRAD=teacher_grad,
            COLUMN_TERMS=None if terms is None else terms.function,
            NUM_SUMS=num_sums,
            STUDENT_TERMS=bool(plan.student_terms),
            STUDENT_KL=student_kl,
            TEACHER_CE=plan.teacher_ce_trains_teacher,
            TEACHER_KL=teacher_kl,
            HAS_T=teacher is not None,
            SPARSE=is_sparse,
            CAPPED=capped,
            ACCUMULATE=accumulate,
            BLOCK_R=chosen.block_r,
            BLOCK_C=chosen.block_c,
            num_warps=chosen.num_warps,
        )  # fmt: skip
        if sums_out is not None:
            # In place: the chunk's round-2 sums, block after block (the splits' slots summed first).
            sums_out += sums[0] if launch[1] == 1 else sums.sum(dim=0)


def scale_in_place(tensors: Sequence[Tensor], scale: Tensor) -> None:
    """``t *= scale`` for contiguous CUDA tensors, ``scale`` a 0-d fp32 tensor read on the device."""
    factor = scale.float().reshape(1)  # stays on the device: the kernel reads it, the host never does
    for tensor in tensors:
        count = tensor.numel()
        if count:
            programs = min(triton.cdiv(count, SCALE_BLOCK), SCALE_PROGRAMS)
            grid_launcher(scale_kernel, (programs,))(tensor, factor, count, BLOCK=SCALE_BLOCK)
