"""Block math on torch ops over (rows × block) tensors: runs anywhere, fp64 included.

Logit gradients of a block with student logits ``s`` and teacher logits ``t`` (row scale ``c`` =
upstream gradient × 1/N for "mean"; 0 on ignored rows, whose logit gradients are exactly 0):

- ``∂loss/∂s = c·[w_s·(softmax(s) − onehot(y)) + w_kl·T_s·∂D/∂u]``
- ``∂loss/∂t = c·[w_t·(softmax(t) − onehot(y)) + w_kl·T_s²/T_t·∂D/∂v]`` (only the terms that
  train the teacher under the plan's routing)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from ..divergences import BlockTerms
from ..divergences.expr import evaluate_rows
from ..plan import LossPlan
from ..records import LogitFamily, PartitionRecord, block_partition_record, merge_stacked_partition_records
from .logits import LogitGrads
from .row_formulas import RowProgram
from .stats import GradRows

__all__ = ["TorchBlockMath", "block_logit_grads", "kl_block_terms"]


def kl_block_terms(
    plan: LossPlan,
    student: Tensor,
    teacher: Tensor,
    lse_u: Tensor,
    lse_v: Tensor,
    local_labels: Tensor | None,
) -> BlockTerms:
    """Normalized ``log p``, ``log q``, ``p``, ``q`` of a block (and the label mask for dkd)."""
    logp = student / plan.student_temperature - lse_u[:, None]
    logq = teacher / plan.teacher_temperature - lse_v[:, None]
    is_target = None
    if local_labels is not None:
        columns = torch.arange(student.shape[1], device=student.device)
        is_target = columns[None, :] == local_labels[:, None]
    return BlockTerms(logp=logp, logq=logq, p=torch.exp(logp), q=torch.exp(logq), is_target=is_target)


def _cross_entropy_grad(logits: Tensor, lse: Tensor, local_labels: Tensor, coef: Tensor) -> Tensor:
    """``coef·(softmax(logits) − onehot(label))`` on a block; labels outside the block add nothing."""
    columns = torch.arange(logits.shape[1], device=logits.device)
    one_hot = (columns[None, :] == local_labels[:, None]).to(logits.dtype)
    return (torch.exp(logits - lse[:, None]) - one_hot) * coef[:, None]


def _masked(grad: Tensor, keep: Tensor) -> Tensor:
    return torch.where(keep[:, None], grad, 0.0)


def block_logit_grads(
    plan: LossPlan, rows: GradRows, student: Tensor, teacher: Tensor | None, local_labels: Tensor
) -> tuple[Tensor, Tensor | None]:
    """``(∂loss/∂s, ∂loss/∂t)`` on one block; the teacher part is None when it is not trained.
    Rows whose ``scale`` is 0 get exactly 0 (whatever their logits hold)."""
    row_scale = rows.scale
    student_grad = torch.zeros_like(student)
    teacher_grad = torch.zeros_like(teacher) if plan.teacher_receives_grad and teacher is not None else None
    w_ce_s, w_kl_s, w_kl_t = plan.logit_grad_weights
    if rows.lse_s is not None:
        student_grad += _cross_entropy_grad(student, rows.lse_s, local_labels, w_ce_s * row_scale)
    if teacher_grad is not None and rows.lse_t is not None and rows.c_ce_t is not None:
        assert teacher is not None
        teacher_grad += _cross_entropy_grad(teacher, rows.lse_t, local_labels, rows.c_ce_t)
    if plan.computes_kl:
        divergence = plan.divergence
        assert divergence is not None and teacher is not None
        assert rows.lse_u is not None and rows.lse_v is not None and rows.keep is not None
        keep, consts = rows.keep > 0, dict(rows.consts)
        labels = local_labels if divergence.needs_target else None
        terms = kl_block_terms(plan, student, teacher, rows.lse_u, rows.lse_v, labels)
        student_kl = divergence.student_grad(terms, consts, plan.params)
        student_grad += (w_kl_s * row_scale)[:, None] * _masked(student_kl, keep)
        if teacher_grad is not None and plan.kl_trains_teacher:
            teacher_kl = divergence.teacher_grad(terms, consts, plan.params)
            teacher_grad += (w_kl_t * row_scale)[:, None] * _masked(teacher_kl, keep)
    active = row_scale != 0
    return _masked(student_grad, active), None if teacher_grad is None else _masked(teacher_grad, active)


class TorchBlockMath:
    """Torch ops on (rows × block) tensors."""

    reads_stored_cache = False

    def block_columns(self, configured: int, local_columns: int) -> int:
        return configured  # each block's temporaries are (rows × block) tensors

    def partition(
        self, student: Tensor, teacher: Tensor | None, labels: Tensor, col_start: int, families: Sequence[LogitFamily]
    ) -> PartitionRecord:
        return block_partition_record(student, teacher, labels, col_start, families)

    def merge_stacked(self, stacked: Tensor, num_families: int) -> PartitionRecord:
        return merge_stacked_partition_records(stacked, num_families)

    def kl_sums(
        self,
        plan: LossPlan,
        student: Tensor,
        teacher: Tensor,
        labels: Tensor,
        col_start: int,
        lse_u: Tensor,
        lse_v: Tensor,
    ) -> Tensor:
        divergence = plan.divergence
        assert divergence is not None
        local_labels = labels - col_start if divergence.needs_target else None
        return divergence.block_sums(kl_block_terms(plan, student, teacher, lse_u, lse_v, local_labels), plan.params)

    def rows(
        self, program: RowProgram, values: Mapping[str, Tensor], scalars: Mapping[str, float], like: Tensor
    ) -> Tensor:
        constants = {name: torch.tensor(value, dtype=like.dtype) for name, value in scalars.items()}
        return evaluate_rows(program.exprs, {**values, **constants}, like)

    def stage_logit_grads(
        self,
        plan: LossPlan,
        rows: GradRows,
        student: Tensor,
        teacher: Tensor | None,
        labels: Tensor,
        col_start: int,
        out: LogitGrads,
    ) -> None:
        student_grad, teacher_grad = block_logit_grads(plan, rows, student, teacher, labels - col_start)
        out.student.copy_(student_grad)
        if out.teacher is not None:
            assert teacher_grad is not None
            out.teacher.copy_(teacher_grad)
