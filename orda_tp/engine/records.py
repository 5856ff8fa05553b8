"""Per-row statistics records of a block of columns, and their associative merge.

A block (a column range of one device's vocabulary, or one tensor-parallel shard) never sees the
whole row. It reports a record; records merge in any grouping, and the merged record is what the
whole row would have given.

Round 1 (:class:`PartitionRecord`) holds, for each *logit family* (a side scaled by a
temperature, e.g. ``u = s/T_s``), the partial log-partition ``(m, z)`` with ``m = max x`` and
``z = Σ e^{x−m}``; merge: ``M = max(m1, m2)``, ``z = z1·e^{m1−M} + z2·e^{m2−M}``. It also holds
the raw student and teacher logits at the label column (only the owning block contributes, merge
by sum) and how many blocks owned the label (a row whose label no block owns comes out NaN).

Round 2 sums (of the variant's column terms) merge by plain addition.

Records pack into one (rows, K) tensor so that a tensor-parallel exchange is one collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor

from ..arguments.plan import LogitFamily

__all__ = [
    "PartitionRecord",
    "block_partition_record",
    "merge_partition_records",
    "merge_stacked_partition_records",
]


@dataclass(frozen=True)
class PartitionRecord:
    """Round-1 record of a block for a chunk of rows.

    ``maxes``/``sumexps``: (rows, F) partial log-partitions of the F families;
    ``target_logits``: (rows, 2) raw student and teacher logits at the label (0 if not owned);
    ``label_hits``: (rows,) number of blocks that own the label column; ``column_sums``:
    (rows, E) the sums of the student terms' column terms (:attr:`orda_tp.arguments.plan.LossPlan.column_sums`).
    """

    maxes: Tensor
    sumexps: Tensor
    target_logits: Tensor
    label_hits: Tensor
    column_sums: Tensor

    @staticmethod
    @cache
    def packed_columns(num_families: int, num_column_sums: int) -> tuple[str, ...]:
        """The names of the packed layout's columns, in order; a packed record is as wide as
        their number, ``2F + 3 + E``: ``m<f>`` for each of the F families, then ``z<f>``, the
        label columns ``s_y``, ``t_y``, ``hits``, and ``sum<k>`` for each of the E column sums.
        Built once per (F, E)."""
        families, sums = range(num_families), range(num_column_sums)
        labels = ("s_y", "t_y", "hits")
        return (*(f"m{f}" for f in families), *(f"z{f}" for f in families), *labels, *(f"sum{k}" for k in sums))

    def pack(self) -> Tensor:
        """The (rows, width) tensor of the :meth:`packed_columns` layout, exchanged between ranks."""
        columns = [self.maxes, self.sumexps, self.target_logits, self.label_hits[:, None], self.column_sums]
        return torch.cat(columns, dim=1)

    @staticmethod
    def empty(rows: int, num_families: int, num_column_sums: int, like: Tensor) -> PartitionRecord:
        """The record of no columns (a shard that holds only vocabulary padding)."""
        zeros = like.new_zeros(rows, num_families)
        return PartitionRecord(
            torch.full_like(zeros, float("-inf")),
            zeros,
            like.new_zeros(rows, 2),
            like.new_zeros(rows),
            like.new_zeros(rows, num_column_sums),
        )

    @staticmethod
    def unpack(packed: Tensor, num_families: int) -> PartitionRecord:
        """The record of a packed (rows, width) tensor (E read from its width)."""
        f = num_families
        hits = 2 * f + 2
        return PartitionRecord(
            packed[:, :f], packed[:, f : 2 * f], packed[:, 2 * f : hits], packed[:, hits], packed[:, hits + 1 :]
        )

    def log_partitions(self) -> Tensor:
        """(rows, F) ``LSE = m + log z`` of the merged record (−inf for an all −inf row)."""
        finite_max = torch.where(self.maxes == float("-inf"), 0.0, self.maxes)
        return finite_max + torch.log(self.sumexps)


def _rescaled(sumexp: Tensor, local_max: Tensor, new_max: Tensor) -> Tensor:
    """``z·e^{m − M}``, with an empty partial (m = −inf) contributing 0 (NaN still propagates)."""
    empty = local_max == float("-inf")
    return torch.where(empty, 0.0, sumexp * torch.exp(local_max - new_max))


def merge_partition_records(records: Sequence[PartitionRecord]) -> PartitionRecord:
    """Merge records of the same rows (column blocks, shards), through their packed layout."""
    if len(records) == 1:
        return records[0]
    families = records[0].maxes.shape[1]
    return merge_stacked_partition_records(torch.stack([record.pack() for record in records]), families)


def merge_stacked_partition_records(stacked: Tensor, num_families: int) -> PartitionRecord:
    """Merge S packed records stacked as (S, rows, width) at once: every partial is rescaled to the
    overall max and summed, in a handful of tensor ops (deterministic for a given stack, so ranks
    that merge the same gathered stack get bitwise-identical records)."""
    f = num_families
    maxes, sumexps, rest = stacked[..., :f], stacked[..., f : 2 * f], stacked[..., 2 * f :]
    new_max = maxes.amax(dim=0)
    return PartitionRecord(
        maxes=new_max,
        sumexps=_rescaled(sumexps, maxes, new_max.unsqueeze(0)).sum(dim=0),
        target_logits=rest[..., :2].sum(dim=0),
        label_hits=rest[..., 2].sum(dim=0),
        column_sums=rest[..., 3:].sum(dim=0),
    )


def block_partition_record(
    student: Tensor,
    teacher: Tensor | None,
    labels: Tensor,
    col_start: int,
    families: Sequence[LogitFamily],
    column_sums: Tensor | None = None,
) -> PartitionRecord:
    """Round-1 record of a block whose columns start at global column ``col_start``, with torch ops
    (the torch backend's, and the kernels' when no family is asked for); ``column_sums``: the
    block's (rows, E) column sums, formed by the caller (none by default).

    ``student``/``teacher``: (rows, cols) raw logits in the statistics dtype; ``labels``: (rows,)
    global label ids of valid rows. Per family ``x = logits/T``: ``(max x, Σ e^{x − max x})``, an
    all −inf row giving (−inf, 0); the logits at the label column for rows whose label lies in the
    block, else 0.
    """
    sides = {"student": student, "teacher": teacher}
    maxes, sumexps = [], []
    for family in families:
        logits = sides[family.side]
        assert logits is not None, f"family {family} needs {family.side} logits"
        x = logits if family.temperature == 1.0 else logits / family.temperature
        row_max = x.amax(dim=1)
        shift = torch.where(row_max == float("-inf"), 0.0, row_max)
        maxes.append(row_max)
        sumexps.append(torch.exp(x - shift[:, None]).sum(dim=1))
    local_labels = labels - col_start
    owned = (local_labels >= 0) & (local_labels < student.shape[1])
    index = torch.where(owned, local_labels, 0)[:, None]
    target_student = torch.where(owned, student.gather(1, index).squeeze(1), 0.0)
    if teacher is None:
        target_teacher = torch.zeros_like(target_student)
    else:
        target_teacher = torch.where(owned, teacher.gather(1, index).squeeze(1), 0.0)
    empty = student.new_zeros(student.shape[0], 0)
    return PartitionRecord(
        maxes=torch.stack(maxes, dim=1) if maxes else empty,
        sumexps=torch.stack(sumexps, dim=1) if sumexps else empty,
        target_logits=torch.stack([target_student, target_teacher], dim=1),
        label_hits=owned.to(student.dtype),
        column_sums=empty if column_sums is None else column_sums,
    )
