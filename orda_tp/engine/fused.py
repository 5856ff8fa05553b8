"""The fused loss's autograd Function: the chunked backends' loss from hidden states and head
weights, never a (BT, V) tensor.

Rows are walked in contiguous chunks (every row, ignored ones included, so that nothing depends on
a count read from the device) by the row walk (:mod:`.row_walk`): per chunk its logits
(``rows × V_local`` fp32 values, the bounded workspace; one GEMM for both sides of a tied head),
its statistics rounds through the exchange and, when a gradient is wanted, its logit gradients
staged while its logits are at hand. Chunks form row groups: a group's staged gradients feed one
pair of gradient GEMMs per side (:mod:`.fused_grads`) and are freed before the next group's are
allocated.

For "mean"/"sum" the gradient is formed during the forward with unit upstream gradient and
scaled in backward (no second pass of logits GEMMs). For "none" the upstream gradient differs
per row, so backward recomputes each chunk's logits and reuses the saved row statistics. Across
vocabulary shards each row group's hidden gradients are summed as soon as the group is complete
(one reduce-scatter at the end under sequence parallelism); backward waits for the sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from ..config import RowLayout
from ..exchange import RecordExchange
from ..parallel.layout import VocabLayout
from ..plan import LossPlan
from .block_math import BlockMath
from .fused_grads import GradientBuffers, GradientStaging, GradNeeds, run_gradient_gemms
from .gemm import GemmPolicy
from .head import HeadTensors
from .logits import statistics_dtype
from .row_walk import GradTarget, RowWalk, row_ranges, walk_rows
from .stats import RowStats

__all__ = ["ChunkedProblem", "InputTensors", "chunked_loss"]


class InputTensors(NamedTuple):
    """The differentiable tensors of a call (this rank's rows under sequence parallelism)."""

    student_hidden: Tensor
    weight: Tensor
    teacher_hidden: Tensor | None
    teacher_weight: Tensor | None
    teacher_logits: Tensor | None


class GatheredHidden(NamedTuple):
    """The batch's hidden rows gathered under sequence parallelism, kept for a deferred backward."""

    student: Tensor
    teacher: Tensor | None


@dataclass(frozen=True)
class ChunkedProblem:
    """Everything of a call besides the differentiable tensors.

    ``valid``: (BT,) rows whose label is not ``ignore_index``; ``denominator``: N for "mean" (a
    number or a 0-d tensor), ignored otherwise; ``grad_needs``: which head inputs receive a
    gradient; ``layout``: this device's columns (and whether hidden rows are sequence-parallel);
    ``math``: how a block becomes records and gradients (torch or Triton).
    """

    plan: LossPlan
    labels: Tensor
    valid: Tensor
    denominator: float | Tensor
    grad_needs: GradNeeds
    exchange: RecordExchange
    layout: VocabLayout
    math: BlockMath
    gemms: GemmPolicy = GemmPolicy()

    @property
    def wants_grad(self) -> bool:
        return self.grad_needs.any

    @property
    def walk(self) -> RowWalk:
        return RowWalk(self.plan, self.labels, self.valid, self.exchange, self.layout, self.math)

    def head(self, tensors: InputTensors) -> HeadTensors:
        return HeadTensors(*tensors, columns=self.layout.real_local_columns)

    def allocate_gradients(self, head: HeadTensors, statistics: torch.dtype) -> GradientBuffers:
        # One device writes each hidden row once, in its dtype; shards' partial sums stay in the
        # statistics dtype until they are added.
        hidden_dtype = statistics if self.layout.world_size > 1 else None
        return GradientBuffers.allocate(
            head, self.grad_needs, hidden_dtype, statistics, self.plan.config.grad_weight_accumulation
        )


def _row_layout(
    problem: ChunkedProblem, head: HeadTensors, statistics: torch.dtype, staging: torch.dtype | None
) -> RowLayout:
    """Rows per chunk and group, sized from the largest shard so that every rank of a group walks
    the same chunks."""
    plan = problem.plan
    sides = 2 if plan.needs_teacher_logits else 1
    staged_sides = 2 if plan.teacher_receives_grad else 1
    staged_bytes = 0 if staging is None else staged_sides * staging.itemsize
    rows = head.student_hidden.shape[0]
    return plan.config.row_layout(
        rows, problem.layout.max_local_columns, sides * statistics.itemsize, staged_bytes, problem.layout.world_size
    )


def _upstream_scale(problem: ChunkedProblem, upstream: Tensor, statistics: torch.dtype) -> Tensor:
    """The upstream gradient (÷ N for "mean") in the statistics dtype, once per pass: 0-d, or
    (BT,) for "none"."""
    scale = upstream / problem.denominator if problem.plan.reduction == "mean" else upstream
    return scale.to(statistics)


def _walk_rows(
    problem: ChunkedProblem,
    head: HeadTensors,
    statistics: torch.dtype,
    saved: list[RowStats] | None = None,
    buffers: GradientBuffers | None = None,
    upstream: Tensor | None = None,
) -> list[RowStats]:
    """One pass over the rows, group by group: each chunk's statistics (computed, or ``saved``
    from the forward) and, with ``buffers``, its logit gradients for the ``upstream`` gradient
    staged and the group's gradient GEMMs run into ``buffers``. Returns the chunks' statistics in
    row order."""
    plan = problem.plan
    walk, source = problem.walk, head.logits_source(plan.needs_teacher_logits)
    staging_dtype, upstream_scale = None, None
    if buffers is not None:
        assert upstream is not None
        staging_dtype = problem.gemms.staging_dtype(head.gemm_operands(plan.teacher_receives_grad), statistics)
        upstream_scale = _upstream_scale(problem, upstream, statistics)
    layout = _row_layout(problem, head, statistics, staging_dtype)
    device = head.student_hidden.device
    walked: list[RowStats] = []
    for group_begin, group_end in row_ranges(0, head.student_hidden.shape[0], layout.group_rows):
        chunks = row_ranges(group_begin, group_end, layout.chunk_rows)
        group_saved = None if saved is None else saved[len(walked) : len(walked) + len(chunks)]
        if buffers is None:
            walked += walk_rows(walk, source, chunks, statistics, group_saved)
            continue
        assert staging_dtype is not None and upstream_scale is not None
        staging = GradientStaging.allocate(
            group_begin, group_end - group_begin, head.columns, staging_dtype, device, plan.teacher_receives_grad
        )
        walked += walk_rows(walk, source, chunks, statistics, group_saved, GradTarget(staging, upstream_scale))
        run_gradient_gemms(head, staging, problem.valid[group_begin:group_end], buffers, problem.gemms)
        problem.exchange.start_row_gradient_sum(buffers.hidden, group_begin, group_end)
        del staging  # the group's staged gradients go before the next group's are allocated
    return walked


def _reduce(problem: ChunkedProblem, per_row: Tensor) -> Tensor:
    """Ignored rows read 0; "sum"/"mean" add the rows (÷ N for "mean")."""
    values = torch.where(problem.valid, per_row, 0.0)
    reduction = problem.plan.reduction
    if reduction == "none":
        return values
    total = values.sum()
    return total / problem.denominator if reduction == "mean" else total


def _outputs(problem: ChunkedProblem, walked: list[RowStats], like: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss, student_ce, teacher_ce, kl)`` from the chunks' statistics, reduced."""
    plan = problem.plan
    empty = like.new_zeros(0)
    student_ce = torch.cat([stats.student_ce for stats in walked]) if walked else empty
    teacher_ce = torch.cat([stats.teacher_ce for stats in walked]) if walked else empty
    kl = torch.cat([stats.kl for stats in walked]) if walked else empty
    per_row = plan.student_ce_weight * student_ce + plan.teacher_ce_weight * teacher_ce + plan.kl_weight * kl
    return _reduce(problem, per_row), _reduce(problem, student_ce), _reduce(problem, teacher_ce), _reduce(problem, kl)


def _full_rows(problem: ChunkedProblem, inputs: InputTensors) -> InputTensors:
    """The inputs with hidden states holding every row of the batch (gathered under sequence
    parallelism; a cache's hidden states are gathered like the others)."""
    hidden = [t for t in (inputs.student_hidden, inputs.teacher_hidden) if t is not None]
    gathered = iter(problem.exchange.gather_rows(hidden))
    student_hidden = next(gathered)
    teacher_hidden = next(gathered) if inputs.teacher_hidden is not None else None
    return inputs._replace(student_hidden=student_hidden, teacher_hidden=teacher_hidden)


class _ChunkedContext(FunctionCtx):
    """What :class:`_ChunkedDistillation` keeps on its autograd context (annotations only: torch
    declares ``saved_tensors`` on its C base class alone, as a one-element tuple)."""

    problem: ChunkedProblem
    eager_buffers: GradientBuffers | None
    saved_stats: list[RowStats] | None
    gathered_hidden: GatheredHidden | None
    saved_tensors: tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]


class _ChunkedDistillation(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: _ChunkedContext,
        problem: ChunkedProblem,
        student_hidden: Tensor,
        weight: Tensor,
        teacher_hidden: Tensor | None,
        teacher_weight: Tensor | None,
        teacher_logits: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        inputs = InputTensors(student_hidden, weight, teacher_hidden, teacher_weight, teacher_logits)
        full = _full_rows(problem, inputs)
        head = problem.head(full)
        statistics = statistics_dtype(*inputs)
        eager = problem.wants_grad and problem.plan.reduction != "none"
        unit = torch.ones((), dtype=statistics, device=student_hidden.device)
        buffers = problem.allocate_gradients(head, statistics) if eager else None
        walked = _walk_rows(problem, head, statistics, buffers=buffers, upstream=None if buffers is None else unit)
        problem.exchange.finish(unit)
        outputs = _outputs(problem, walked, unit)

        ctx.problem = problem
        ctx.eager_buffers = buffers
        ctx.saved_stats = walked if problem.wants_grad else None
        # The deferred backward (reduction "none") recomputes logits from the gathered rows; a
        # repeated backward of an eager call gathers them again.
        ctx.gathered_hidden = None
        if problem.layout.sequence_parallel and buffers is None:
            ctx.gathered_hidden = GatheredHidden(full.student_hidden, full.teacher_hidden)
        # torch's stub takes tensors only; save_for_backward documents None as accepted (a no-op).
        ctx.save_for_backward(*inputs)  # type: ignore[arg-type]
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    @once_differentiable
    def backward(ctx: _ChunkedContext, grad_loss: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:
        inputs = InputTensors(*ctx.saved_tensors)
        with torch.autocast(inputs.student_hidden.device.type, enabled=False):
            grads = _input_gradients(ctx, ctx.problem, inputs, grad_loss)
        return (None, *grads, None)


def _input_gradients(
    ctx: _ChunkedContext, problem: ChunkedProblem, inputs: InputTensors, grad_loss: Tensor
) -> tuple[Tensor | None, ...]:
    """Gradients of (student_hidden, weight, teacher_hidden, teacher_weight), in their dtypes.

    An eager call's buffers are scaled in place and handed over by the first backward; a later
    backward through the same call (``retain_graph=True``) recomputes them like the deferred path."""
    eager_buffers, ctx.eager_buffers = ctx.eager_buffers, None
    if eager_buffers is not None:
        buffers = eager_buffers
    else:
        gathered = ctx.gathered_hidden
        if gathered is None:
            full = _full_rows(problem, inputs)
        else:
            full = inputs._replace(student_hidden=gathered.student, teacher_hidden=gathered.teacher)
        head = problem.head(full)
        statistics = statistics_dtype(*inputs)
        buffers = problem.allocate_gradients(head, statistics)
        _walk_rows(problem, head, statistics, ctx.saved_stats, buffers, grad_loss.to(statistics))
    grads = buffers.with_hidden(problem.exchange.reduce_row_gradients(buffers.hidden))
    if eager_buffers is not None:  # the eager buffers hold the gradient of a unit upstream (summed over shards)
        _scale_in_place(grads.present, grad_loss)
    return (
        _in_dtype_of(grads.student_hidden, inputs.student_hidden),
        _in_dtype_of(grads.weight, inputs.weight),
        _in_dtype_of(grads.teacher_hidden, inputs.teacher_hidden),
        _in_dtype_of(grads.teacher_weight, inputs.teacher_weight),
    )


def _in_dtype_of(grad: Tensor | None, tensor: Tensor | None) -> Tensor | None:
    if grad is None:
        return None
    assert tensor is not None  # only a given input has a gradient
    return grad.to(tensor.dtype)


def _scale_in_place(tensors: list[Tensor], scale: Tensor) -> None:
    """``t *= scale`` in place (the buffers become the returned gradients), ``scale`` never read
    on the host; on CUDA one Triton launch per tensor reading the scale on the device."""
    if tensors and tensors[0].is_cuda and all(t.is_contiguous() for t in tensors):
        from ..kernels.ops import scale_in_place

        scale_in_place(tensors, scale)
    else:
        torch._foreach_mul_(tensors, scale)


def chunked_loss(
    problem: ChunkedProblem,
    student_hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor | None,
    teacher_weight: Tensor | None,
    teacher_logits: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss, student_ce, teacher_ce, kl)`` reduced as the plan says; only ``loss`` is differentiable."""
    return _ChunkedDistillation.apply(problem, student_hidden, weight, teacher_hidden, teacher_weight, teacher_logits)
