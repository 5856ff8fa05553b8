"""Round-1 records: per row, a block's partial log-partitions ``(m, z)``, label logits, label
owners and column sums, packed in one (rows, K₁) tensor, and their associative merge; a merged
record is what the whole row would have given (docs/architecture.md, "Round 1").
"""

from __future__ import annotations

from functools import cache

import torch
from torch import Tensor

__all__ = ["empty_record", "merge_stacked_records", "packed_columns"]


@cache
def packed_columns(num_families: int, num_column_sums: int) -> tuple[str, ...]:
    """The names of a packed record's ``2F + 3 + E`` columns, in order: ``m<f>`` for each of the
    F families, then ``z<f>``, the label columns ``s_y``, ``t_y``, ``hits``, and ``sum<k>`` for
    each of the E column sums."""
    families, sums = range(num_families), range(num_column_sums)
    labels = ("s_y", "t_y", "hits")
    return (*(f"m{f}" for f in families), *(f"z{f}" for f in families), *labels, *(f"sum{k}" for k in sums))


def empty_record(rows: int, num_families: int, num_column_sums: int, like: Tensor) -> Tensor:
    """The record of no columns (a shard that holds only vocabulary padding): ``m = −inf``, every
    other column 0."""
    record = like.new_zeros(rows, len(packed_columns(num_families, num_column_sums)))
    # (m, z) = (−inf, 0), the merge's identity: the shard adds nothing to any family.
    record[:, :num_families] = float("-inf")
    return record


def merge_stacked_records(stacked: Tensor, num_families: int) -> Tensor:
    """Merge S packed records stacked as (S, rows, K₁) at once: ``M = max_i m_i``,
    ``z = Σ_i z_i·e^{m_i − M}``, every other column summed (deterministic for a given stack, so
    ranks that merge the same gathered stack get bitwise-identical records)."""
    f = num_families
    maxes, sumexps, rest = stacked[..., :f], stacked[..., f : 2 * f], stacked[..., 2 * f :]
    # Every partial rescaled to the overall max at once, then summed along the stack in one op.
    new_max = maxes.amax(dim=0)
    # An empty partial (m = −inf) adds 0; e^{−inf − (−inf)} would be NaN (a NaN input still propagates).
    rescaled = torch.where(maxes == float("-inf"), 0.0, sumexps * torch.exp(maxes - new_max.unsqueeze(0)))
    return torch.cat([new_max, rescaled.sum(dim=0), rest.sum(dim=0)], dim=1)
