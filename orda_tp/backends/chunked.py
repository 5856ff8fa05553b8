"""The chunked torch backend: rows in chunks, columns in blocks, never a (BT, V) tensor.

Per chunk of valid rows: compute each column block's logits (kept for the chunk:
``rows × V_local`` values, the bounded workspace), merge the blocks' records (round 1, round 2)
through the exchange (identity on one device, one all-gather per round across a tensor-parallel
group), finalize the rows, and, when a gradient is wanted, form the logit gradients and run the
gradient GEMMs while the chunk's logits are still at hand.

For "mean"/"sum" the gradient is formed during the forward with unit upstream gradient and
scaled in backward (no second pass of logits GEMMs). For "none" the upstream gradient differs
per row, so backward recomputes each chunk's logits and reuses the saved row statistics. Either
way the hidden gradients are summed over the vocabulary shards once, in backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..exchange import RecordExchange
from ..parallel.layout import VocabLayout
from ..plan import LossPlan
from .block_math import BlockMath
from .chunk_grads import GradientBuffers, accumulate_chunk_gradients
from .chunk_stats import RowStats, chunk_row_stats
from .gemm import GemmPolicy
from .head import HeadTensors, RowChunk, block_logits, column_blocks, statistics_dtype

__all__ = ["ChunkedProblem", "chunked_loss"]


@dataclass(frozen=True)
class ChunkedProblem:
    """Everything of a call besides the differentiable tensors.

    ``denominator``: N for "mean" (a number or a 0-d tensor), ignored otherwise;
    ``grad_needs``: whether (student_hidden, weight, teacher_hidden, teacher_weight) receive a
    gradient (requires_grad, grad mode and routing already applied); ``layout``: this device's
    columns (and whether hidden rows are sequence-parallel); ``labels``/``valid_rows`` cover the
    full batch; ``math``: how a block becomes records and gradients (torch or Triton).
    """

    plan: LossPlan
    labels: Tensor
    valid_rows: Tensor
    denominator: float | Tensor
    grad_needs: tuple[bool, bool, bool, bool]
    exchange: RecordExchange
    layout: VocabLayout
    math: BlockMath
    gemms: GemmPolicy = GemmPolicy()

    @property
    def wants_grad(self) -> bool:
        return any(self.grad_needs)

    def head(self, tensors: tuple[Tensor | None, ...]) -> HeadTensors:
        return HeadTensors(*tensors, vocab_start=self.layout.vocab_start, real_columns=self.layout.real_local_columns)


def _chunks(problem: ChunkedProblem, head: HeadTensors, dtype: torch.dtype) -> Iterator[RowChunk]:
    # Sized from the largest shard, so that every rank of a group walks the same chunks.
    rows = problem.plan.config.rows_per_chunk(problem.valid_rows.numel(), problem.layout.max_local_columns)
    with_teacher = problem.plan.needs_teacher_logits
    for begin in range(0, problem.valid_rows.numel(), rows):
        index = problem.valid_rows[begin : begin + rows]
        yield RowChunk.gather(head, index, problem.labels, dtype, with_teacher)


def _chunk_blocks(
    problem: ChunkedProblem, head: HeadTensors, chunk: RowChunk
) -> list[tuple[int, int, Tensor, Tensor | None]]:
    with_teacher = problem.plan.needs_teacher_logits
    return [
        (start, stop, *block_logits(head, chunk, start, stop, with_teacher))
        for start, stop in column_blocks(
            head.local_vocab, problem.math.block_columns(problem.plan.config.vocab_block, head.local_vocab)
        )
    ]


def _row_scale(problem: ChunkedProblem, upstream: Tensor, chunk: RowChunk) -> Tensor:
    """Per-row factor of the gradient: the upstream gradient, divided by N for "mean"."""
    reduction = problem.plan.reduction
    if reduction == "none":
        scale = upstream.index_select(0, chunk.index)
    else:
        scale = upstream.expand(chunk.index.numel())
    if reduction == "mean":
        scale = scale / problem.denominator
    return scale.to(chunk.dtype)


def _reduce(problem: ChunkedProblem, per_row: Tensor, total_rows: int) -> Tensor:
    reduction = problem.plan.reduction
    if reduction == "none":
        full = torch.zeros(total_rows, dtype=per_row.dtype, device=per_row.device)
        return full.index_copy(0, problem.valid_rows, per_row)
    total = per_row.sum()
    return total / problem.denominator if reduction == "mean" else total


def _full_rows(problem: ChunkedProblem, inputs: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
    """The inputs with hidden states holding every row of the batch (gathered under sequence
    parallelism; a cache's hidden states are gathered like the others)."""
    student_hidden, weight, teacher_hidden, teacher_weight, teacher_logits = inputs
    hidden = [t for t in (student_hidden, teacher_hidden) if t is not None]
    gathered = iter(problem.exchange.gather_rows(hidden))
    student_hidden = next(gathered)
    teacher_hidden = next(gathered) if teacher_hidden is not None else None
    return student_hidden, weight, teacher_hidden, teacher_weight, teacher_logits


class _ChunkedDistillation(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        problem: ChunkedProblem,
        student_hidden: Tensor,
        weight: Tensor,
        teacher_hidden: Tensor | None,
        teacher_weight: Tensor | None,
        teacher_logits: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        inputs = (student_hidden, weight, teacher_hidden, teacher_weight, teacher_logits)
        full = _full_rows(problem, inputs)
        head = problem.head(full)
        dtype = statistics_dtype(*inputs)
        plan = problem.plan
        eager = problem.wants_grad and plan.reduction != "none"
        buffers = GradientBuffers.allocate(head, problem.grad_needs, dtype) if eager else None
        unit = torch.ones((), dtype=dtype, device=student_hidden.device)
        saved_stats: list[RowStats] = []
        components: list[list[Tensor]] = [[], [], []]
        for chunk in _chunks(problem, head, dtype):
            blocks = _chunk_blocks(problem, head, chunk)
            stats = chunk_row_stats(
                plan,
                [(head.vocab_start + start, s, t) for start, _, s, t in blocks],
                chunk.labels,
                problem.exchange,
                problem.math,
            )
            for parts, values in zip(components, (stats.student_ce, stats.teacher_ce, stats.kl)):
                parts.append(values)
            if buffers is not None:
                accumulate_chunk_gradients(
                    plan,
                    head,
                    chunk,
                    stats,
                    blocks,
                    _row_scale(problem, unit, chunk),
                    buffers,
                    problem.math,
                    problem.gemms,
                )
            elif problem.wants_grad:
                saved_stats.append(stats)
        problem.exchange.finish(unit)

        empty = torch.zeros(0, dtype=dtype, device=student_hidden.device)
        student_ce, teacher_ce, kl = (torch.cat(parts) if parts else empty for parts in components)
        per_row = plan.student_ce_weight * student_ce + plan.teacher_ce_weight * teacher_ce + plan.kl_weight * kl
        total_rows = problem.labels.shape[0]
        outputs = tuple(_reduce(problem, values, total_rows) for values in (per_row, student_ce, teacher_ce, kl))

        ctx.problem = problem
        ctx.eager_buffers = buffers
        ctx.saved_stats = saved_stats
        # Only the deferred backward (reduction "none") recomputes logits from the gathered rows.
        ctx.gathered_hidden = (full[0], full[2]) if problem.layout.sequence_parallel and buffers is None else None
        ctx.save_for_backward(*inputs)
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs  # type: ignore[return-value]

    @staticmethod
    @once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_loss: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:
        problem: ChunkedProblem = ctx.problem
        inputs = ctx.saved_tensors
        with torch.autocast(inputs[0].device.type, enabled=False):
            grads = _input_gradients(ctx, problem, inputs, grad_loss)
        return (None, *grads, None)


def _input_gradients(
    ctx: torch.autograd.function.FunctionCtx, problem: ChunkedProblem, inputs: tuple, grad_loss: Tensor
) -> tuple[Tensor | None, ...]:
    """Gradients of (student_hidden, weight, teacher_hidden, teacher_weight), in their dtypes."""
    buffers: GradientBuffers | None = ctx.eager_buffers
    dtype = statistics_dtype(*inputs)
    if buffers is not None:
        grads = [None if b is None else b * grad_loss.to(b.dtype) for b in _as_list(buffers)]
    else:
        full = inputs
        if ctx.gathered_hidden is not None:
            full = (ctx.gathered_hidden[0], inputs[1], ctx.gathered_hidden[1], *inputs[3:])
        head = problem.head(full)
        fresh = GradientBuffers.allocate(head, problem.grad_needs, dtype)
        for chunk, stats in zip(_chunks(problem, head, dtype), ctx.saved_stats):
            blocks = _chunk_blocks(problem, head, chunk)
            scale = _row_scale(problem, grad_loss.to(dtype), chunk)
            accumulate_chunk_gradients(
                problem.plan, head, chunk, stats, blocks, scale, fresh, problem.math, problem.gemms
            )
        grads = _as_list(fresh)
    hidden_slots = [i for i in (0, 2) if grads[i] is not None]
    reduced = problem.exchange.reduce_row_gradients([grads[i] for i in hidden_slots])
    for slot, grad in zip(hidden_slots, reduced):
        grads[slot] = grad
    return tuple(None if g is None else g.to(t.dtype) for g, t in zip(grads, inputs[:4]))


def _as_list(buffers: GradientBuffers) -> list[Tensor | None]:
    return [buffers.student_hidden, buffers.weight, buffers.teacher_hidden, buffers.teacher_weight]


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
