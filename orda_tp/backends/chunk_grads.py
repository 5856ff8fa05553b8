"""Gradients: logit gradients per block, staged for a group of rows, then the gradient GEMMs.

For a block of columns with student logits ``s`` and teacher logits ``t`` (row scale ``c`` =
upstream gradient × 1/N for "mean"; 0 on ignored rows, whose logit gradients are exactly 0):

- ``∂loss/∂s = c·[w_s·(softmax(s) − onehot(y)) + w_kl·T_s·∂D/∂u]``
- ``∂loss/∂t = c·[w_t·(softmax(t) − onehot(y)) + w_kl·T_s²/T_t·∂D/∂v]`` (only the terms that
  train the teacher under the plan's routing)

A group's staged ``dS`` (rows × real local columns) then feeds ``dh[rows] += dS·W`` and
``dW += dSᵀ·h[rows]`` (and the same for the teacher's tensors): two GEMMs per side and group.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from ..plan import LossPlan
from .chunk_stats import kl_block_terms
from .gemm import GemmPolicy, full_precision_reductions
from .head import HeadTensors

__all__ = ["GradientBuffers", "GradientStaging", "block_logit_grads", "run_gradient_gemms", "weight_grad_dtype"]


def weight_grad_dtype(weight: Tensor, statistics: torch.dtype, accumulation: str) -> torch.dtype:
    """The dtype a head weight's gradient is summed in (``KernelConfig.grad_weight_accumulation``)."""
    if accumulation == "compute" or (accumulation == "auto" and weight.dtype == torch.bfloat16):
        return weight.dtype
    return statistics


@dataclass
class GradientBuffers:
    """Gradients of the inputs that receive one (None for the others), summed over row groups.

    Hidden gradients are in ``hidden_dtype`` (the inputs' dtype on one device, where each row is
    written once; the statistics dtype where shards' partial sums still have to be added), head
    weights in :func:`weight_grad_dtype`."""

    student_hidden: Tensor | None
    weight: Tensor | None
    teacher_hidden: Tensor | None
    teacher_weight: Tensor | None

    @staticmethod
    def allocate(
        head: HeadTensors,
        needs: tuple[bool, bool, bool, bool],
        hidden_dtype: torch.dtype | None,
        statistics: torch.dtype,
        accumulation: str,
    ) -> GradientBuffers:
        """``hidden_dtype`` None: each hidden gradient in its input's dtype."""
        tensors = (head.student_hidden, head.weight, head.teacher_hidden, head.teacher_weight)
        buffers: list[Tensor | None] = []
        for slot, (tensor, need) in enumerate(zip(tensors, needs)):
            if not need or tensor is None:
                buffers.append(None)
                continue
            if slot in (1, 3):
                dtype = weight_grad_dtype(tensor, statistics, accumulation)
            else:
                dtype = tensor.dtype if hidden_dtype is None else hidden_dtype
            buffers.append(torch.zeros(tensor.shape, dtype=dtype, device=tensor.device))
        return GradientBuffers(*buffers)

    def as_list(self) -> list[Tensor | None]:
        return [self.student_hidden, self.weight, self.teacher_hidden, self.teacher_weight]


@dataclass(frozen=True)
class GradientStaging:
    """Staged logit gradients of rows ``[begin, begin + rows)`` over the real local columns:
    ``student`` always, ``teacher`` when the teacher is trained (else None)."""

    begin: int
    student: Tensor
    teacher: Tensor | None

    @staticmethod
    def allocate(
        begin: int, rows: int, columns: int, dtype: torch.dtype, device: torch.device, with_teacher: bool
    ) -> GradientStaging:
        def buffer() -> Tensor:
            return torch.empty(rows, columns, dtype=dtype, device=device)

        return GradientStaging(begin, buffer(), buffer() if with_teacher else None)

    def rows_of(self, begin: int, end: int, start: int, stop: int) -> tuple[Tensor, Tensor | None]:
        """Views of the staging for batch rows ``[begin, end)`` and local columns ``[start, stop)``."""
        r0, r1 = begin - self.begin, end - self.begin
        teacher = None if self.teacher is None else self.teacher[r0:r1, start:stop]
        return self.student[r0:r1, start:stop], teacher


def run_gradient_gemms(
    head: HeadTensors, staging: GradientStaging, valid: Tensor, buffers: GradientBuffers, gemms: GemmPolicy
) -> None:
    """Add the staged group's contribution to ``buffers``; ``valid`` marks the group's rows that are
    not ignored (the others' hidden rows are not read, so a non-finite ignored row stays out)."""
    end = staging.begin + staging.student.shape[0]
    columns = staging.student.shape[1]
    sides = [(staging.student, head.student_hidden, head.weight, buffers.student_hidden, buffers.weight)]
    if staging.teacher is not None and head.teacher_hidden is not None:
        teacher_weight_grad = buffers.teacher_weight if head.teacher_weight is not None else buffers.weight
        sides.append(
            (staging.teacher, head.teacher_hidden, head.teacher_head, buffers.teacher_hidden, teacher_weight_grad)
        )
    with full_precision_reductions():
        for staged, hidden, weight, hidden_grad, weight_grad in sides:
            if hidden_grad is not None:
                gemms.accumulate(hidden_grad[staging.begin : end], staged, weight.detach()[:columns])
            if weight_grad is not None:
                rows = hidden.detach()[staging.begin : end]
                rows = torch.where(valid[:, None], rows, 0.0)
                gemms.accumulate(weight_grad[:columns], staged.T, rows)


def _cross_entropy_grad(logits: Tensor, lse: Tensor, local_labels: Tensor, coef: Tensor) -> Tensor:
    """``coef·(softmax(logits) − onehot(label))`` on a block; labels outside the block add nothing."""
    columns = torch.arange(logits.shape[1], device=logits.device)
    one_hot = (columns[None, :] == local_labels[:, None]).to(logits.dtype)
    return (torch.exp(logits - lse[:, None]) - one_hot) * coef[:, None]


def _masked(grad: Tensor, keep: Tensor) -> Tensor:
    return torch.where(keep[:, None], grad, 0.0)


def block_logit_grads(
    plan: LossPlan,
    constants: Mapping[str, Tensor],
    student: Tensor,
    teacher: Tensor | None,
    local_labels: Tensor,
) -> tuple[Tensor, Tensor | None]:
    """``(∂loss/∂s, ∂loss/∂t)`` on one block; the teacher part is None when it is not trained.
    ``constants``: the row constants of :func:`orda_tp.backends.row_formulas.grad_step` by name.
    Rows whose ``scale`` is 0 get exactly 0 (whatever their logits hold)."""
    row_scale = constants["scale"]
    student_grad = torch.zeros_like(student)
    teacher_grad = torch.zeros_like(teacher) if plan.teacher_receives_grad and teacher is not None else None
    w_ce_s, w_kl_s, w_kl_t = plan.logit_grad_weights
    if plan.student_ce_weight > 0:
        student_grad += _cross_entropy_grad(student, constants["lse_s"], local_labels, w_ce_s * row_scale)
    if teacher_grad is not None and plan.teacher_ce_trains_teacher:
        assert teacher is not None
        teacher_grad += _cross_entropy_grad(teacher, constants["lse_t"], local_labels, constants["c_ce_t"])
    if plan.computes_kl:
        divergence = plan.divergence
        assert divergence is not None and teacher is not None
        lse_u, lse_v, keep = constants["lse_u"], constants["lse_v"], constants["keep"] > 0
        terms = kl_block_terms(plan, student, teacher, lse_u, lse_v, local_labels if divergence.needs_target else None)
        student_grad += (w_kl_s * row_scale)[:, None] * _masked(
            divergence.student_grad(terms, dict(constants), plan.params), keep
        )
        if teacher_grad is not None and plan.kl_trains_teacher:
            teacher_grad += (w_kl_t * row_scale)[:, None] * _masked(
                divergence.teacher_grad(terms, dict(constants), plan.params), keep
            )
    active = row_scale != 0
    return _masked(student_grad, active), None if teacher_grad is None else _masked(teacher_grad, active)
