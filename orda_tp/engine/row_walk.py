"""The row walk of the fused and the logits-level losses: rows in chunks, columns in blocks, never
a (rows, V) tensor. Per chunk: its logits blocks, round 1 and the partition step, round 2 (KL term
and student entropy) and the finish step (KL only), and with a :class:`GradTarget` the grad step
and the logit gradients (docs/architecture.md, "The record/merge protocol"). It knows neither the
variant, nor the number of ranks, nor what the gradients feed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from ..arguments.plan import LossPlan
from ..divergences import RowTargets
from ..divergences.terms import STUDENT_TERMS
from .call import Call
from .logits import LogitGrads, LogitsBlock, LogitsSource
from .records import empty_record
from .row_formulas import finish_step, grad_step, partition_step
from .stats import GRAD_ROW_CONSTANTS, GradRows, KLRowStats, RowStats

__all__ = [
    "ChunkStats",
    "ChunkTarget",
    "GradTarget",
    "RowRange",
    "chunk_row_stats",
    "kl_round",
    "row_ranges",
    "stage_grads",
    "walk_rows",
]

RowRange = tuple[int, int]  # half-open rows [begin, end) of the batch


def row_ranges(begin: int, end: int, size: int) -> list[RowRange]:
    """``[begin, end)`` cut into consecutive ranges of ``size`` rows (the last one shorter)."""
    return [(start, min(end, start + size)) for start in range(begin, end, size)]


@dataclass(frozen=True)
class GradTarget:
    """Logit gradients wanted: written into ``grads``, whose first row is batch row ``first_row``
    (its columns are the local columns), for the upstream gradient ``upstream`` (÷ N for "mean";
    0-d, or (rows,) per row) in the statistics dtype."""

    grads: LogitGrads
    first_row: int
    upstream: Tensor


ChunkTarget = tuple[GradTarget, int, int]  # a gradient target and the batch rows [begin, end) of a chunk


class ChunkStats(Protocol):
    """A chunk's statistics and, with a target, its logit gradients, from its blocks (``walk_rows``'
    ``steps``); ``rows``: the chunk's batch rows."""

    def __call__(
        self,
        call: Call[LossPlan],
        blocks: Sequence[LogitsBlock],
        labels: Tensor,
        like: Tensor,
        target: ChunkTarget | None,
        rows: RowRange,
    ) -> RowStats: ...


def walk_rows(
    call: Call[LossPlan],
    source: LogitsSource,
    chunks: Sequence[RowRange],
    dtype: torch.dtype,
    saved: Sequence[RowStats] | None = None,
    target: GradTarget | None = None,
    steps: ChunkStats | None = None,
) -> list[RowStats]:
    """Walk ``chunks`` in order: each chunk's row statistics (computed, or ``saved[i]`` for
    ``chunks[i]``), with ``target`` its logit gradients written. Returns the statistics in chunk
    order. ``dtype``: the statistics dtype. A chunk's logits live only while it is walked.
    ``steps``: a chunk's statistics and gradients computed by another walk of its blocks (a teacher
    mixture's), never saved: it recomputes them where a deferred backward reads them."""
    like, math = torch.empty(0, dtype=dtype, device=call.labels.device), call.math
    assert math is not None  # a walk runs on a chunked backend, never the reference's
    # Real columns only: vocabulary padding is never part of a block.
    columns = call.layout.real_local_columns
    # The kernels tile a chunk's whole local vocabulary; the torch backend's temporaries are per block.
    block = max(columns, 1) if math.whole_blocks else call.plan.config.vocab_block
    column_ranges = [(start, min(start + block, columns)) for start in range(0, columns, block)]
    walked = []
    for index, (begin, end) in enumerate(chunks):
        blocks = source.blocks(begin, end, column_ranges, dtype, math.reads_stored_cache)
        labels, chunk_target = call.labels[begin:end], None if target is None else (target, begin, end)
        if steps is not None:
            stats = steps(call, blocks, labels, like, chunk_target, (begin, end))
        elif saved is None:
            stats = chunk_row_stats(call, blocks, labels, like, chunk_target)
        else:
            stats = saved[index]
            if chunk_target is not None:
                stage_grads(call, blocks, labels, stats.gradient_inputs(), chunk_target, like)
        walked.append(stats)
        del blocks  # a chunk's logits go before the next chunk's are formed
    return walked


def chunk_row_stats(
    call: Call[LossPlan], blocks: Sequence[LogitsBlock], labels: Tensor, like: Tensor, target: ChunkTarget | None = None
) -> RowStats:
    """Round 1 (and, with a KL term or the entropy, round 2) of a chunk from its column blocks (no
    blocks: this device holds only vocabulary padding), and with ``target`` the chunk's logit gradients.
    ``labels``: the chunk's (rows,) labels; ``like``: any tensor of the statistics dtype and device."""
    plan, math, exchange = call.plan, call.math, call.exchange
    assert math is not None
    vocab_start, families = call.layout.vocab_start, plan.families
    sums, caps = plan.column_sums, (plan.student_softcap, plan.teacher_softcap)
    records = [
        math.partition(b.student, b.teacher, labels, vocab_start + b.start, families, sums, caps) for b in blocks
    ]
    if not records:  # this device holds only vocabulary padding
        records = [empty_record(labels.shape[0], len(families), len(sums), like)]
    record = records[0] if len(records) == 1 else math.merge_stacked(torch.stack(records), len(families))
    if exchange is not None:
        # Every rank merges the same gathered stack with the same ops: the record is bitwise the same on each.
        record = exchange.merge_partitions(record, len(families), math.merge_stacked)
    step = partition_step(plan.step_key)
    inputs = dict(zip(step.inputs, record.unbind(1)))  # the step reads the record's columns by name
    scalars = {"t_s": plan.student_temperature, "t_t": plan.teacher_temperature, **plan.term_scalars}
    partition = math.rows(step, inputs, scalars, like)
    outputs = dict(zip(step.outputs, partition.unbind(1)))
    num_families = plan.step_key.num_families
    statistics = {**{f"lse{f}": partition[:, f] for f in range(num_families)}, **outputs}
    kl, kl_stats, kl_sums, entropy = outputs.get("kl"), None, None, outputs["student_entropy"]
    in_gradient_pass = target is not None and plan.kl_sums_in_gradient_pass
    if in_gradient_pass:
        # Round 2 summed by the gradient pass, one read of the logits fewer: the gradient reads
        # the KL's keep from round 1 (present), which is the finish step's where D cannot be +inf.
        assert target is not None
        # −0.0, the identity of addition: the first block's sums are added exactly as they come.
        kl_sums = like.new_full((labels.shape[0], len(plan.round_two_terms)), -0.0)
        stage_grads(call, blocks, labels, {**statistics, "keep": outputs["present"]}, target, like, kl_sums)
    if plan.round_two_terms:
        kl, kl_stats, entropy = kl_round(call, blocks, labels, outputs, like, kl_sums)
    if kl_stats is not None:
        statistics.update(keep=kl_stats.keep, **kl_stats.consts)
    if target is not None and not in_gradient_pass:
        # After round 2, where there is one: the gradient reads the finish step's keep and the variant's constants.
        stage_grads(call, blocks, labels, statistics, target, like)
    assert kl is not None
    return RowStats(
        log_partitions=partition[:, :num_families],
        owned=outputs["owned"],
        absent=outputs.get("absent"),
        student_terms={term.name: outputs[term.name] for term in STUDENT_TERMS},
        teacher_ce=outputs["teacher_ce"],
        kl=kl,
        student_entropy=entropy,
        kl_stats=kl_stats,
    )


def kl_round(
    call: Call[LossPlan],
    blocks: Sequence[LogitsBlock],
    labels: Tensor,
    partition: dict[str, Tensor],
    like: Tensor,
    local_sums: Tensor | None = None,
) -> tuple[Tensor, KLRowStats | None, Tensor]:
    """Round 2 (the sums of ``plan.round_two_terms``) and, with a KL term, the finish step, from the
    partition step's outputs ``partition``: the rows' KL component ``T_s²·max(D, 0)`` (the
    partition's without a KL term), the KL term's statistics (None without one) and the student's
    entropy (the partition's 0/NaN, plus the last sum where it is reported); ``local_sums``: this
    device's round-2 sums, when the gradient pass summed them."""
    plan, math = call.plan, call.math
    assert math is not None
    lse_u = partition["lse_u"]
    # Without a KL term no term reads the teacher (nor LSE(v): lse_u stands in), even where the blocks hold it.
    lse_v, with_teacher = partition.get("lse_v", lse_u), plan.computes_kl
    vocab_start = call.layout.vocab_start
    sums = local_sums
    if sums is None:
        partial_sums = [
            math.kl_sums(
                plan, b.student, b.teacher if with_teacher else None, labels, vocab_start + b.start, lse_u, lse_v
            )
            for b in blocks
        ]
        sums = partial_sums[0] if partial_sums else like.new_zeros(labels.shape[0], len(plan.round_two_terms))
        for partial in partial_sums[1:]:  # block after block, in column order: the same bits every run
            sums = sums + partial
    if call.exchange is not None:
        sums = call.exchange.sum_over_shards(sums)  # every column, the entropy's too: sums over the vocabulary
    # H(p) = Σ −p·log p: the last column where reported, added to the partition's 0 (NaN on unowned rows).
    entropy = partition["student_entropy"] + sums[:, -1] if plan.student_entropy else partition["student_entropy"]
    divergence = plan.divergence
    if not plan.computes_kl or divergence is None:
        return partition["kl"], None, entropy
    targets = RowTargets(logp_y=partition["logp_y"], logq_y=partition["logq_y"])
    # The variant's own sums, the first num_sums columns: the entropy's, after them, is not its input.
    finalized = divergence.finalize(sums[:, : divergence.num_sums], targets, plan.params)
    finish = finish_step()
    values = {"value": finalized.value, "absent": partition["absent"], "owned": partition["owned"]}
    finished = math.rows(finish, values, {"t_s_squared": plan.student_temperature**2}, like)
    outputs = dict(zip(finish.outputs, finished.unbind(1)))
    kl_stats = KLRowStats(
        lse_u=lse_u,
        lse_v=lse_v,
        logp_y=targets.logp_y,
        logq_y=targets.logq_y,
        divergence=outputs["divergence"],
        keep=outputs["keep"],
        consts=finalized.consts,
    )
    return outputs["kl"], kl_stats, entropy


def stage_grads(
    call: Call[LossPlan],
    blocks: Sequence[LogitsBlock],
    labels: Tensor,
    statistics: Mapping[str, Tensor],
    target: ChunkTarget,
    like: Tensor,
    sums_out: Tensor | None = None,
    accumulate: bool = False,
) -> None:
    """The chunk's gradient row constants (``row_formulas.grad_step`` of its named row
    ``statistics``) and each block's logit gradients written (``accumulate``: added) into the
    target's rows ``[begin, end)``; with ``sums_out`` (``kl_sums_in_gradient_pass``) the blocks'
    round-2 sums added into it, (rows, num_sums)."""
    plan, math = call.plan, call.math
    assert math is not None
    grad_target, begin, end = target
    program = grad_step(plan.step_key)
    values = {name: statistics[name] for name in program.inputs if name not in ("upstream", "valid")}
    upstream = grad_target.upstream
    # A 0-d upstream gradient as a stride-0 view: broadcast to the rows without a copy.
    values["upstream"] = upstream[begin:end] if upstream.dim() else upstream.expand(end - begin)
    values["valid"] = call.valid[begin:end]
    weights = {f"w_{term.name}": weight for term, weight in zip(plan.student_terms, plan.term_weights)}
    scalars = {"w_t": plan.teacher_ce_weight, **weights, **plan.term_scalars}
    packed = math.rows(program, values, scalars, like)
    columns = dict(zip(program.outputs, packed.unbind(1)))
    constants: dict[str, Any] = {name: columns.get(name) for name in GRAD_ROW_CONSTANTS}
    consts = {name: columns[name] for name in plan.step_key.variant_constants}
    rows = GradRows(**constants, consts=consts, packed=packed, names=program.outputs)
    first, last, grads = begin - grad_target.first_row, end - grad_target.first_row, grad_target.grads
    for block in blocks:
        span = slice(block.start, block.stop)
        teacher = None if grads.teacher is None else grads.teacher[first:last, span]
        out = LogitGrads(grads.student[first:last, span], teacher)
        global_start = call.layout.vocab_start + block.start
        math.stage_logit_grads(
            plan, rows, block.student, block.teacher, labels, global_start, out, sums_out, accumulate
        )
