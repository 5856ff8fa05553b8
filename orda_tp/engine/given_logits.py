"""Losses on logits the caller holds (``KDLoss``, ``flash_ce_kd_loss``): their row chunks, their
walk, and ``KDLoss``'s autograd Function, whose gradient of the student's logits is formed in the
forward and scaled in backward (docs/architecture.md, "Logits-level losses").
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from ..arguments.plan import LossPlan
from ..teachers.source import TeacherBlocks
from .call import Call
from .gradient_gemms import scale_by_upstream
from .logits import LogitGrads, LogitsSource, PairedLogits, StoredLogits
from .row_walk import GradTarget, RowRange, row_ranges, walk_rows
from .stats import RowStats
from .workspace import row_layout

__all__ = ["chunks_of", "logits_distillation", "row_statistics"]


def chunks_of(call: Call[LossPlan], dtype: torch.dtype, formed_sides: int = 0) -> list[RowRange]:
    """The row chunks of a loss on given logits, the same on every rank of a group (they set the
    collectives): ``KernelConfig.chunk_size.nrows`` rows, or as many as fit the default workspace
    of the ``dtype`` logits a chunk holds (its ``formed_sides``, and the stored sides' copies where
    the block math converts them), from the widest shard; the whole batch where it holds none."""
    assert call.math is not None
    # The Triton kernels read stored logits in place (a top-k cache's rows too); the torch backend copies both.
    held_sides = formed_sides if call.math.reads_stored_cache else 2
    rows, layout, config = call.labels.shape[0], call.layout, call.plan.config
    chunk_rows = max(rows, 1)  # a chunk that holds no logits keeps a few values per row: one chunk
    if held_sides or config.chunk_size.nrows is not None:
        held, shards, workspace = held_sides * dtype.itemsize, layout.world_size, layout.workspace_mib
        chunk_rows = row_layout(config, rows, layout.max_local_columns, held, 0, shards, workspace).chunk_rows
    return row_ranges(0, rows, chunk_rows)


def row_statistics(
    call: Call[LossPlan],
    source: LogitsSource,
    dtype: torch.dtype,
    chunks: list[RowRange],
    target: GradTarget | None = None,
) -> list[RowStats]:
    """Each chunk's finalized row statistics, in row order, with ``target`` the logit gradients
    written in the same walk, and the end of the call's exchange."""
    walked = walk_rows(call, source, chunks, dtype, None, target)
    if call.exchange is not None:
        # A call with no rows still exchanges its errors here, so that no rank skips a collective.
        call.exchange.finish(torch.empty(0, dtype=dtype, device=call.labels.device))
    return walked


class _LogitsContext(FunctionCtx):
    """What :class:`_LogitsDistillation` keeps on its autograd context (annotations only)."""

    call: Call[LossPlan]
    chunks: list[RowRange]
    unit_scale: Tensor
    walked: list[RowStats]
    teacher: TeacherBlocks
    dtype: torch.dtype
    eager_grad: Tensor | None
    saved_tensors: tuple[Tensor]  # annotated here: torch declares it on its C base class alone


def _unit_scale(call: Call[LossPlan], dtype: torch.dtype, like: Tensor) -> Tensor:
    """Each row's gradient factor for a unit upstream gradient: ``1/N``, times the row's weight."""
    # 1/N formed on the device: a tensor N is never read on the host.
    scale = (torch.ones((), dtype=dtype, device=like.device) / call.denominator).to(dtype)
    return scale if call.row_weights is None else scale * call.row_weights.to(dtype)


def _gradient_target(student: Tensor, unit_scale: Tensor) -> GradTarget:
    """A new gradient of the student's logits, as the walk's target for ``unit_scale`` per row."""
    # Unwritten: the walk writes every row and column of it (0 on ignored rows), in the logits' dtype.
    grad = torch.empty(student.shape, dtype=student.dtype, device=student.device)
    return GradTarget(LogitGrads(grad, None), 0, unit_scale)


class _LogitsDistillation(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: _LogitsContext,
        call: Call[LossPlan],
        student: Tensor,
        teacher: TeacherBlocks,
        dtype: torch.dtype,
        wants_grad: bool,
    ) -> Tensor:
        target, chunks = None, chunks_of(call, dtype)
        if wants_grad:
            ctx.unit_scale = _unit_scale(call, dtype, student)
            target = _gradient_target(student, ctx.unit_scale)
        walked = row_statistics(call, PairedLogits(StoredLogits(student), teacher), dtype, chunks, target)
        per_row = torch.cat([stats.kl for stats in walked]) if walked else student.new_zeros(0, dtype=dtype)
        if call.row_weights is not None:
            per_row = per_row * call.row_weights.to(dtype)
        loss = torch.where(call.valid, per_row, 0.0).sum() / call.denominator
        if target is not None:
            ctx.call, ctx.chunks, ctx.walked, ctx.teacher, ctx.dtype = call, chunks, walked, teacher, dtype
            ctx.eager_grad = target.grads.student
            ctx.save_for_backward(student)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: _LogitsContext, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        # Handed over once: a repeated backward (retain_graph=True) walks the chunks again.
        grad, ctx.eager_grad = ctx.eager_grad, None
        if grad is None:  # a repeated backward: the gradient walked again from the saved statistics
            (student,) = ctx.saved_tensors
            source, target = PairedLogits(StoredLogits(student), ctx.teacher), _gradient_target(student, ctx.unit_scale)
            grad = target.grads.student
            with torch.autocast(student.device.type, enabled=False):
                walk_rows(ctx.call, source, ctx.chunks, ctx.dtype, ctx.walked, target)
        # In place, no collective: each rank's gradient is its own columns' slice, merged in the forward.
        scale_by_upstream([grad], grad_loss.to(ctx.dtype))
        return None, grad, None, None, None


def logits_distillation(call: Call[LossPlan], student: Tensor, teacher: TeacherBlocks, dtype: torch.dtype) -> Tensor:
    """``Σ_valid rows w_i·T²·D(p_i, q_i) / N`` (0-d, the statistics ``dtype``) of (rows, local
    columns) student logits and the teacher's blocks (``StoredLogits`` of its logits, or a top-k
    cache's), ``w_i`` the call's ``row_weights`` (1 when None), ``N`` its denominator;
    differentiable with respect to ``student`` only."""
    wants_grad = torch.is_grad_enabled() and student.requires_grad  # apply hides grad mode from forward
    return _LogitsDistillation.apply(call, student, teacher, dtype, wants_grad)
