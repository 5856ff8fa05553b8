"""A top-k teacher cache as the dense teacher it stands for, formed one block at a time.

A cache holds, per row, ``k`` vocabulary ids ``i_1 … i_k`` (global, distinct, in the real
vocabulary) and their log-probabilities ``l_1 … l_k`` (≤ 0). The teacher's logits are
``t_j = l_m`` on ``j = i_m`` and one value ``τ`` on every other real column (the *tail*):

- ``tail="uniform"``: the missing mass ``1 − Σ_m e^{l_m}`` spread evenly over the other ``V − k``
  columns, ``τ = log(1 − Σ_m e^{l_m}) − log(V − k)``; ``t`` is then a normalized log-distribution
  (``LSE(t) = 0``), and every loss on it equals the loss on that dense teacher.
- ``tail="renormalize"``: ``τ = −inf``; the teacher is ``softmax(t)`` over the cached ids alone.

The cache itself is (rows, k). The Triton kernels read its rows as they are
(:class:`~orda_tp.teachers.source.SparseLogits`: each row's ids sorted once per call, its values
in their order, ``τ``); the torch block math and the reference get a chunk's block over local
columns ``[start, stop)`` formed when the walk reads it (``τ`` broadcast, the ids of the block
scattered in), which lives as long as the chunk's other logits. Under tensor parallelism every
rank holds the whole cache (ids are global, like the labels) and reads the columns of its shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .source import SparseLogits

__all__ = ["TAILS", "TopKBlocks", "check_topk_values", "tail_values"]

TAILS = ("uniform", "renormalize")


def mass_tolerance(dtype: torch.dtype, k: int) -> float:
    """How far above 1 the cached mass ``Σ_m e^{l_m}`` may round: ``k`` units of the values' dtype."""
    return k * torch.finfo(dtype).eps


def tail_values(logprobs: Tensor, tail: str, vocab_size: int) -> Tensor:
    """The rows' tail value ``τ`` (module docstring), in ``logprobs``' dtype. A mass above 1 within
    :func:`mass_tolerance` (rounding) leaves no tail mass (``τ = −inf``); more is refused by
    :func:`check_topk_values` where host checks run."""
    k = logprobs.shape[1]
    if tail == "renormalize" or vocab_size <= k:
        return torch.full(logprobs.shape[:1], float("-inf"), dtype=logprobs.dtype, device=logprobs.device)
    missing = (1.0 - torch.exp(logprobs).sum(dim=1)).clamp_min(0.0)
    return torch.log(missing) - math.log(vocab_size - k)


def check_topk_values(ids: Tensor, logprobs: Tensor, vocab_size: int) -> None:
    """Raise unless every id lies in ``[0, vocab_size)`` and appears once in its row, every
    log-probability is ≤ 0 (``−inf``: no mass) and no row's mass exceeds 1 (reads the values:
    synchronizes with the device)."""
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        row, position = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"PrecomputedTeacher.topk_ids must lie in [0, {vocab_size}) (the real vocabulary); "
            f"topk_ids[{row}, {position}] = {int(ids[row, position])}"
        )
    ordered = ids.sort(dim=1).values
    repeated = ordered[:, 1:] == ordered[:, :-1]
    if bool(repeated.any()):
        row, position = (int(i) for i in repeated.nonzero()[0])
        raise ValueError(
            f"PrecomputedTeacher.topk_ids must be distinct in each row; row {row} holds id "
            f"{int(ordered[row, position])} twice"
        )
    bad = torch.isnan(logprobs) | (logprobs > 0)
    if bool(bad.any()):
        row, position = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            "PrecomputedTeacher.topk_logprobs must be log-probabilities (≤ 0, or -inf for no mass); "
            f"topk_logprobs[{row}, {position}] = {float(logprobs[row, position])}"
        )
    mass = torch.exp(logprobs.double()).sum(dim=1)
    limit = 1.0 + mass_tolerance(logprobs.dtype, logprobs.shape[1])
    over = mass > limit
    if bool(over.any()):
        row = int(over.nonzero()[0, 0])
        raise ValueError(
            "PrecomputedTeacher.topk_logprobs must hold at most the whole mass of each row "
            f"(Σ exp ≤ 1, up to {limit - 1:.1e} of rounding); row {row} sums to {float(mass[row]):.9g}"
        )


@dataclass(frozen=True)
class TopKBlocks:
    """The dense teacher of a top-k cache over this device's columns: ``ids`` (rows, k) global,
    ascending in each row, and ``logprobs`` (rows, k) in their order, both contiguous; ``tail``
    (rows,) the value of the other columns; local column 0 is global column ``vocab_start``.
    Where a dense block's entries land is worked out once per call and column range, for every
    row (``scatter_indices``)."""

    ids: Tensor
    logprobs: Tensor
    tail: Tensor
    vocab_start: int
    scatter_indices: dict[tuple[int, int], Tensor] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_cache(cls, ids: Tensor, logprobs: Tensor, tail: Tensor, vocab_start: int) -> TopKBlocks:
        """The blocks of a cache whose rows list their ids in any order."""
        ids, order = ids.sort(dim=1)
        return cls(ids, logprobs.gather(1, order), tail, vocab_start)

    def block(
        self, begin: int, end: int, start: int, stop: int, dtype: torch.dtype, as_stored: bool
    ) -> Tensor | SparseLogits:
        """Rows ``[begin, end)`` on local columns ``[start, stop)``: ``as_stored``, the cache's own
        rows as :class:`SparseLogits` (global ids, so one object serves every column range);
        else formed in ``dtype``: ``τ`` broadcast, the cached log-probabilities at their ids."""
        if as_stored:
            return SparseLogits(self.ids[begin:end], self.logprobs[begin:end], self.tail[begin:end])
        rows, k, width = end - begin, self.ids.shape[1], stop - start
        dense = torch.empty(rows, width + k, dtype=dtype, device=self.ids.device)
        dense.copy_(self.tail[begin:end, None].to(dtype).expand(-1, width + k))
        index = self._scatter_index(start, stop)[begin:end]
        return dense.scatter_(1, index, self.logprobs[begin:end].to(dtype))[:, :width]

    def _scatter_index(self, start: int, stop: int) -> Tensor:
        """Where each cached entry lands in a block of local columns ``[start, stop)`` widened by
        ``k`` spare columns: its own column, or, for the ``m``-th id of a row outside the block,
        spare column ``width + m``, which the block leaves out. Every entry has its own place, so
        a scatter is deterministic. Formed for every row at the first block of this range."""
        index = self.scatter_indices.get((start, stop))
        if index is None:
            width, k = stop - start, self.ids.shape[1]
            local = self.ids - (self.vocab_start + start)
            spare = torch.arange(width, width + k, device=local.device)
            index = torch.where((local >= 0) & (local < width), local, spare)
            self.scatter_indices[(start, stop)] = index
        return index
