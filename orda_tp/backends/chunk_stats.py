"""Forward statistics of one row chunk: merge the column blocks' records, finalize each row.

Round 1 gives the log-partitions of every logit family and the label logits; round 2 the
variant's sums over normalized ``log p``, ``log q``. Both rounds go through the exchange, so the
same code runs on one device and on a vocabulary shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..divergences import BlockTerms, RowTargets
from ..exchange import RecordExchange
from ..plan import LossPlan
from ..statistics import LogitFamily, PartitionRecord, merge_partition_records, sum_records

if TYPE_CHECKING:
    from .block_math import BlockMath

__all__ = ["RowStats", "chunk_row_stats", "kl_block_terms"]

NEG_INF = float("-inf")


@dataclass(frozen=True)
class RowStats:
    """Finalized per-row statistics of a chunk: everything the gradient needs besides logits.

    ``log_partitions``: (rows, F) LSE per family in ``plan.families`` order; ``label_owned``: rows
    whose label exactly one column owns (the others are ignored rows or hold an invalid label, and
    come out NaN); ``teacher_absent``: rows whose teacher logits are all −inf (they contribute 0;
    None without teacher logits); with a KL term, ``kl_log_partitions``: ``LSE(u)`` and ``LSE(v)``
    (0 on absent rows, whose ``log q`` is −inf), ``keep_kl_grad``: rows whose KL gradient is kept
    (teacher present, KL not +inf), ``kl_consts``: the variant's row constants;
    ``student_ce``/``teacher_ce``/``kl``: per-row component values (kl includes T_s²).
    """

    log_partitions: Tensor
    label_owned: Tensor
    teacher_absent: Tensor | None
    kl_log_partitions: tuple[Tensor, Tensor] | None
    keep_kl_grad: Tensor | None
    kl_consts: dict[str, Tensor]
    student_ce: Tensor
    teacher_ce: Tensor
    kl: Tensor

    def lse(self, plan: LossPlan, family: LogitFamily) -> Tensor:
        return self.log_partitions[:, plan.families.index(family)]

    def teacher_ce_terms(self, plan: LossPlan, row_scale: Tensor) -> tuple[Tensor, Tensor]:
        """``(LSE(t), w_t·scale)`` of the teacher's CE gradient, both 0 on absent teacher rows
        (whose softmax would read −inf − (−inf))."""
        assert self.teacher_absent is not None
        lse_t = torch.where(self.teacher_absent, 0.0, self.lse(plan, plan.ce_teacher_family))
        return lse_t, torch.where(self.teacher_absent, 0.0, plan.teacher_ce_weight * row_scale)


def _untempered(logits: Tensor, temperature: float) -> Tensor:
    return logits if temperature == 1.0 else logits / temperature


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
    blocks: list[tuple[int, Tensor, Tensor | None]],
    labels: Tensor,
    exchange: RecordExchange,
    math: BlockMath,
    like: Tensor,
) -> RowStats:
    """Row statistics of a chunk from its column blocks ``(global_col_start, student, teacher)``
    (no blocks: this device holds only vocabulary padding); ``like``: any tensor of the
    statistics dtype and device."""
    families = plan.families
    records = [math.partition(student, teacher, labels, start, families) for start, student, teacher in blocks]
    if not records:
        records = [PartitionRecord.empty(labels.shape[0], len(families), like)]
    record = exchange.merge_partitions(merge_partition_records(records))
    log_partitions = record.log_partitions()
    teacher_index = next((i for i, family in enumerate(families) if family.side == "teacher"), None)
    teacher_absent = None if teacher_index is None else record.maxes[:, teacher_index] == NEG_INF
    student_y, teacher_y = record.target_logits[:, 0], record.target_logits[:, 1]
    label_owned = record.label_hits == 1
    # 0 on rows whose label one column owns, NaN on the others: added to every component.
    nan_elsewhere = torch.where(label_owned, 0.0, float("nan")).to(like.dtype)

    def lse(family: LogitFamily) -> Tensor:
        return log_partitions[:, families.index(family)]

    student_ce = teacher_ce = kl = nan_elsewhere  # a term whose weight is 0 reads 0 (NaN elsewhere)
    if plan.student_ce_weight > 0:
        student_ce = lse(plan.ce_student_family) - student_y + nan_elsewhere
    if plan.teacher_ce_weight > 0:
        assert teacher_absent is not None
        teacher_ce = torch.where(teacher_absent, 0.0, lse(plan.ce_teacher_family) - teacher_y) + nan_elsewhere

    kl_log_partitions, keep_kl_grad, consts = None, None, {}
    if plan.computes_kl:
        divergence = plan.divergence
        assert divergence is not None and teacher_absent is not None
        lse_u = lse(plan.kl_student_family)
        lse_v = torch.where(teacher_absent, 0.0, lse(plan.kl_teacher_family))
        kl_log_partitions = (lse_u, lse_v)
        partial_sums = [
            math.kl_sums(plan, student, teacher, labels, start, lse_u, lse_v)
            for start, student, teacher in blocks
            if teacher is not None
        ]
        if not partial_sums:
            partial_sums = [like.new_zeros(labels.shape[0], divergence.num_sums)]
        sums = exchange.sum_over_shards(sum_records(partial_sums))
        targets = RowTargets(
            logp_y=_untempered(student_y, plan.student_temperature) - lse_u,
            logq_y=_untempered(teacher_y, plan.teacher_temperature) - lse_v,
        )
        finalized = divergence.finalize(sums, targets, plan.params)
        value = torch.where(teacher_absent, 0.0, finalized.value.clamp_min(0.0))
        kl = (value if plan.student_temperature == 1.0 else plan.student_temperature**2 * value) + nan_elsewhere
        keep_kl_grad = ~(teacher_absent | torch.isposinf(value))
        consts = finalized.consts

    return RowStats(
        log_partitions=log_partitions,
        label_owned=label_owned,
        teacher_absent=teacher_absent,
        kl_log_partitions=kl_log_partitions,
        keep_kl_grad=keep_kl_grad,
        kl_consts=consts,
        student_ce=student_ce,
        teacher_ce=teacher_ce,
        kl=kl,
    )
