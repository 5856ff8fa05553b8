"""How this device's statistics and gradients meet those of the other vocabulary shards.

On one device the local record already covers the whole vocabulary, so every method is the
identity. The tensor-parallel layer (:class:`orda_tp.parallel.exchange.ShardExchange`) gathers
every rank's record and merges them identically on every rank, gathers sequence-parallel rows and sums the
hidden gradients; the loss code is the same in both cases.
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

    def finish(self, like: Tensor) -> None:
        """End of the forward statistics (lets a call with no rows still agree on errors)."""
        ...

    def gather_rows(self, tensors: list[Tensor]) -> list[Tensor]:
        """The full batch's rows of each hidden tensor (sequence parallelism), else the inputs."""
        ...

    def reduce_row_gradients(self, grads: list[Tensor]) -> list[Tensor]:
        """Hidden gradients summed over the shards (this rank's rows under sequence parallelism)."""
        ...


class LocalExchange:
    """Single device: this device holds every column and every row."""

    def merge_partitions(self, local: PartitionRecord) -> PartitionRecord:
        return local

    def sum_over_shards(self, local: Tensor) -> Tensor:
        return local

    def finish(self, like: Tensor) -> None:
        return None

    def gather_rows(self, tensors: list[Tensor]) -> list[Tensor]:
        return tensors

    def reduce_row_gradients(self, grads: list[Tensor]) -> list[Tensor]:
        return grads
