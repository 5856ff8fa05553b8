"""How this device's statistics and gradients meet those of the other vocabulary shards.

On one device the local record already covers the whole vocabulary, so every method is the
identity. The tensor-parallel layer (:class:`orda_tp.parallel.shard_exchange.ShardExchange`) gathers
every rank's record and merges them identically on every rank, gathers sequence-parallel rows and sums the
hidden gradients; the loss code is the same in both cases.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import Tensor

from .records import PartitionRecord

__all__ = ["RecordExchange", "LocalExchange"]


class RecordExchange(Protocol):
    def merge_partitions(
        self, local: PartitionRecord, merge_stacked: Callable[[Tensor, int], PartitionRecord]
    ) -> PartitionRecord:
        """Round 1: the record of all shards' columns, identical on every shard; ``merge_stacked``
        merges (shards, rows, 2F+3) packed records (the backend's merge)."""
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

    def start_row_gradient_sum(self, grads: list[Tensor], begin: int, end: int) -> None:
        """Rows ``[begin, end)`` of the hidden gradients ``grads`` are complete on this device:
        their sum over the shards may start now, overlapping the rows still to come."""
        ...

    def reduce_row_gradients(self, grads: list[Tensor]) -> list[Tensor]:
        """Hidden gradients summed over the shards (this rank's rows under sequence parallelism)."""
        ...


class LocalExchange:
    """Single device: this device holds every column and every row."""

    def merge_partitions(
        self, local: PartitionRecord, merge_stacked: Callable[[Tensor, int], PartitionRecord]
    ) -> PartitionRecord:
        return local

    def sum_over_shards(self, local: Tensor) -> Tensor:
        return local

    def finish(self, like: Tensor) -> None:
        return None

    def gather_rows(self, tensors: list[Tensor]) -> list[Tensor]:
        return tensors

    def start_row_gradient_sum(self, grads: list[Tensor], begin: int, end: int) -> None:
        return None

    def reduce_row_gradients(self, grads: list[Tensor]) -> list[Tensor]:
        return grads
