"""The fused loss's autograd Function: the chunked backends' loss from hidden states and head
weights, walked in row chunks and row groups, never a (BT, V) tensor; eager gradients for
"mean"/"sum", deferred ones for "none" (docs/architecture.md, "Gradients: eager and deferred").
"""

from __future__ import annotations

from typing import NamedTuple, cast

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from ..arguments.plan import LossPlan
from ..divergences.terms import COMPONENTS
from .call import Call, RecordExchange
from .gradient_gemms import (
    GradientBuffers,
    GradNeeds,
    allocate_buffers,
    run_gradient_gemms,
    scale_by_upstream,
)
from .logits import HeadTensors, LogitGrads, logits_source, statistics_dtype
from .mixture_walk import mixture_row_stats
from .row_walk import GradTarget, row_ranges, walk_rows
from .stats import RowStats
from .workspace import RowLayout, row_layout

__all__ = ["chunked_loss", "unit_gradients"]


class GatheredHidden(NamedTuple):
    """The batch's hidden rows gathered under sequence parallelism, kept for a deferred backward."""

    student: Tensor
    teacher: Tensor | None


def _full_rows(exchange: RecordExchange, head: HeadTensors) -> HeadTensors:
    """The inputs with hidden states holding every row of the batch (gathered under sequence
    parallelism; a cache's hidden states are gathered like the others)."""
    hidden = [t for t in (head.student_hidden, head.teacher_hidden) if t is not None]
    gathered = iter(exchange.gather_rows(hidden))
    student_hidden = next(gathered)
    teacher_hidden = next(gathered) if head.teacher_hidden is not None else None
    return head._replace(student_hidden=student_hidden, teacher_hidden=teacher_hidden)


class CallLayout(NamedTuple):
    """How a call walks its rows (:class:`.workspace.RowLayout`) and the dtype in which a row
    group's logit gradients are staged for the gradient GEMMs."""

    rows: RowLayout
    staging_dtype: torch.dtype


def _call_layout(call: Call[LossPlan], head: HeadTensors, statistics: torch.dtype, gradients: bool) -> CallLayout:
    """The call's rows per chunk and per group (:func:`.workspace.row_layout`) and staging dtype,
    the same on every rank of a group (sized from the largest shard)."""
    plan, layout = call.plan, call.layout
    operands = [head.student_hidden, head.weight]
    if plan.teacher_receives_grad:
        teacher_weight = head.weight if plan.tied_head else head.teacher_weight
        operands += [t for t in (head.teacher_hidden, teacher_weight) if t is not None]
    # Logit gradients are staged in bf16 where every GEMM operand is a bf16 CUDA tensor (the kernels
    # write them once, in bf16), else in the statistics dtype.
    bf16 = statistics == torch.float32 and all(t.is_cuda and t.dtype == torch.bfloat16 for t in operands)
    staging_dtype = torch.bfloat16 if bf16 else statistics
    # Sized for the staging whenever gradients are formed, in the forward or in a deferred backward:
    # that backward reads the forward's saved statistics, so it must walk the forward's chunks.
    staged_bytes = (2 if plan.teacher_receives_grad else 1) * staging_dtype.itemsize if gradients else 0
    # A TeacherMixture's mixed and views forms hold every teacher's block of a chunk at once, and one more.
    mixture = plan.mixture
    teachers = 1 if mixture is None or mixture.form == "linear" else len(mixture.members) + 1
    logit_bytes = (1 + teachers if plan.needs_teacher_logits else 1) * statistics.itemsize
    rows = row_layout(
        plan.config,
        head.student_hidden.shape[0],
        layout.max_local_columns,
        logit_bytes,
        staged_bytes,
        layout.world_size,
        layout.workspace_mib,
    )
    return CallLayout(rows, staging_dtype)


def _walk_groups(
    call: Call[LossPlan],
    head: HeadTensors,
    statistics: torch.dtype,
    layout: CallLayout,
    saved: list[RowStats] | None = None,
    buffers: GradientBuffers | None = None,
    upstream: Tensor | None = None,
) -> list[RowStats]:
    """One pass over the rows in ``layout``'s chunks and groups: each chunk's statistics (computed,
    or ``saved`` from the forward) and, with ``buffers``, its logit gradients for the ``upstream``
    gradient (0-d, or (BT,) for "none") staged and the group's gradient GEMMs run into ``buffers``.
    Returns the chunks' statistics in row order."""
    plan, exchange, columns = call.plan, call.exchange, call.layout.real_local_columns
    # The logits source caps the blocks unless the block math does as it reads them.
    assert call.math is not None
    caps = (None, None) if call.math.applies_softcap else (plan.student_softcap, plan.teacher_softcap)
    scales = (plan.student_scale, plan.teacher_scale)
    source = logits_source(head, plan.needs_teacher_logits, plan.tied_head, call.teacher_blocks, caps, scales)
    # A teacher mixture whose rows mix teachers walks each chunk's blocks its own way (engine.mixture_walk).
    mixing = plan.mixture is not None and plan.mixture.form != "linear" and plan.computes_kl
    steps = mixture_row_stats if mixing else None
    upstream_scale = upstream
    if buffers is not None:
        assert upstream is not None
        # ÷ N once per pass, on the device (a tensor N is never read on the host).
        upstream_scale = (upstream / call.denominator if plan.reduction == "mean" else upstream).to(statistics)
        if call.row_weights is not None:  # a row's weight scales its gradient as its loss
            upstream_scale = upstream_scale * call.row_weights.to(statistics)
    rows, device = head.student_hidden.shape[0], head.student_hidden.device
    walked: list[RowStats] = []
    for group_begin, group_end in row_ranges(0, rows, layout.rows.group_rows):
        chunks = row_ranges(group_begin, group_end, layout.rows.chunk_rows)
        group_saved = None if saved is None else saved[len(walked) : len(walked) + len(chunks)]
        if buffers is None:
            walked += walk_rows(call, source, chunks, statistics, group_saved, steps=steps)
            continue
        assert upstream_scale is not None
        # The teacher's rows follow the student's in one buffer, so a tied head's dW takes both in one GEMM.
        sides, group_rows = (2 if plan.teacher_receives_grad else 1), group_end - group_begin
        # Unwritten: the walk writes every row and real column before the GEMMs read them.
        stacked = torch.empty(sides * group_rows, columns, dtype=layout.staging_dtype, device=device)
        teacher, both = (stacked[group_rows:], stacked) if sides == 2 else (None, None)
        staged = LogitGrads(stacked[:group_rows], teacher, both)
        target = GradTarget(staged, group_begin, upstream_scale)
        walked += walk_rows(call, source, chunks, statistics, group_saved, target, steps)
        run_gradient_gemms(
            head, staged, group_begin, call.valid[group_begin:group_end], buffers, call.gemms, plan.tied_head
        )
        if exchange is not None:
            hidden_grads = [g for g in (buffers.student_hidden, buffers.teacher_hidden) if g is not None]
            # The group's hidden-gradient rows are final: their sum over the ranks overlaps the next groups.
            exchange.start_row_gradient_sum(hidden_grads, group_begin, group_end)
        del staged, stacked, teacher, both  # the group's staging goes before the next group's is allocated
    return walked


def _outputs(call: Call[LossPlan], walked: list[RowStats], like: Tensor) -> tuple[Tensor, ...]:
    """``(loss, *COMPONENTS)`` from the chunks' statistics, each row's times its token weight:
    ignored rows read 0; "sum"/"mean" add the rows (÷ N for "mean")."""
    plan, valid = call.plan, call.valid

    per_chunk = [
        {
            **stats.student_terms,
            "teacher_ce": stats.teacher_ce,
            "kl": stats.kl,
            "student_entropy": stats.student_entropy,
        }
        for stats in walked
    ]
    components = {
        name: torch.cat([chunk[name] for chunk in per_chunk]) if walked else like.new_zeros(0) for name in COMPONENTS
    }
    weighted = (weight * components[name] for name, weight in plan.component_weights.items())
    per_row = sum(weighted, like.new_zeros(()))
    reduced, weights = [], call.row_weights
    for values in (per_row, *(components[name] for name in COMPONENTS)):
        # where, not a product with valid: an ignored row reads exactly 0, even where its statistics are NaN.
        values = torch.where(valid, values if weights is None else values * weights.to(values.dtype), 0.0)
        if plan.reduction != "none":
            values = values.sum()
            values = values / call.denominator if plan.reduction == "mean" else values
        reduced.append(values)
    return tuple(reduced)


class _ChunkedContext(FunctionCtx):
    """What :class:`_ChunkedDistillation` keeps on its autograd context (annotations only)."""

    call: Call[LossPlan]
    needs: GradNeeds
    layout: CallLayout
    eager_buffers: GradientBuffers | None
    saved_stats: list[RowStats] | None
    gathered_hidden: GatheredHidden | None
    # Annotated here: torch declares saved_tensors on its C base class alone, as a one-element tuple.
    saved_tensors: tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None, Tensor | None]


class _ChunkedDistillation(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: _ChunkedContext,
        call: Call[LossPlan],
        needs: GradNeeds,
        student_hidden: Tensor,
        weight: Tensor,
        teacher_hidden: Tensor | None,
        teacher_weight: Tensor | None,
        teacher_logits: Tensor | None,
        bias: Tensor | None,
        teacher_bias: Tensor | None,
    ) -> tuple[Tensor, ...]:
        inputs = HeadTensors(student_hidden, weight, teacher_hidden, teacher_weight, teacher_logits, bias, teacher_bias)
        head = inputs if call.exchange is None else _full_rows(call.exchange, inputs)
        statistics = statistics_dtype(*inputs)
        eager = any(needs) and call.plan.reduction != "none"
        # Eager gradients are formed for a unit upstream gradient; backward scales them in place.
        unit = torch.ones((), dtype=statistics, device=student_hidden.device)
        buffers = None
        if eager:
            sharded, accumulation = call.exchange is not None, call.plan.config.grad_weight_accumulation
            columns = call.layout.real_local_columns
            buffers = allocate_buffers(head, needs, sharded, statistics, accumulation, columns)
        layout = _call_layout(call, head, statistics, any(needs))
        walked = _walk_groups(call, head, statistics, layout, buffers=buffers, upstream=unit if eager else None)
        if call.exchange is not None:
            # Waits for the gradient sums in flight: a forward returns with no collective pending.
            call.exchange.finish(unit)
        outputs = _outputs(call, walked, unit)

        ctx.call, ctx.needs, ctx.eager_buffers, ctx.layout = call, needs, buffers, layout
        ctx.saved_stats = walked if any(needs) else None
        # The deferred backward (reduction "none") recomputes logits from the gathered rows; a
        # repeated backward of an eager call gathers them again.
        ctx.gathered_hidden = None
        if call.layout.sequence_parallel and buffers is None:
            ctx.gathered_hidden = GatheredHidden(head.student_hidden, head.teacher_hidden)
        # torch's stub takes tensors only; save_for_backward documents None as accepted (a no-op).
        ctx.save_for_backward(*inputs)  # type: ignore[arg-type]
        ctx.mark_non_differentiable(*outputs[1:])  # the components are reports; only the loss has a gradient
        return outputs

    @staticmethod
    @once_differentiable
    def backward(ctx: _ChunkedContext, grad_loss: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:
        """Gradients of (student_hidden, weight, teacher_hidden, teacher_weight, bias, teacher_bias), in
        their dtypes."""
        inputs = HeadTensors(*ctx.saved_tensors)
        call, exchange = ctx.call, ctx.call.exchange
        # Handed over once: a repeated backward (retain_graph=True) recomputes them like the deferred path.
        eager_buffers, ctx.eager_buffers = ctx.eager_buffers, None
        # The recomputed logits and GEMMs run in the dtypes the forward chose, as its own walk did.
        with torch.autocast(inputs.student_hidden.device.type, enabled=False):
            buffers = eager_buffers
            if buffers is None:
                head, gathered = inputs, ctx.gathered_hidden
                if gathered is not None:
                    head = inputs._replace(student_hidden=gathered.student, teacher_hidden=gathered.teacher)
                elif exchange is not None:
                    head = _full_rows(exchange, inputs)
                statistics = statistics_dtype(*inputs)
                sharded, accumulation = exchange is not None, call.plan.config.grad_weight_accumulation
                columns = call.layout.real_local_columns
                buffers = allocate_buffers(head, ctx.needs, sharded, statistics, accumulation, columns)
                _walk_groups(call, head, statistics, ctx.layout, ctx.saved_stats, buffers, grad_loss.to(statistics))
            if exchange is not None:
                hidden = [g for g in (buffers.student_hidden, buffers.teacher_hidden) if g is not None]
                summed = iter(exchange.reduce_row_gradients(hidden))
                buffers = buffers._replace(
                    student_hidden=None if buffers.student_hidden is None else next(summed),
                    teacher_hidden=None if buffers.teacher_hidden is None else next(summed),
                )
            if eager_buffers is not None:
                # Scaled after the sum over the ranks: every rank backpropagates the same (replicated) loss.
                scale_by_upstream([grad for grad in buffers if grad is not None], grad_loss)
        # Only an input that is given has a gradient, cast once from its buffer's dtype (fp32 on a shard).
        tensors = inputs[:4] + inputs[5:]  # the teacher's logits (a cache) have none
        grads = [
            None if grad is None or tensor is None else grad.to(tensor.dtype) for grad, tensor in zip(buffers, tensors)
        ]
        return (None, None, *grads[:4], None, *grads[4:])


def chunked_loss(
    call: Call[LossPlan],
    student_hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor | None,
    teacher_weight: Tensor | None,
    teacher_logits: Tensor | None,
    bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """``(loss, *COMPONENTS)`` reduced as the plan says; only ``loss`` is differentiable. An input
    receives a gradient when grad mode is on, it requires grad and the plan routes a gradient to it
    (``LossPlan.gradient_routes``)."""
    grad_on, routes = torch.is_grad_enabled(), call.plan.gradient_routes
    heads = (student_hidden, weight, teacher_hidden, teacher_weight, bias, teacher_bias)
    needs = GradNeeds(*(grad_on and t is not None and t.requires_grad and route for t, route in zip(heads, routes)))
    return _ChunkedDistillation.apply(
        call, needs, student_hidden, weight, teacher_hidden, teacher_weight, teacher_logits, bias, teacher_bias
    )


def unit_gradients(loss: Tensor) -> GradientBuffers:
    """The gradients that a one-device "mean" or "sum" call whose inputs receive one formed in its
    forward for a unit upstream gradient, ``loss`` its loss: its buffers, unscaled and in their own
    dtypes (:func:`.gradient_gemms.allocate_buffers`), which its backward would scale by the upstream
    gradient (``scale_by_upstream``) and then cast to the inputs' dtypes. The node keeps them: a
    backward of its own would scale these same tensors in place."""
    node = loss.grad_fn
    if not isinstance(node, _ChunkedDistillation._backward_cls):
        raise ValueError("unit_gradients takes the loss of a call of the fused engine")
    context = cast(_ChunkedContext, node)  # a Function's backward node is the context its forward filled
    if context.call.exchange is not None:  # a shard's hidden gradients are partial sums still
        raise ValueError("unit_gradients takes the loss of a one-device call")
    buffers: GradientBuffers | None = context.eager_buffers
    if buffers is None:
        raise ValueError("unit_gradients takes the loss of a 'mean' or 'sum' call that forms gradients")
    return buffers
