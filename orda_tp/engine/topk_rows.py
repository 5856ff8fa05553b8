"""The k largest scaled logits of each row and its log-partition, merged block by block, in a total
order on (value, column): largest value first, the lowest column among equal values (``−0.0`` as
``+0.0``), so the result is the same however the columns were split (docs/architecture.md, "The
top-k extraction").
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["KERNEL_MAX_K", "UNSEEN", "TopKRows", "block_topk", "decode_keys", "merge_topk"]

#: The id of an entry that stands for no column (a row with fewer than ``k`` columns).
UNSEEN = -1
#: The largest ``k`` the Triton kernel extracts (``TritonBlockMath.topk``); "auto" takes the torch
#: backend above it.
KERNEL_MAX_K = 256
_LAST_ID = torch.iinfo(torch.int64).max  # UNSEEN's place in the column order: after every column
_LOW_WORD = 0xFFFFFFFF


class TopKRows(NamedTuple):
    """Rows' best ``k`` candidates so far: ``values`` (rows, k) scaled logits, largest first;
    ``ids`` (rows, k) int64 global columns (:data:`UNSEEN` where none); ``log_sum`` (rows,)
    ``log Σ_j e^{t_j − values[:, 0]}`` over the scaled logits ``t`` of the columns seen."""

    values: Tensor
    ids: Tensor
    log_sum: Tensor

    @property
    def log_partition(self) -> Tensor:
        """``LSE_j t_j`` of the columns seen."""
        return self.values[:, 0] + self.log_sum


def merge_topk(parts: list[TopKRows], k: int) -> TopKRows:
    """The best ``k`` of the candidates of ``parts`` (disjoint columns of the same rows), in the
    module's order, and their log-partitions combined: ``log_sum = LSE_p (m_p − m + log_sum_p)``
    with ``m = max_p m_p`` the merged best value."""
    values = torch.cat([part.values for part in parts], dim=1)
    ids = torch.cat([part.ids for part in parts], dim=1)
    # Two stable sorts, by column then by value: equal values end up in column order, UNSEEN last.
    by_id = torch.where(ids == UNSEEN, _LAST_ID, ids).argsort(dim=1, stable=True)
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    # −0.0 sorts as +0.0: the two compare equal, so only their column orders them.
    by_value = torch.where(values == 0, 0.0, values).argsort(dim=1, descending=True, stable=True)[:, :k]
    best = torch.stack([part.values[:, 0] for part in parts])
    shifts = torch.where(best == float("-inf"), float("-inf"), best - best.amax(dim=0))  # a part of no column: -inf
    # Each part's log_sum re-based on the merged best value: no difference of two large, rounded LSEs.
    log_sum = (torch.stack([part.log_sum for part in parts]) + shifts).logsumexp(dim=0)
    return TopKRows(values.gather(1, by_value), ids.gather(1, by_value), log_sum)


def block_topk(logits: Tensor, k: int, first_id: int, temperature: float, cap: float | None) -> TopKRows:
    """The best ``k`` columns of a block of logits (rows, width) scaled to ``cap(logits)/temperature``
    (``cap``: the soft-cap, None for none), whose column 0 is global id ``first_id``, by a stable
    sort (equal values keep their column order), with ``UNSEEN`` entries where ``width < k``, and
    the block's log-partition. ``logits`` is read, never written (it may be a caller's tensor)."""
    # A new tensor before the in-place mul_: the caller's logits are never written.
    scaled = logits if cap is None else torch.tanh(logits / cap).mul_(cap)
    scaled = scaled if temperature == 1.0 else scaled / temperature
    rows, width = scaled.shape
    # −0.0 sorts as +0.0: the order is a total order on (value, column).
    order = torch.where(scaled == 0, 0.0, scaled).argsort(dim=1, descending=True, stable=True)[:, :k]
    values = scaled.gather(1, order)
    ids = order + first_id
    if width < k:
        values = torch.cat([values, values.new_full((rows, k - width), float("-inf"))], dim=1)
        ids = torch.cat([ids, ids.new_full((rows, k - width), UNSEEN)], dim=1)
    # Held relative to the best value: t − LSE = (t − m) − log_sum stays exact on a peaked row.
    return TopKRows(values, ids, (scaled - values[:, :1]).logsumexp(dim=1))


def decode_keys(keys: Tensor, first_id: int) -> tuple[Tensor, Tensor]:
    """The fp32 values and global ids of the kernel's int64 ``keys``: the high word holds the
    value's bits made monotone (negative bit patterns with all but the sign flipped), the low word
    ``2³² − 1 − column``; the key ``INT64_MIN`` is :data:`UNSEEN`."""
    high = (keys >> 32).to(torch.int32)
    values = torch.where(high >= 0, high, high ^ 0x7FFFFFFF).view(torch.float32)
    ids = _LOW_WORD - (keys & _LOW_WORD) + first_id
    unseen = keys == torch.iinfo(torch.int64).min
    return values.masked_fill(unseen, float("-inf")), ids.masked_fill(unseen, UNSEEN)
