"""Where a chunk's logits come from: hidden × head-weight block, or a slice of a cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .gemm import logits_mm

__all__ = ["HeadTensors", "RowChunk", "block_logits", "column_blocks", "statistics_dtype", "stored_logits_block"]


def statistics_dtype(*tensors: Tensor | None) -> torch.dtype:
    """fp64 when any input is fp64 (the oracle's precision), fp32 otherwise."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def column_blocks(num_columns: int, block: int) -> list[tuple[int, int]]:
    """Half-open local column ranges of at most ``block`` columns covering ``[0, num_columns)``."""
    return [(start, min(start + block, num_columns)) for start in range(0, num_columns, block)]


@dataclass(frozen=True)
class HeadTensors:
    """The tensors that produce logits on this device.

    ``weight`` (V_local, H) is the student head; the teacher reads ``teacher_weight`` when set
    (separate head, or a cached hidden + head), ``weight`` when tied, or ``teacher_logits``
    (a cache, (BT, V_local)). ``vocab_start`` is the global id of local column 0; local columns
    at or past ``real_columns`` are vocabulary padding: no logits are formed there, so they hold
    no probability mass and receive no gradient.
    """

    student_hidden: Tensor
    weight: Tensor
    teacher_hidden: Tensor | None
    teacher_weight: Tensor | None
    teacher_logits: Tensor | None
    vocab_start: int = 0
    real_columns: int | None = None

    @property
    def local_vocab(self) -> int:
        return self.weight.shape[0]

    @property
    def columns(self) -> int:
        """Local columns that hold real vocabulary entries."""
        return self.local_vocab if self.real_columns is None else self.real_columns

    @property
    def teacher_head(self) -> Tensor:
        return self.weight if self.teacher_weight is None else self.teacher_weight

    def gemm_operands(self, teacher_trained: bool) -> list[Tensor]:
        """The tensors the gradient GEMMs multiply staged logit gradients with."""
        tensors: list[Tensor | None] = [self.student_hidden, self.weight]
        if teacher_trained:
            tensors += [self.teacher_hidden, self.teacher_head]
        return [t for t in tensors if t is not None]

    @property
    def tied(self) -> bool:
        """Whether teacher rows go through the student's head (one GEMM serves both sides)."""
        return self.teacher_hidden is not None and self.teacher_weight is None and self.teacher_logits is None


@dataclass(frozen=True)
class RowChunk:
    """Rows ``[begin, end)`` of the batch: labels, hidden states (views, in the inputs' dtype), the
    student and teacher rows stacked when one GEMM serves both, and the statistics dtype."""

    begin: int
    end: int
    labels: Tensor
    student_hidden: Tensor
    teacher_hidden: Tensor | None
    stacked_hidden: Tensor | None
    dtype: torch.dtype

    @staticmethod
    def slice(
        head: HeadTensors, begin: int, end: int, labels: Tensor, dtype: torch.dtype, with_teacher: bool
    ) -> RowChunk:
        student_hidden = head.student_hidden.detach()[begin:end]
        teacher_hidden, stacked = None, None
        if with_teacher and head.teacher_hidden is not None:
            teacher_hidden = head.teacher_hidden.detach()[begin:end]
            if head.tied:
                stacked = torch.cat([student_hidden, teacher_hidden])
        return RowChunk(begin, end, labels[begin:end], student_hidden, teacher_hidden, stacked, dtype)

    @property
    def rows(self) -> int:
        return self.end - self.begin


def stored_logits_block(
    logits: Tensor, begin: int, end: int, start: int, stop: int, dtype: torch.dtype, as_stored: bool
) -> Tensor:
    """Rows ``[begin, end)`` and local columns ``[start, stop)`` of stored logits (a cache, or
    logits handed in by the caller), detached: a view in the stored dtype when ``as_stored``
    (unit column stride, as the Triton kernels read it: a copy of the block otherwise), else in
    ``dtype``. Only the block is ever copied, never the whole tensor."""
    block = logits.detach()[begin:end, start:stop]
    if not as_stored:
        return block.to(dtype)
    return block if block.stride(1) == 1 or block.shape[1] <= 1 else block.contiguous()


def block_logits(
    head: HeadTensors, chunk: RowChunk, start: int, stop: int, with_teacher: bool, cache_as_stored: bool
) -> tuple[Tensor, Tensor | None]:
    """Student and teacher logits of ``chunk`` on local columns ``[start, stop)``, in the
    statistics dtype (logits are never rounded to bf16/fp16). A cache slice is returned as
    stored (a view) when ``cache_as_stored``, else converted to the statistics dtype."""
    dtype = chunk.dtype
    weight_block = head.weight.detach()[start:stop]
    if not with_teacher:
        return logits_mm(chunk.student_hidden, weight_block, dtype), None
    if chunk.stacked_hidden is not None:
        both = logits_mm(chunk.stacked_hidden, weight_block, dtype)
        return both[: chunk.rows], both[chunk.rows :]
    student = logits_mm(chunk.student_hidden, weight_block, dtype)
    if head.teacher_logits is not None:
        return student, stored_logits_block(
            head.teacher_logits, chunk.begin, chunk.end, start, stop, dtype, cache_as_stored
        )
    assert chunk.teacher_hidden is not None
    return student, logits_mm(chunk.teacher_hidden, head.teacher_head.detach()[start:stop], dtype)
