"""Forward statistics of one row chunk: merge the column blocks' records, finalize each row.

Round 1 gives the log-partitions of every logit family and the label logits; round 2 the
variant's sums over normalized ``log p``, ``log q``. Both rounds go through the exchange, so the
same code runs on one device and on a vocabulary shard. Each round ends in a row step of
:mod:`.row_formulas` (one launch on the Triton backend).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..divergences import BlockTerms, RowTargets
from ..exchange import RecordExchange
from ..plan import LossPlan
from ..records import PartitionRecord, merge_partition_records, sum_records
from .row_formulas import (
    StepKey,
    finish_step,
    grad_row_names,
    grad_step,
    partition_scalars,
    partition_step,
)

if TYPE_CHECKING:
    from .block_math import BlockMath

__all__ = ["RowStats", "chunk_row_stats", "grad_row_constants", "kl_block_terms"]


@dataclass(frozen=True)
class RowStats:
    """Per-row statistics of a chunk: everything the gradient needs besides logits.

    ``partition``: (rows, K) outputs of the round-1 step (:func:`row_formulas.partition_step`:
    the families' log-partitions first, then the CE values and the KL's row inputs);
    ``finish``: (rows, 3) ``divergence``, ``kl``, ``keep`` of :func:`row_formulas.finish_step` (None without a
    KL term); ``kl_consts``: the variant's finalize constants. ``student_ce``/``teacher_ce``/``kl``
    are the per-row component values (kl includes T_s²; NaN on rows whose label no column owns).
    """

    key: StepKey
    partition: Tensor
    finish: Tensor | None
    kl_consts: dict[str, Tensor]

    def value(self, name: str) -> Tensor:
        """The (rows,) statistic ``name``: a step output or a variant constant (a view)."""
        if name in self.kl_consts:
            return self.kl_consts[name]
        if self.finish is not None and name in finish_step().outputs:
            return self.finish[:, finish_step().index(name)]
        return self.partition[:, partition_step(self.key).index(name)]

    @property
    def log_partitions(self) -> Tensor:
        """(rows, F) ``LSE`` per family in ``plan.families`` order."""
        return self.partition[:, : self.key.num_families]

    @property
    def student_ce(self) -> Tensor:
        return self.value("student_ce")

    @property
    def teacher_ce(self) -> Tensor:
        return self.value("teacher_ce")

    @property
    def kl(self) -> Tensor:
        return self.value("kl")


def grad_row_constants(
    plan: LossPlan, stats: RowStats, upstream_scale: Tensor, valid: Tensor, math: BlockMath, like: Tensor
) -> tuple[Tensor, tuple[str, ...]]:
    """The gradient pass's row constants of a chunk, (rows, len(names)), and their ``names``
    (:func:`row_formulas.grad_step`). ``upstream_scale``: 0-d or the chunk's (rows,) upstream
    gradient (÷ N for "mean"); ``valid``: the chunk's (rows,) valid-row mask."""
    names = grad_row_names(plan)
    program = grad_step(stats.key, names)
    rows = valid.shape[0]
    values = {name: stats.value(name) for name in program.inputs if name not in ("upstream", "valid")}
    values["upstream"] = upstream_scale.expand(rows) if upstream_scale.dim() == 0 else upstream_scale
    values["valid"] = valid
    return math.rows(program, values, {"w_t": plan.teacher_ce_weight}, like), names


def kl_block_terms(
    plan: LossPlan,
    student: Tensor,
    teacher: Tensor,
    lse_u: Tensor,
    lse_v: Tensor,
    local_labels: Tensor | None,
) -> BlockTerms:
    """Normalized ``log p``, ``log q``, ``p``, ``q`` of a block (and the label mask for dkd)."""
    logp = student / plan.student_temperature - lse_u[:, None]
    logq = teacher / plan.teacher_temperature - lse_v[:, None]
    is_target = None
    if local_labels is not None:
        columns = torch.arange(student.shape[1], device=student.device)
        is_target = columns[None, :] == local_labels[:, None]
    return BlockTerms(logp=logp, logq=logq, p=torch.exp(logp), q=torch.exp(logq), is_target=is_target)


def chunk_row_stats(
    plan: LossPlan,
    blocks: Sequence[tuple[int, Tensor, Tensor | None]],
    labels: Tensor,
    exchange: RecordExchange,
    math: BlockMath,
    like: Tensor,
) -> RowStats:
    """Row statistics of a chunk from its column blocks ``(global_col_start, student, teacher)``
    (no blocks: this device holds only vocabulary padding); ``like``: any tensor of the
    statistics dtype and device."""
    families = plan.families
    key = StepKey.of(plan)
    records = [math.partition(student, teacher, labels, start, families) for start, student, teacher in blocks]
    if not records:
        records = [PartitionRecord.empty(labels.shape[0], len(families), like)]
    record = exchange.merge_partitions(merge_partition_records(records), math.merge_stacked)
    step = partition_step(key)
    names = iter(step.inputs)
    columns = [record.maxes, record.sumexps, record.target_logits, record.label_hits[:, None]]
    record_values = {next(names): column[:, j] for column in columns for j in range(column.shape[1])}
    partition = math.rows(step, record_values, partition_scalars(plan), like)
    stats = RowStats(key, partition, None, {})
    if not plan.computes_kl:
        return stats

    divergence = plan.divergence
    assert divergence is not None
    lse_u, lse_v = stats.value("lse_u"), stats.value("lse_v")
    partial_sums = [
        math.kl_sums(plan, student, teacher, labels, start, lse_u, lse_v)
        for start, student, teacher in blocks
        if teacher is not None
    ]
    if not partial_sums:
        partial_sums = [like.new_zeros(labels.shape[0], divergence.num_sums)]
    sums = exchange.sum_over_shards(sum_records(partial_sums))
    targets = RowTargets(logp_y=stats.value("logp_y"), logq_y=stats.value("logq_y"))
    finalized = divergence.finalize(sums, targets, plan.params)
    finish_values = {"value": finalized.value, "absent": stats.value("absent"), "owned": stats.value("owned")}
    finish = math.rows(finish_step(), finish_values, {"t_s_squared": plan.student_temperature**2}, like)
    return RowStats(key, partition, finish, finalized.consts)
