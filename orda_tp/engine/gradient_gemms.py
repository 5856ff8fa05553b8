"""What a row group does with its staged logit gradients: the input gradients' buffers and the
gradient GEMMs ``dh = a·dS·W`` and ``dW += a·dSᵀ·h`` (and a bias's ``db += a·Σ_rows dS``), ``a``
the side's logit scale: ``dS`` is the gradient of the scaled logits (docs/architecture.md, "GEMMs").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from .logits import HeadTensors, LogitGrads, addmm_fp32_into

__all__ = [
    "GemmPolicy",
    "GradNeeds",
    "GradientBuffers",
    "allocate_buffers",
    "run_gradient_gemms",
    "scale_by_upstream",
]


FP16_HEADROOM = 6.0e4  # below fp16's largest finite value, 65504


class GradNeeds(NamedTuple):
    """Whether each head input receives a gradient (requires_grad, grad mode and the plan's
    routing already applied), in :class:`HeadTensors` order."""

    student_hidden: bool
    weight: bool
    teacher_hidden: bool
    teacher_weight: bool
    bias: bool = False
    teacher_bias: bool = False


class GradientBuffers(NamedTuple):
    """Gradients of the head inputs that receive one (None for the others), summed over row
    groups, in :class:`HeadTensors` order.

    Hidden gradients are in the inputs' dtype on one device, where each row is written once, and
    in the statistics dtype on a shard, whose partial sums still have to be added; a head weight's
    in ``KernelConfig.grad_weight_accumulation``'s dtype: its own for "compute" (and "auto" with a
    bf16 weight: no extra memory, one rounding per group), else the statistics dtype; a bias's in
    the statistics dtype (V_local entries: fp32 costs nothing)."""

    student_hidden: Tensor | None
    weight: Tensor | None
    teacher_hidden: Tensor | None
    teacher_weight: Tensor | None
    bias: Tensor | None = None
    teacher_bias: Tensor | None = None


def allocate_buffers(
    head: HeadTensors,
    needs: GradNeeds,
    sharded: bool,
    statistics: torch.dtype,
    accumulation: str,
    written_columns: int,
) -> GradientBuffers:
    """Gradient buffers of the inputs that need one (see :class:`GradientBuffers`), unwritten where
    the gradient GEMMs will write them with β = 0: every row of a hidden gradient and a head
    gradient's first ``written_columns`` rows (the real local columns); the rest, and a bias's
    gradient (summed into), is zeroed."""
    buffers: list[Tensor | None] = []
    walked = head.student_hidden.shape[0] > 0
    for tensor, need, is_weight in zip(head[:4], needs, (False, True, False, True)):
        if not need or tensor is None:
            buffers.append(None)
            continue
        if is_weight:
            own = accumulation == "compute" or (accumulation == "auto" and tensor.dtype == torch.bfloat16)
        else:
            own = not sharded
        # Unwritten: no zero-fill, and no GEMM reads zeros (its first write is β = 0).
        buffer = torch.empty(tensor.shape, dtype=tensor.dtype if own else statistics, device=tensor.device)
        if not walked:  # no rows: no GEMM runs, so the gradient is 0
            buffer.zero_()
        elif is_weight:  # a padded shard's rows past its real columns: no GEMM writes them
            buffer[written_columns:].zero_()
        buffers.append(buffer)
    for tensor, need in zip(head[5:], needs[4:]):  # the biases: summed into, zeroed
        buffers.append(None if tensor is None or not need else torch.zeros_like(tensor, dtype=statistics))
    return GradientBuffers(*buffers)


@dataclass(frozen=True)
class GemmPolicy:
    """How staged logit gradients meet the gradient GEMMs: ``scale`` for fp16 materialization;
    ``logit_scales`` (student, teacher): each side's logit scale, the GEMMs' α (``LossPlan.student_scale``)."""

    scale: float | Tensor | None = None
    logit_scales: tuple[float, float] = (1.0, 1.0)

    def accumulate(self, target: Tensor, staged: Tensor, operand: Tensor, beta: float, alpha: float = 1.0) -> None:
        """``target = beta·target + alpha·staged · operand`` with ``staged`` in the call's staging
        dtype and ``beta`` 1 (add) or 0 (overwrite: ``target`` is not read, so it may hold anything,
        NaN included). bf16 staging: fp32 accumulation inside the GEMM; fp16 operands with a
        ``scale``: the staged fp32 gradient scaled into fp16 (out of its subnormal range) for the
        tensor cores, the product unscaled."""
        if staged.dtype == torch.bfloat16:
            if target.dtype == torch.bfloat16:
                # In place, added in the GEMM's epilogue; with β = 0 cuBLAS reads nothing of target.
                target.addmm_(staged, operand, beta=beta, alpha=alpha)
                return
            if addmm_fp32_into(target, staged, operand, beta, alpha):  # bf16 operands into fp32, in the epilogue
                return
            product = torch.mm(staged, operand, torch.float32)
        elif operand.is_cuda and operand.dtype == torch.float16 and self.scale is not None:
            # Lowered on the device where scale·max|gradient| would leave fp16's range.
            factor = torch.clamp(FP16_HEADROOM / staged.abs().amax(), max=self.scale)
            scaled = (staged * factor).to(torch.float16)
            product = torch.mm(scaled, operand, torch.float32) / factor
        else:
            product = staged @ operand.to(staged.dtype)
        if alpha != 1.0:  # the side's logit scale, on the product (the GEMMs above take it as α)
            product.mul_(alpha)
        if beta == 0:
            target.copy_(product)  # written, never read: whatever the unwritten buffer held is gone
        else:
            target += product.to(target.dtype)  # in place, in the target's dtype: one rounding per group


def run_gradient_gemms(
    head: HeadTensors,
    staged: LogitGrads,
    begin: int,
    valid: Tensor,
    buffers: GradientBuffers,
    gemms: GemmPolicy,
    tied: bool,
) -> None:
    """Write the contribution of the group staged for rows ``[begin, begin + rows)`` to ``buffers``:
    ``dh[rows] = a·dS·W``, ``dW += a·dSᵀ·h[rows]`` (written, β = 0, by the first group, ``begin ==
    0``) and ``db += a·Σ_rows dS``, ``a`` the side's logit scale (``gemms.logit_scales``).
    ``valid`` marks the group's rows that are not ignored. ``tied``: the teacher reads the
    student's head; where it trains, its weight (and bias) gradient adds to the student head's in
    one GEMM over the staging's ``stacked`` rows (``buffers.teacher_weight`` is None then)."""
    one_gemm = tied and staged.teacher is not None
    student_scale, teacher_scale = gemms.logit_scales
    student = (staged.student, head.student_hidden, head.weight, buffers.student_hidden, buffers.weight)
    sides = [(*student, buffers.bias, student_scale)]
    if staged.teacher is not None and head.teacher_hidden is not None:
        teacher_weight = head.weight if tied else head.teacher_weight
        assert teacher_weight is not None
        teacher = (staged.teacher, head.teacher_hidden, teacher_weight, buffers.teacher_hidden, buffers.teacher_weight)
        sides.append((*teacher, buffers.teacher_bias, teacher_scale))
    end, columns = begin + staged.student.shape[0], staged.student.shape[1]
    weight_beta = 0.0 if begin == 0 else 1.0  # the first group writes the unwritten head gradient
    # cuBLAS may not reduce split-K partial sums in bf16/fp16 here (torch allows it for bf16/fp16
    # outputs): a gradient GEMM then rounds once, to its output, as its fp32-output counterpart on
    # a vocabulary shard does.
    flags = torch.backends.cuda.matmul
    saved = (flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction)
    flags.allow_bf16_reduced_precision_reduction = False
    flags.allow_fp16_reduced_precision_reduction = False
    try:
        for logit_grads, hidden, weight, hidden_grad, weight_grad, bias_grad, scale in sides:
            if hidden_grad is not None:  # each group owns its rows: written once, β = 0
                gemms.accumulate(hidden_grad[begin:end], logit_grads, weight.detach()[:columns], beta=0.0, alpha=scale)
            if weight_grad is not None and not one_gemm:
                # Ignored rows' hidden states replaced by 0: a non-finite ignored row cannot reach dW.
                rows = torch.where(valid[:, None], hidden.detach()[begin:end], 0.0)
                gemms.accumulate(weight_grad[:columns], logit_grads.T, rows, beta=weight_beta, alpha=scale)
            if bias_grad is not None and not one_gemm:  # an ignored row's staged gradient is exactly 0
                bias_grad[:columns].add_(logit_grads.sum(0, dtype=bias_grad.dtype), alpha=scale)
        if one_gemm and buffers.weight is not None:  # one GEMM over both sides' rows
            assert staged.stacked is not None and head.teacher_hidden is not None
            both = torch.cat([head.student_hidden.detach()[begin:end], head.teacher_hidden.detach()[begin:end]])
            rows = torch.where(valid.repeat(2)[:, None], both, 0.0)
            gemms.accumulate(buffers.weight[:columns], staged.stacked.T, rows, beta=weight_beta, alpha=student_scale)
        if one_gemm and buffers.bias is not None:  # both sides' rows, like the weight
            assert staged.stacked is not None
            buffers.bias[:columns].add_(staged.stacked.sum(0, dtype=buffers.bias.dtype), alpha=student_scale)
    finally:  # restored whatever happens: the flags are process-wide
        flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction = saved


def scale_by_upstream(grads: Sequence[Tensor], upstream: Tensor) -> None:
    """Gradients formed in the forward for a unit upstream gradient (an eager call's), scaled in
    place by the 0-d ``upstream`` that backward receives: one launch per tensor with the scale read
    on the device (``triton_math.scale_in_place``, which skips a scale of exactly 1) for contiguous
    CUDA tensors, ``torch._foreach_mul_`` otherwise."""
    if not grads:
        return
    if grads[0].is_cuda and all(grad.is_contiguous() for grad in grads):
        from .triton_math import scale_in_place  # imports triton: only where it runs

        scale_in_place(grads, upstream)
    else:
        torch._foreach_mul_(list(grads), upstream)
