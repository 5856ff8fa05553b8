"""How the records of this device's columns meet the records of the other shards.

On one device the local record already covers the whole vocabulary, so the exchange is the
identity. The tensor-parallel layer supplies an exchange that gathers every rank's record and
merges them in rank order; the loss code is the same in both cases.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from .statistics import PartitionRecord

__all__ = ["RecordExchange", "LocalExchange"]


class RecordExchange(Protocol):
    def merge_partitions(self, local: PartitionRecord) -> PartitionRecord:
        """Round 1: the record of all shards' columns, identical on every shard."""
        ...

    def sum_over_shards(self, local: Tensor) -> Tensor:
        """Round 2: the sums over all shards' columns, identical on every shard."""
        ...


class LocalExchange:
    """Single device: this device holds every column."""

    def merge_partitions(self, local: PartitionRecord) -> PartitionRecord:
        return local

    def sum_over_shards(self, local: Tensor) -> Tensor:
        return local
