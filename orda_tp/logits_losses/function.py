"""The autograd function of :class:`orda_tp.KDLoss`: ``Σ_valid T²·D(p, q) / N`` of given logits.

Forward walks the row chunks once and keeps each chunk's finalized row statistics (a few values
per row). Backward walks them again and writes ``∂loss/∂s`` straight into the gradient of the
student's logits, chunk by chunk, scaled by the upstream gradient: the logit gradient *is* the
input gradient here, so there is no GEMM, no staging buffer and no collective in backward (the
statistics were merged across shards in forward; each rank's gradient is its columns' slice).
Ignored rows get exactly 0, rows whose label no column owns NaN. The teacher's logits (stored,
or formed block by block from a top-k cache) never receive a gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from ..engine.logits import LogitGrads, PairedLogits, StoredLogits
from ..engine.row_walk import GradTarget, walk_rows
from ..engine.stats import RowStats
from ..teachers.source import TeacherBlocks
from .problem import LogitsProblem, row_statistics

__all__ = ["logits_distillation"]


class _LogitsContext(FunctionCtx):
    """What :class:`_LogitsDistillation` keeps on its autograd context (annotations only: torch
    declares ``needs_input_grad`` and ``saved_tensors`` on its C base class alone, as one-element
    tuples)."""

    needs_input_grad: tuple[bool, ...]
    problem: LogitsProblem
    denominator: float | Tensor
    walked: list[RowStats]
    teacher: TeacherBlocks
    dtype: torch.dtype
    row_weights: Tensor | None
    saved_tensors: tuple[Tensor]


class _LogitsDistillation(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: _LogitsContext,
        problem: LogitsProblem,
        denominator: float | Tensor,
        student: Tensor,
        teacher: TeacherBlocks,
        dtype: torch.dtype,
        row_weights: Tensor | None,
    ) -> Tensor:
        walked = row_statistics(problem, PairedLogits(StoredLogits(student), teacher), dtype)
        per_row = torch.cat([stats.kl for stats in walked]) if walked else student.new_zeros(0, dtype=dtype)
        if row_weights is not None:
            per_row = per_row * row_weights.to(dtype)
        loss = torch.where(problem.walk.valid, per_row, 0.0).sum() / denominator
        if ctx.needs_input_grad[2]:
            ctx.problem, ctx.denominator, ctx.walked = problem, denominator, walked
            ctx.teacher, ctx.dtype, ctx.row_weights = teacher, dtype, row_weights
            ctx.save_for_backward(student)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: _LogitsContext, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        (student,) = ctx.saved_tensors
        problem, dtype = ctx.problem, ctx.dtype
        scale = (grad_loss / ctx.denominator).to(dtype)
        if ctx.row_weights is not None:  # a row's weight scales its gradient as its loss
            scale = scale * ctx.row_weights.to(dtype)
        grad = torch.empty(student.shape, dtype=student.dtype, device=student.device)
        source = PairedLogits(StoredLogits(student), ctx.teacher)
        target = GradTarget(LogitGrads(grad, None), 0, scale)  # the walk writes the student's gradient in place
        with torch.autocast(student.device.type, enabled=False):
            walk_rows(problem.walk, source, problem.chunks(), dtype, ctx.walked, target)
        return None, None, grad, None, None, None


def logits_distillation(
    problem: LogitsProblem,
    denominator: float | Tensor,
    student: Tensor,
    teacher: TeacherBlocks,
    dtype: torch.dtype,
    row_weights: Tensor | None = None,
) -> Tensor:
    """``Σ_valid rows w_i·T²·D(p_i, q_i) / denominator`` (0-d, the statistics ``dtype``) of (rows,
    local columns) student logits and the teacher's blocks (``StoredLogits`` of its logits, or a
    top-k cache's), ``w_i`` the rows' ``row_weights`` (1 when None); differentiable with respect
    to ``student`` only."""
    return _LogitsDistillation.apply(problem, denominator, student, teacher, dtype, row_weights)
