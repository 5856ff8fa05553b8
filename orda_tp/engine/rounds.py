"""A row chunk's statistics rounds and row steps, from its column blocks.

Round 1 merges the blocks' records (per logit family the partial log-partition ``(m, z)``, the
label logits ``s_y``, ``t_y`` and the label-owner count) and the partition step turns the merged
record into log-partitions, CE values and the KL's row inputs. Round 2 (KL only) sums the
variant's column terms over normalized ``log p = u − LSE(u)``, ``log q = v − LSE(v)``; the
variant's finalize and the finish step turn the sums into the row's divergence. Both rounds go
through the exchange, so the same code runs on one device and on a vocabulary shard. Before a
gradient pass, the grad step turns the row statistics into the gradient's row constants. Each
row step is one program of :mod:`.row_formulas` (one launch on the Triton backend), whose
result is unpacked here, once, into named fields (:mod:`.stats`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor

from ..divergences import RowTargets
from ..exchange import RecordExchange
from ..plan import LossPlan
from ..records import PartitionRecord, merge_partition_records, sum_records
from .block_math import BlockMath
from .logits import LogitsBlock
from .row_formulas import (
    StepKey,
    divergence_row_names,
    finish_step,
    grad_row_names,
    grad_step,
    partition_inputs,
    partition_scalars,
    partition_step,
)
from .stats import GradRows, KLRowStats, RowStats

__all__ = ["chunk_row_stats", "grad_rows"]


def chunk_row_stats(
    plan: LossPlan,
    blocks: Sequence[LogitsBlock],
    vocab_start: int,
    labels: Tensor,
    exchange: RecordExchange,
    math: BlockMath,
    like: Tensor,
) -> RowStats:
    """Row statistics of a chunk from its column blocks (local columns; ``vocab_start`` is the
    global id of local column 0; no blocks: this device holds only vocabulary padding).
    ``labels``: the chunk's (rows,) labels; ``like``: any tensor of the statistics dtype and
    device."""
    families = plan.families
    records = [
        math.partition(block.student, block.teacher, labels, vocab_start + block.start, families) for block in blocks
    ]
    if not records:
        records = [PartitionRecord.empty(labels.shape[0], len(families), like)]
    record = exchange.merge_partitions(merge_partition_records(records), math.merge_stacked)
    key = StepKey.of(plan)
    step = partition_step(key)
    partition = math.rows(step, partition_inputs(record), partition_scalars(plan), like)
    outputs = step.columns(partition)
    kl, kl_stats = outputs.get("kl"), None
    if plan.computes_kl:
        kl, kl_stats = _kl_round(plan, blocks, vocab_start, labels, outputs, exchange, math, like)
    assert kl is not None
    return RowStats(
        log_partitions=partition[:, : key.num_families],
        owned=outputs["owned"],
        absent=outputs.get("absent"),
        student_ce=outputs["student_ce"],
        teacher_ce=outputs["teacher_ce"],
        kl=kl,
        kl_stats=kl_stats,
    )


def _kl_round(
    plan: LossPlan,
    blocks: Sequence[LogitsBlock],
    vocab_start: int,
    labels: Tensor,
    partition: Mapping[str, Tensor],
    exchange: RecordExchange,
    math: BlockMath,
    like: Tensor,
) -> tuple[Tensor, KLRowStats]:
    """Round 2 and the finish step, from the partition step's outputs ``partition``: the rows'
    KL component ``T_s²·max(D, 0)`` and the KL term's statistics."""
    divergence = plan.divergence
    assert divergence is not None
    lse_u, lse_v = partition["lse_u"], partition["lse_v"]
    partial_sums = [
        math.kl_sums(plan, block.student, block.teacher, labels, vocab_start + block.start, lse_u, lse_v)
        for block in blocks
        if block.teacher is not None
    ]
    if not partial_sums:
        partial_sums = [like.new_zeros(labels.shape[0], divergence.num_sums)]
    sums = exchange.sum_over_shards(sum_records(partial_sums))
    targets = RowTargets(logp_y=partition["logp_y"], logq_y=partition["logq_y"])
    finalized = divergence.finalize(sums, targets, plan.params)
    finish = finish_step()
    values = {"value": finalized.value, "absent": partition["absent"], "owned": partition["owned"]}
    finished = finish.columns(math.rows(finish, values, {"t_s_squared": plan.student_temperature**2}, like))
    kl_stats = KLRowStats(
        lse_u=lse_u,
        lse_v=lse_v,
        logp_y=targets.logp_y,
        logq_y=targets.logq_y,
        divergence=finished["divergence"],
        keep=finished["keep"],
        consts=finalized.consts,
    )
    return finished["kl"], kl_stats


def _grad_step_inputs(stats: RowStats) -> dict[str, Tensor]:
    """The row statistics under the names the grad step reads (:func:`.row_formulas.grad_step`)."""
    inputs = {f"lse{f}": stats.log_partitions[:, f] for f in range(stats.log_partitions.shape[1])}
    inputs["owned"] = stats.owned
    if stats.absent is not None:
        inputs["absent"] = stats.absent
    kl = stats.kl_stats
    if kl is not None:
        inputs.update(lse_u=kl.lse_u, lse_v=kl.lse_v, keep=kl.keep)
        inputs.update(kl.consts)
    return inputs


def grad_rows(
    plan: LossPlan, stats: RowStats, upstream_scale: Tensor, valid: Tensor, math: BlockMath, like: Tensor
) -> GradRows:
    """The gradient's row constants of a chunk. ``upstream_scale``: 0-d or the chunk's (rows,)
    upstream gradient (÷ N for "mean"); ``valid``: the chunk's (rows,) valid-row mask."""
    program = grad_step(StepKey.of(plan), grad_row_names(plan))
    statistics = _grad_step_inputs(stats)
    rows = valid.shape[0]
    values = {name: statistics[name] for name in program.inputs if name not in ("upstream", "valid")}
    values["upstream"] = upstream_scale.expand(rows) if upstream_scale.dim() == 0 else upstream_scale
    values["valid"] = valid
    packed = math.rows(program, values, {"w_t": plan.teacher_ce_weight}, like)
    consts = divergence_row_names(plan.divergence, plan.params) if plan.computes_kl else ()
    return GradRows.unpack(program, packed, consts)
