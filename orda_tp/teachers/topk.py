"""A top-k teacher cache as the dense teacher it stands for, one block at a time: per row the cached
log-probabilities ``l_m`` at their ids ``i_m`` (global, distinct, real) and one tail value ``τ`` on every
other real column (docs/guide.md, "Which tail"; the kernels' reads: docs/architecture.md, "… a teacher kind")."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .source import SparseLogits

__all__ = ["TAILS", "TopKBlocks", "check_topk_values", "retempered_mass", "tail_values"]

TAILS = ("uniform", "renormalize")


def mass_tolerance(dtype: torch.dtype, k: int) -> float:
    """How far above 1 the cached mass ``Σ_m e^{l_m}`` may round: ``k`` units of the values' dtype."""
    return k * torch.finfo(dtype).eps


def tail_values(logprobs: Tensor, tail: str, vocab_size: int) -> Tensor:
    """The rows' tail value ``τ`` in ``logprobs``' dtype: ``log(1 − Σ_m e^{l_m}) − log(V − k)`` for ``"uniform"``
    (the missing mass spread evenly over the other ``V − k`` columns: ``t`` is then normalized), ``−inf``
    for ``"renormalize"``. A mass rounded above 1 leaves no tail mass (past :func:`mass_tolerance`: refused)."""
    k = logprobs.shape[1]
    if tail == "renormalize" or vocab_size <= k:  # no tail mass, or no column outside the ids to hold it
        return torch.full(logprobs.shape[:1], float("-inf"), dtype=logprobs.dtype, device=logprobs.device)
    # A mass rounded above 1 leaves none (log 0 = −inf), not a NaN.
    missing = (1.0 - torch.exp(logprobs).sum(dim=1)).clamp_min(0.0)
    return torch.log(missing) - math.log(vocab_size - k)


def retempered_mass(logprobs: Tensor, vocab_size: int, power: float) -> tuple[float, float]:
    """The rows' mean mass on the listed ids, as cached and with every probability raised to
    ``power`` (re-tempered from ``T`` to ``T / power``) and renormalized, the missing mass spread
    evenly over the ``V − k`` other columns (the uniform tail's model of it)."""
    listed = torch.exp(logprobs.double())
    missing = (1.0 - listed.sum(dim=1)).clamp_min(0.0)
    powered = (listed**power).sum(dim=1)
    # The tail's V − k columns, each missing / (V − k), raised to the power: (V − k)^{1−p} · missing^p.
    others = vocab_size - logprobs.shape[1]
    tail = others ** (1.0 - power) * missing**power
    return float(listed.sum(dim=1).mean()), float((powered / (powered + tail)).mean())


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
    ordered = ids.sort(dim=1).values  # sorted, a repeated id sits next to its twin
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
    # Summed in fp64: the sum's own rounding stays far below the tolerance of the values' dtype.
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
    """The dense teacher of a top-k cache over this device's columns."""

    ids: Tensor  # (rows, k) global ids, ascending in each row, contiguous
    logprobs: Tensor  # (rows, k) in the ids' order, contiguous
    tail: Tensor  # (rows,) τ, the value of every other column
    vocab_start: int  # the global column of local column 0
    scatter_indices: dict[tuple[int, int], Tensor] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_cache(cls, ids: Tensor, logprobs: Tensor, tail: Tensor, vocab_start: int) -> TopKBlocks:
        """The blocks of a cache whose rows list their ids in any order."""
        # Ascending ids, once per call: the kernels' sparse reads walk a row's ids in column order.
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
        # k spare columns past the block take the entries whose ids lie outside it, and are cut off after.
        dense = torch.empty(rows, width + k, dtype=dtype, device=self.ids.device)
        dense.copy_(self.tail[begin:end, None].to(dtype).expand(-1, width + k))  # τ everywhere first
        index = self._scatter_index(start, stop)[begin:end]
        return dense.scatter_(1, index, self.logprobs[begin:end].to(dtype))[:, :width]

    def _scatter_index(self, start: int, stop: int) -> Tensor:
        """Where each cached entry lands in a block of local columns ``[start, stop)`` widened by
        ``k`` spare columns: its own column, or, for the ``m``-th id of a row outside the block,
        spare column ``width + m``. Every entry has its own place, so the scatter is deterministic."""
        index = self.scatter_indices.get((start, stop))
        if index is None:
            width, k = stop - start, self.ids.shape[1]
            local = self.ids - (self.vocab_start + start)
            spare = torch.arange(width, width + k, device=local.device)
            index = torch.where((local >= 0) & (local < width), local, spare)
            # For every row at once: the call's later chunks read the same column ranges.
            self.scatter_indices[(start, stop)] = index
        return index
