"""The chunked backends' loop: rows in chunks, columns in blocks, never a (BT, V) tensor.

Rows are walked in contiguous chunks (every row, ignored ones included, so that nothing depends on
a count read from the device). Per chunk: form its logits (``rows × V_local`` fp32 values, the
bounded workspace), merge the blocks' records (round 1, round 2) through the exchange (identity on
one device, one all-gather per round across a tensor-parallel group) and finalize the rows. When a
gradient is wanted, each chunk's logit gradients are staged while its logits are at hand, and a
group of chunks shares one pair of gradient GEMMs per side (:mod:`.chunk_grads`).

For "mean"/"sum" the gradient is formed during the forward with unit upstream gradient and
scaled in backward (no second pass of logits GEMMs). For "none" the upstream gradient differs
per row, so backward recomputes each chunk's logits and reuses the saved row statistics. Across
vocabulary shards each row group's hidden gradients are summed as soon as the group is complete
(one reduce-scatter at the end under sequence parallelism); backward waits for the sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from ..config import RowLayout
from ..exchange import RecordExchange
from ..parallel.layout import VocabLayout
from ..plan import LossPlan
from .block_math import BlockMath
from .chunk_grads import GradientBuffers, GradientStaging, run_gradient_gemms
from .chunk_stats import RowStats, chunk_row_stats, grad_row_constants
from .gemm import GemmPolicy
from .head import HeadTensors, RowChunk, block_logits, column_blocks, statistics_dtype

__all__ = ["ChunkedProblem", "chunked_loss"]

# The differentiable tensors of a call: (student_hidden, weight, teacher_hidden, teacher_weight,
# teacher_logits).
InputTensors = tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]


@dataclass(frozen=True)
class ChunkedProblem:
    """Everything of a call besides the differentiable tensors.

    ``valid``: (BT,) rows whose label is not ``ignore_index``; ``denominator``: N for "mean" (a
    number or a 0-d tensor), ignored otherwise; ``grad_needs``: whether (student_hidden, weight,
    teacher_hidden, teacher_weight) receive a gradient (requires_grad, grad mode and routing
    already applied); ``layout``: this device's columns (and whether hidden rows are
    sequence-parallel); ``math``: how a block becomes records and gradients (torch or Triton).
    """

    plan: LossPlan
    labels: Tensor
    valid: Tensor
    denominator: float | Tensor
    grad_needs: tuple[bool, bool, bool, bool]
    exchange: RecordExchange
    layout: VocabLayout
    math: BlockMath
    gemms: GemmPolicy = GemmPolicy()

    @property
    def wants_grad(self) -> bool:
        return any(self.grad_needs)

    def head(self, tensors: InputTensors) -> HeadTensors:
        return HeadTensors(*tensors, vocab_start=self.layout.vocab_start, real_columns=self.layout.real_local_columns)

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


def _chunk_blocks(
    problem: ChunkedProblem, head: HeadTensors, chunk: RowChunk
) -> list[tuple[int, int, Tensor, Tensor | None]]:
    with_teacher = problem.plan.needs_teacher_logits
    math = problem.math
    width = math.block_columns(problem.plan.config.vocab_block, head.columns)
    return [
        (start, stop, *block_logits(head, chunk, start, stop, with_teacher, math.reads_stored_cache))
        for start, stop in column_blocks(head.columns, width)
    ]


def _upstream_scale(problem: ChunkedProblem, upstream: Tensor, statistics: torch.dtype) -> Tensor:
    """The upstream gradient (÷ N for "mean") in the statistics dtype, once per pass: 0-d, or
    (BT,) for "none"."""
    scale = upstream / problem.denominator if problem.plan.reduction == "mean" else upstream
    return scale.to(statistics)


def _walk_chunk(
    problem: ChunkedProblem,
    head: HeadTensors,
    chunk: RowChunk,
    saved: RowStats | None,
    staged: tuple[GradientStaging, Tensor] | None,
    like: Tensor,
) -> RowStats:
    """One chunk: its logits, its statistics (computed, or ``saved``), and with ``staged =
    (staging, upstream scale)`` its logit gradients staged. The logits live only as long as this
    call."""
    plan = problem.plan
    blocks = _chunk_blocks(problem, head, chunk)
    stats = saved
    if stats is None:
        starts = [(head.vocab_start + start, s, t) for start, _, s, t in blocks]
        stats = chunk_row_stats(plan, starts, chunk.labels, problem.exchange, problem.math, like)
    if staged is not None:
        staging, upstream_scale = staged
        if upstream_scale.dim():
            upstream_scale = upstream_scale[chunk.begin : chunk.end]
        valid = problem.valid[chunk.begin : chunk.end]
        constants, names = grad_row_constants(plan, stats, upstream_scale, valid, problem.math, like)
        for start, stop, student, teacher in blocks:
            problem.math.stage_logit_grads(
                plan, constants, names, student, teacher, chunk.labels, head.vocab_start + start,
                staging.rows_of(chunk.begin, chunk.end, start, stop),
            )  # fmt: skip
    return stats


def _walk_rows(
    problem: ChunkedProblem,
    head: HeadTensors,
    statistics: torch.dtype,
    gradients: tuple[GradientBuffers, Tensor] | None,
    saved: list[RowStats] | None,
) -> list[RowStats]:
    """One pass over the rows: each chunk's statistics (computed, or ``saved`` from the forward),
    and with ``gradients = (buffers, upstream)`` its logit gradients staged and the gradient GEMMs
    run per group. Returns the chunks' statistics in row order."""
    plan = problem.plan
    staging_dtype, upstream_scale = None, None
    if gradients is not None:
        staging_dtype = problem.gemms.staging_dtype(head.gemm_operands(plan.teacher_receives_grad), statistics)
        upstream_scale = _upstream_scale(problem, gradients[1], statistics)
    layout = _row_layout(problem, head, statistics, staging_dtype)
    total = head.student_hidden.shape[0]
    device = head.student_hidden.device
    like = torch.empty(0, dtype=statistics, device=device)
    saved_stats = iter(saved) if saved is not None else None
    walked: list[RowStats] = []
    for group_begin in range(0, total, layout.group_rows):
        group_end = min(total, group_begin + layout.group_rows)
        staging, staged = None, None
        if gradients is not None:
            assert staging_dtype is not None and upstream_scale is not None
            staging = GradientStaging.allocate(
                group_begin, group_end - group_begin, head.columns, staging_dtype, device, plan.teacher_receives_grad
            )
            staged = (staging, upstream_scale)
        for begin in range(group_begin, group_end, layout.chunk_rows):
            end = min(group_end, begin + layout.chunk_rows)
            chunk = RowChunk.slice(head, begin, end, problem.labels, statistics, plan.needs_teacher_logits)
            saved_chunk = next(saved_stats) if saved_stats is not None else None
            walked.append(_walk_chunk(problem, head, chunk, saved_chunk, staged, like))
        if gradients is not None:
            assert staging is not None
            buffers = gradients[0]
            run_gradient_gemms(head, staging, problem.valid[group_begin:group_end], buffers, problem.gemms)
            hidden = [grad for grad in (buffers.student_hidden, buffers.teacher_hidden) if grad is not None]
            problem.exchange.start_row_gradient_sum(hidden, group_begin, group_end)
        del staging, staged  # the group's staged gradients go before the next group's are allocated
    return walked


def _reduce(problem: ChunkedProblem, per_row: Tensor) -> Tensor:
    """Ignored rows read 0; "sum"/"mean" add the rows (÷ N for "mean")."""
    values = torch.where(problem.valid, per_row, 0.0)
    reduction = problem.plan.reduction
    if reduction == "none":
        return values
    total = values.sum()
    return total / problem.denominator if reduction == "mean" else total


def _full_rows(problem: ChunkedProblem, inputs: InputTensors) -> InputTensors:
    """The inputs with hidden states holding every row of the batch (gathered under sequence
    parallelism; a cache's hidden states are gathered like the others)."""
    student_hidden, weight, teacher_hidden, teacher_weight, teacher_logits = inputs
    hidden = [t for t in (student_hidden, teacher_hidden) if t is not None]
    gathered = iter(problem.exchange.gather_rows(hidden))
    student_hidden = next(gathered)
    teacher_hidden = next(gathered) if teacher_hidden is not None else None
    return student_hidden, weight, teacher_hidden, teacher_weight, teacher_logits


class _ChunkedContext(FunctionCtx):
    """What :class:`_ChunkedDistillation` keeps on its autograd context (annotations only: torch
    declares ``saved_tensors`` on its C base class alone, as a one-element tuple)."""

    problem: ChunkedProblem
    eager_buffers: GradientBuffers | None
    saved_stats: list[RowStats] | None
    gathered_hidden: tuple[Tensor, Tensor | None] | None
    saved_tensors: InputTensors


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
        inputs: InputTensors = (student_hidden, weight, teacher_hidden, teacher_weight, teacher_logits)
        full = _full_rows(problem, inputs)
        head = problem.head(full)
        statistics = statistics_dtype(*inputs)
        plan = problem.plan
        eager = problem.wants_grad and plan.reduction != "none"
        unit = torch.ones((), dtype=statistics, device=student_hidden.device)
        buffers = problem.allocate_gradients(head, statistics) if eager else None
        walked = _walk_rows(problem, head, statistics, None if buffers is None else (buffers, unit), None)
        problem.exchange.finish(unit)

        empty = torch.zeros(0, dtype=statistics, device=student_hidden.device)
        student_ce, teacher_ce, kl = (
            torch.cat([getattr(stats, name) for stats in walked]) if walked else empty
            for name in ("student_ce", "teacher_ce", "kl")
        )
        per_row = plan.student_ce_weight * student_ce + plan.teacher_ce_weight * teacher_ce + plan.kl_weight * kl
        outputs = (
            _reduce(problem, per_row),
            _reduce(problem, student_ce),
            _reduce(problem, teacher_ce),
            _reduce(problem, kl),
        )

        ctx.problem = problem
        ctx.eager_buffers = buffers
        ctx.saved_stats = walked if problem.wants_grad else None
        # The deferred backward (reduction "none") recomputes logits from the gathered rows; a
        # repeated backward of an eager call gathers them again.
        ctx.gathered_hidden = (full[0], full[2]) if problem.layout.sequence_parallel and buffers is None else None
        # torch's stub takes tensors only; save_for_backward documents None as accepted (a no-op).
        ctx.save_for_backward(*inputs)  # type: ignore[arg-type]
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    @once_differentiable
    def backward(ctx: _ChunkedContext, grad_loss: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:
        problem = ctx.problem
        inputs = ctx.saved_tensors
        with torch.autocast(inputs[0].device.type, enabled=False):
            grads = _input_gradients(ctx, problem, inputs, grad_loss)
        return (None, *grads, None)


def _input_gradients(
    ctx: _ChunkedContext, problem: ChunkedProblem, inputs: InputTensors, grad_loss: Tensor
) -> tuple[Tensor | None, ...]:
    """Gradients of (student_hidden, weight, teacher_hidden, teacher_weight), in their dtypes.

    An eager call's buffers are scaled in place and handed over by the first backward; a later
    backward through the same call (``retain_graph=True``) recomputes them like the deferred path."""
    statistics = statistics_dtype(*inputs)
    buffers = ctx.eager_buffers
    if buffers is not None:
        ctx.eager_buffers = None
        grads = buffers.as_list()
    else:
        if ctx.gathered_hidden is not None:
            full: InputTensors = (ctx.gathered_hidden[0], inputs[1], ctx.gathered_hidden[1], inputs[3], inputs[4])
        else:
            full = _full_rows(problem, inputs)
        head = problem.head(full)
        fresh = problem.allocate_gradients(head, statistics)
        _walk_rows(problem, head, statistics, (fresh, grad_loss.to(statistics)), ctx.saved_stats)
        grads = fresh.as_list()
    hidden = [(slot, grad) for slot, grad in enumerate(grads) if slot in (0, 2) and grad is not None]
    reduced = problem.exchange.reduce_row_gradients([grad for _, grad in hidden])
    for (slot, _), grad in zip(hidden, reduced):
        grads[slot] = grad
    if buffers is not None:  # the eager buffers hold the gradient of a unit upstream (summed over shards)
        _scale_in_place([grad for grad in grads if grad is not None], grad_loss)
    return tuple(_in_dtype_of(grad, tensor) for grad, tensor in zip(grads, inputs[:4]))


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
