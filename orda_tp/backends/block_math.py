"""The per-block math of the chunked loop, in two implementations.

The chunked loop (row chunks, column blocks, record exchange, gradient GEMMs) is the same for
every backend; what differs is how one block of logits becomes a round-1 record, round-2 sums
and logit gradients: torch ops (:class:`TorchBlockMath`) or generated Triton kernels
(:class:`orda_tp.backends.triton_math.TritonBlockMath`). Both read the same variant formulas.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
from torch import Tensor

from ..divergences.expr import evaluate_rows
from ..plan import LossPlan
from ..records import LogitFamily, PartitionRecord, block_partition_record, merge_stacked_partition_records
from .chunk_grads import block_logit_grads
from .chunk_stats import kl_block_terms
from .row_formulas import RowProgram

__all__ = ["BlockMath", "TorchBlockMath"]


class BlockMath(Protocol):
    #: Whether blocks of a teacher-logits cache may arrive as stored (bf16/fp16 views) instead of
    #: converted to the statistics dtype.
    reads_stored_cache: bool

    def block_columns(self, configured: int, local_columns: int) -> int:
        """Columns per block: the configured size, or more where blocks create no temporaries."""
        ...

    def partition(
        self, student: Tensor, teacher: Tensor | None, labels: Tensor, col_start: int, families: Sequence[LogitFamily]
    ) -> PartitionRecord:
        """Round-1 record of a block whose first column is global column ``col_start``."""
        ...

    def merge_stacked(self, stacked: Tensor, num_families: int) -> PartitionRecord:
        """Merge (S, rows, 2F+3) contiguous packed records (the shards' gathered records)."""
        ...

    def kl_sums(
        self,
        plan: LossPlan,
        student: Tensor,
        teacher: Tensor,
        labels: Tensor,
        col_start: int,
        lse_u: Tensor,
        lse_v: Tensor,
    ) -> Tensor:
        """(rows, num_sums) round-2 sums of the plan's variant over the block."""
        ...

    def rows(
        self, program: RowProgram, values: Mapping[str, Tensor], scalars: Mapping[str, float], like: Tensor
    ) -> Tensor:
        """Run a row program: ``values`` maps its inputs to (rows,) tensors (any stride),
        ``scalars`` its scalars to floats; (rows, outputs) in ``like``'s dtype."""
        ...

    def stage_logit_grads(
        self,
        plan: LossPlan,
        row_constants: Tensor,
        names: tuple[str, ...],
        student: Tensor,
        teacher: Tensor | None,
        labels: Tensor,
        col_start: int,
        out: tuple[Tensor, Tensor | None],
    ) -> None:
        """Write ``∂loss/∂s`` (and ``∂loss/∂t`` where ``out[1]`` is not None) of the block into the
        staging views ``out``, in their dtype; ``row_constants`` (rows, len(names)) from
        :func:`orda_tp.backends.chunk_stats.grad_row_constants`."""
        ...


class TorchBlockMath:
    """Torch ops on (rows × block) tensors: runs anywhere, fp64 included."""

    reads_stored_cache = False

    def block_columns(self, configured: int, local_columns: int) -> int:
        return configured  # each block's temporaries are (rows × block) tensors

    def partition(
        self, student: Tensor, teacher: Tensor | None, labels: Tensor, col_start: int, families: Sequence[LogitFamily]
    ) -> PartitionRecord:
        return block_partition_record(student, teacher, labels, col_start, families)

    def merge_stacked(self, stacked: Tensor, num_families: int) -> PartitionRecord:
        return merge_stacked_partition_records(stacked, num_families)

    def kl_sums(
        self,
        plan: LossPlan,
        student: Tensor,
        teacher: Tensor,
        labels: Tensor,
        col_start: int,
        lse_u: Tensor,
        lse_v: Tensor,
    ) -> Tensor:
        divergence = plan.divergence
        assert divergence is not None
        local_labels = labels - col_start if divergence.needs_target else None
        return divergence.block_sums(kl_block_terms(plan, student, teacher, lse_u, lse_v, local_labels), plan.params)

    def rows(
        self, program: RowProgram, values: Mapping[str, Tensor], scalars: Mapping[str, float], like: Tensor
    ) -> Tensor:
        constants = {name: torch.tensor(value, dtype=like.dtype) for name, value in scalars.items()}
        return evaluate_rows(program.exprs, {**values, **constants}, like)

    def stage_logit_grads(
        self,
        plan: LossPlan,
        row_constants: Tensor,
        names: tuple[str, ...],
        student: Tensor,
        teacher: Tensor | None,
        labels: Tensor,
        col_start: int,
        out: tuple[Tensor, Tensor | None],
    ) -> None:
        constants = {name: row_constants[:, j] for j, name in enumerate(names)}
        student_grad, teacher_grad = block_logit_grads(plan, constants, student, teacher, labels - col_start)
        out[0].copy_(student_grad)
        if out[1] is not None:
            assert teacher_grad is not None
            out[1].copy_(teacher_grad)
