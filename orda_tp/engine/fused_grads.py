"""The fused path's input gradients: which inputs receive one, their buffers, and the gradient
GEMMs on a row group's staged logit gradients.

A group's staged ``dS`` (rows × real local columns) feeds ``dh[rows] += dS·W`` and
``dW += dSᵀ·h[rows]`` (and the same for the teacher's tensors): two GEMMs per side and group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .gemm import GemmPolicy, full_precision_reductions
from .head import HeadTensors
from .logits import LogitGrads

__all__ = ["GradNeeds", "GradientBuffers", "GradientStaging", "run_gradient_gemms", "weight_grad_dtype"]


@dataclass(frozen=True)
class GradNeeds:
    """Whether each head input receives a gradient (requires_grad, grad mode and the plan's
    routing already applied)."""

    student_hidden: bool
    weight: bool
    teacher_hidden: bool
    teacher_weight: bool

    @property
    def any(self) -> bool:
        return self.student_hidden or self.weight or self.teacher_hidden or self.teacher_weight


def weight_grad_dtype(weight: Tensor, statistics: torch.dtype, accumulation: str) -> torch.dtype:
    """The dtype a head weight's gradient is summed in (``KernelConfig.grad_weight_accumulation``)."""
    if accumulation == "compute" or (accumulation == "auto" and weight.dtype == torch.bfloat16):
        return weight.dtype
    return statistics


@dataclass(frozen=True)
class GradientBuffers:
    """Gradients of the head inputs that receive one (None for the others), summed over row groups.

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
        needs: GradNeeds,
        hidden_dtype: torch.dtype | None,
        statistics: torch.dtype,
        accumulation: str,
    ) -> GradientBuffers:
        """Zeroed buffers; ``hidden_dtype`` None: each hidden gradient in its input's dtype."""

        def hidden_buffer(tensor: Tensor | None, need: bool) -> Tensor | None:
            if not need or tensor is None:
                return None
            dtype = tensor.dtype if hidden_dtype is None else hidden_dtype
            return torch.zeros(tensor.shape, dtype=dtype, device=tensor.device)

        def weight_buffer(tensor: Tensor | None, need: bool) -> Tensor | None:
            if not need or tensor is None:
                return None
            dtype = weight_grad_dtype(tensor, statistics, accumulation)
            return torch.zeros(tensor.shape, dtype=dtype, device=tensor.device)

        return GradientBuffers(
            student_hidden=hidden_buffer(head.student_hidden, needs.student_hidden),
            weight=weight_buffer(head.weight, needs.weight),
            teacher_hidden=hidden_buffer(head.teacher_hidden, needs.teacher_hidden),
            teacher_weight=weight_buffer(head.teacher_weight, needs.teacher_weight),
        )

    @property
    def hidden(self) -> list[Tensor]:
        """The hidden-state gradients present (student's first): the ones summed over shards."""
        return [grad for grad in (self.student_hidden, self.teacher_hidden) if grad is not None]

    def with_hidden(self, summed: list[Tensor]) -> GradientBuffers:
        """These buffers with :attr:`hidden` replaced, in order, by ``summed``."""
        replacements = iter(summed)
        return GradientBuffers(
            student_hidden=None if self.student_hidden is None else next(replacements),
            weight=self.weight,
            teacher_hidden=None if self.teacher_hidden is None else next(replacements),
            teacher_weight=self.teacher_weight,
        )

    @property
    def present(self) -> list[Tensor]:
        """The gradients present, in input order."""
        grads = (self.student_hidden, self.weight, self.teacher_hidden, self.teacher_weight)
        return [grad for grad in grads if grad is not None]


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

    def views(self, begin: int, end: int, start: int, stop: int) -> LogitGrads:
        """The staging of batch rows ``[begin, end)`` and local columns ``[start, stop)``."""
        r0, r1 = begin - self.begin, end - self.begin
        teacher = None if self.teacher is None else self.teacher[r0:r1, start:stop]
        return LogitGrads(self.student[r0:r1, start:stop], teacher)


def _side_gemms(
    staged: Tensor,
    hidden: Tensor,
    weight: Tensor,
    hidden_grad: Tensor | None,
    weight_grad: Tensor | None,
    begin: int,
    valid: Tensor,
    gemms: GemmPolicy,
) -> None:
    """One side: ``dh[rows] += dS·W`` and ``dW += dSᵀ·h[rows]`` (ignored rows' ``h`` read as 0)."""
    end = begin + staged.shape[0]
    columns = staged.shape[1]
    if hidden_grad is not None:
        gemms.accumulate(hidden_grad[begin:end], staged, weight.detach()[:columns])
    if weight_grad is not None:
        rows = hidden.detach()[begin:end]
        rows = torch.where(valid[:, None], rows, 0.0)
        gemms.accumulate(weight_grad[:columns], staged.T, rows)


def run_gradient_gemms(
    head: HeadTensors, staging: GradientStaging, valid: Tensor, buffers: GradientBuffers, gemms: GemmPolicy
) -> None:
    """Add the staged group's contribution to ``buffers``; ``valid`` marks the group's rows that are
    not ignored (the others' hidden rows are not read, so a non-finite ignored row stays out)."""
    begin = staging.begin
    with full_precision_reductions():
        _side_gemms(staging.student, head.student_hidden, head.weight, buffers.student_hidden, buffers.weight, begin,
                    valid, gemms)  # fmt: skip
        if staging.teacher is not None and head.teacher_hidden is not None:
            # A tied teacher's weight gradient adds to the student head's.
            weight_grad = buffers.teacher_weight if head.teacher_weight is not None else buffers.weight
            _side_gemms(staging.teacher, head.teacher_hidden, head.teacher_head, buffers.teacher_hidden, weight_grad,
                        begin, valid, gemms)  # fmt: skip
