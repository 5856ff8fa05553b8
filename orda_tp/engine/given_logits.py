"""The autograd function of :class:`orda_tp.KDLoss`: ``Σ_valid T²·D(p, q) / N`` of given logits.

When the student's logits need a gradient, forward walks the row chunks once, forming each
chunk's statistics and writing ``∂loss/∂s`` for a unit upstream gradient straight into the
gradient of the student's logits (the logit gradient *is* the input gradient here: no GEMM, no
staging buffer), the way the fused path's eager gradients are formed; where the variant allows
(``LossPlan.kl_sums_in_gradient_pass``: ``forward``) that gradient pass also sums round 2, so a
call reads the logits twice in all. Backward scales the gradient in place by the upstream
gradient (nothing to do for exactly 1) and hands it over. A second backward through the same call
(``retain_graph=True``) walks the chunks again from the statistics kept by forward (a few values
per row), as a call without gradients would need. No collective in backward: the statistics were
merged across shards in forward, and each rank's gradient is its columns' slice. Ignored rows get
exactly 0, rows whose label no column owns NaN. The teacher's logits (stored, or formed block by
block from a top-k cache) never receive a gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from ..teachers.source import TeacherBlocks
from .call import LogitsProblem, row_statistics
from .gradient_gemms import scale_by_upstream
from .logits import LogitGrads, PairedLogits, StoredLogits
from .row_walk import GradTarget, walk_rows
from .stats import RowStats

__all__ = ["logits_distillation"]


class _LogitsContext(FunctionCtx):
    """What :class:`_LogitsDistillation` keeps on its autograd context (annotations only: torch
    declares ``needs_input_grad`` and ``saved_tensors`` on its C base class alone, as one-element
    tuples)."""

    needs_input_grad: tuple[bool, ...]
    problem: LogitsProblem
    unit_scale: Tensor
    walked: list[RowStats]
    teacher: TeacherBlocks
    dtype: torch.dtype
    eager_grad: Tensor | None
    saved_tensors: tuple[Tensor]


def _unit_scale(denominator: float | Tensor, row_weights: Tensor | None, dtype: torch.dtype, like: Tensor) -> Tensor:
    """Each row's gradient factor for a unit upstream gradient: ``1/N``, times the row's weight."""
    scale = (torch.ones((), dtype=dtype, device=like.device) / denominator).to(dtype)
    return scale if row_weights is None else scale * row_weights.to(dtype)


def _gradient_target(student: Tensor, unit_scale: Tensor) -> GradTarget:
    """A new gradient of the student's logits, as the walk's target for ``unit_scale`` per row."""
    grad = torch.empty(student.shape, dtype=student.dtype, device=student.device)
    return GradTarget(LogitGrads(grad, None), 0, unit_scale)


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
        wants_grad: bool,
    ) -> Tensor:
        target = None
        if wants_grad:
            ctx.unit_scale = _unit_scale(denominator, row_weights, dtype, student)
            target = _gradient_target(student, ctx.unit_scale)
        walked = row_statistics(problem, PairedLogits(StoredLogits(student), teacher), dtype, target)
        per_row = torch.cat([stats.kl for stats in walked]) if walked else student.new_zeros(0, dtype=dtype)
        if row_weights is not None:
            per_row = per_row * row_weights.to(dtype)
        loss = torch.where(problem.walk.valid, per_row, 0.0).sum() / denominator
        if target is not None:
            ctx.problem, ctx.walked, ctx.teacher, ctx.dtype = problem, walked, teacher, dtype
            ctx.eager_grad = target.grads.student
            ctx.save_for_backward(student)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: _LogitsContext, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        grad, ctx.eager_grad = ctx.eager_grad, None
        if grad is None:  # a repeated backward: the gradient walked again from the saved statistics
            (student,) = ctx.saved_tensors
            source, target = PairedLogits(StoredLogits(student), ctx.teacher), _gradient_target(student, ctx.unit_scale)
            grad = target.grads.student
            with torch.autocast(student.device.type, enabled=False):
                walk_rows(ctx.problem.walk, source, ctx.problem.chunks(), ctx.dtype, ctx.walked, target)
        scale_by_upstream([grad], grad_loss.to(ctx.dtype))
        return None, None, grad, None, None, None, None


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
    wants_grad = torch.is_grad_enabled() and student.requires_grad  # apply hides grad mode from forward
    return _LogitsDistillation.apply(problem, denominator, student, teacher, dtype, row_weights, wants_grad)
