"""The autograd function of :class:`orda_tp.KDLoss`: ``Σ_valid T²·D(p, q) / N`` of given logits.

Forward walks the row chunks once and keeps each chunk's finalized row statistics (a few values
per row). Backward walks them again and writes ``∂loss/∂s`` straight into the gradient of the
student's logits, chunk by chunk, scaled by the upstream gradient: the logit gradient *is* the
input gradient here, so there is no GEMM, no staging buffer and no collective in backward (the
statistics were merged across shards in forward; each rank's gradient is its columns' slice).
The teacher's logits never receive a gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from ..backends.head import statistics_dtype
from .row_walk import LogitsProblem, StoredLogits, row_statistics, stage_student_grads

__all__ = ["logits_distillation"]


class _LogitsDistillation(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, problem: LogitsProblem, denominator: float | Tensor, student: Tensor, teacher: Tensor
    ) -> Tensor:
        dtype = statistics_dtype(student, teacher)
        walked = row_statistics(problem, StoredLogits(student), StoredLogits(teacher), dtype)
        per_row = torch.cat([stats.kl for stats in walked]) if walked else student.new_zeros(0, dtype=dtype)
        loss = torch.where(problem.valid, per_row, 0.0).sum() / denominator
        if ctx.needs_input_grad[2]:
            ctx.problem = problem  # type: ignore[attr-defined]
            ctx.denominator = denominator  # type: ignore[attr-defined]
            ctx.walked = walked  # type: ignore[attr-defined]
            ctx.save_for_backward(student, teacher)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        student, teacher = ctx.saved_tensors  # type: ignore[attr-defined]
        problem, walked = ctx.problem, ctx.walked  # type: ignore[attr-defined]
        scale = (grad_loss / ctx.denominator).to(statistics_dtype(student, teacher))  # type: ignore[attr-defined]
        grad = torch.empty(student.shape, dtype=student.dtype, device=student.device)
        with torch.autocast(student.device.type, enabled=False):
            stage_student_grads(problem, StoredLogits(student), StoredLogits(teacher), walked, scale, grad)
        return None, None, grad, None


def logits_distillation(
    problem: LogitsProblem, denominator: float | Tensor, student: Tensor, teacher: Tensor
) -> Tensor:
    """``Σ_valid rows T²·D(p_i, q_i) / denominator`` (0-d, the statistics dtype) of (rows, local
    columns) logits; differentiable with respect to ``student`` only."""
    return _LogitsDistillation.apply(problem, denominator, student, teacher)
