"""Gradients of one row chunk: logit gradients per column block, then the two GEMMs.

For a block of columns with student logits ``s`` and teacher logits ``t`` (row scale ``c`` =
upstream gradient × 1/N for "mean"):

- ``∂loss/∂s = c·[w_s·(softmax(s) − onehot(y)) + w_kl·T_s·∂D/∂u]``
- ``∂loss/∂t = c·[w_t·(softmax(t) − onehot(y)) + w_kl·T_s²/T_t·∂D/∂v]`` (only the terms that
  train the teacher under the plan's routing)

then ``dh += dS·W_block``, ``dW_block += dSᵀ·h`` (and the same for the teacher's tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..plan import LossPlan
from .chunk_stats import RowStats, kl_block_terms
from .gemm import GemmPolicy
from .head import HeadTensors, RowChunk

if TYPE_CHECKING:
    from .block_math import BlockMath

__all__ = ["GradientBuffers", "accumulate_chunk_gradients", "block_logit_grads"]


@dataclass
class GradientBuffers:
    """Accumulators (statistics dtype) for the inputs that receive a gradient, else None."""

    student_hidden: Tensor | None
    weight: Tensor | None
    teacher_hidden: Tensor | None
    teacher_weight: Tensor | None

    @staticmethod
    def allocate(head: HeadTensors, needs: tuple[bool, bool, bool, bool], dtype: torch.dtype) -> GradientBuffers:
        tensors = (head.student_hidden, head.weight, head.teacher_hidden, head.teacher_weight)
        buffers = [
            torch.zeros(t.shape, dtype=dtype, device=t.device) if need and t is not None else None
            for t, need in zip(tensors, needs)
        ]
        return GradientBuffers(*buffers)


def _cross_entropy_grad(logits: Tensor, lse: Tensor, local_labels: Tensor, coef: Tensor) -> Tensor:
    """``coef·(softmax(logits) − onehot(label))`` on a block; labels outside the block add nothing."""
    grad = torch.exp(logits - lse[:, None]) * coef[:, None]
    owned = (local_labels >= 0) & (local_labels < logits.shape[1])
    rows = owned.nonzero().squeeze(1)
    grad[rows, local_labels[rows]] -= coef[rows]
    return grad


def _masked(grad: Tensor, keep: Tensor) -> Tensor:
    return torch.where(keep[:, None], grad, torch.zeros_like(grad))


def block_logit_grads(
    plan: LossPlan,
    stats: RowStats,
    student: Tensor,
    teacher: Tensor | None,
    local_labels: Tensor,
    row_scale: Tensor,
) -> tuple[Tensor, Tensor | None]:
    """``(∂loss/∂s, ∂loss/∂t)`` on one block; the teacher part is None when it is not trained."""
    student_grad = torch.zeros_like(student)
    teacher_grad = torch.zeros_like(teacher) if plan.teacher_receives_grad and teacher is not None else None
    if plan.student_ce_weight > 0:
        student_grad += _cross_entropy_grad(
            student, stats.lse(plan, plan.ce_student_family), local_labels, plan.student_ce_weight * row_scale
        )
    if teacher_grad is not None and plan.teacher_ce_weight > 0:
        assert teacher is not None
        keep = ~stats.teacher_absent
        coef = torch.where(keep, plan.teacher_ce_weight * row_scale, torch.zeros_like(row_scale))
        lse_t = torch.where(keep, stats.lse(plan, plan.ce_teacher_family), torch.zeros_like(row_scale))
        teacher_grad += _cross_entropy_grad(teacher, lse_t, local_labels, coef)
    if plan.computes_kl:
        divergence = plan.divergence
        assert divergence is not None and teacher is not None
        lse_u, lse_v = stats.kl_log_partitions(plan)
        terms = kl_block_terms(plan, student, teacher, lse_u, lse_v, local_labels if divergence.needs_target else None)
        temperature = plan.student_temperature
        student_grad += (plan.kl_weight * temperature * row_scale)[:, None] * _masked(
            divergence.student_grad(terms, stats.kl_consts, plan.params), stats.keep_kl_grad
        )
        if teacher_grad is not None and plan.kl_trains_teacher:
            scale = plan.kl_weight * temperature**2 / plan.teacher_temperature
            teacher_grad += (scale * row_scale)[:, None] * _masked(
                divergence.teacher_grad(terms, stats.kl_consts, plan.params), stats.keep_kl_grad
            )
    return student_grad, teacher_grad


def accumulate_chunk_gradients(
    plan: LossPlan,
    head: HeadTensors,
    chunk: RowChunk,
    stats: RowStats,
    blocks: list[tuple[int, int, Tensor, Tensor | None]],
    row_scale: Tensor,
    buffers: GradientBuffers,
    math: BlockMath,
    gemms: GemmPolicy,
) -> None:
    """Add this chunk's gradient to ``buffers``; ``blocks`` are ``(start, stop, s, t)`` in local columns."""
    dtype = chunk.dtype
    student_hidden_grad = (
        torch.zeros(chunk.student_hidden.shape, dtype=dtype, device=chunk.student_hidden.device)
        if buffers.student_hidden is not None
        else None
    )
    teacher_hidden_grad = (
        torch.zeros(chunk.teacher_hidden.shape, dtype=dtype, device=chunk.teacher_hidden.device)
        if buffers.teacher_hidden is not None and chunk.teacher_hidden is not None
        else None
    )
    for start, stop, student, teacher in blocks:
        student_grad, teacher_grad = math.logit_grads(
            plan, stats, student, teacher, chunk.labels, head.vocab_start + start, row_scale
        )
        weight_block = head.weight.detach()[start:stop]
        if student_hidden_grad is not None:
            gemms.accumulate(student_hidden_grad, student_grad, weight_block)
        if buffers.weight is not None:
            gemms.accumulate(buffers.weight[start:stop], student_grad.T, chunk.student_hidden)
        if teacher_grad is None or chunk.teacher_hidden is None:
            continue
        teacher_block = head.teacher_head.detach()[start:stop]
        if teacher_hidden_grad is not None:
            gemms.accumulate(teacher_hidden_grad, teacher_grad, teacher_block)
        teacher_weight_buffer = buffers.teacher_weight if head.teacher_weight is not None else buffers.weight
        if teacher_weight_buffer is not None:
            gemms.accumulate(teacher_weight_buffer[start:stop], teacher_grad.T, chunk.teacher_hidden)
    if student_hidden_grad is not None and buffers.student_hidden is not None:
        buffers.student_hidden.index_add_(0, chunk.index, student_hidden_grad)
    if teacher_hidden_grad is not None and buffers.teacher_hidden is not None:
        buffers.teacher_hidden.index_add_(0, chunk.index, teacher_hidden_grad)
