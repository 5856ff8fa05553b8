"""Where a block of logits comes from: hidden × head-weight block, or a slice of a cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .gemm import logits_mm

__all__ = ["HeadTensors", "column_blocks", "statistics_dtype"]


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
    at or past ``real_columns`` are vocabulary padding (their logits read −inf on both sides).
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
    def teacher_head(self) -> Tensor:
        return self.weight if self.teacher_weight is None else self.teacher_weight


@dataclass(frozen=True)
class RowChunk:
    """The valid rows of one chunk: their indices into the batch, labels and hidden states (in the
    inputs' dtype), and the statistics dtype the chunk computes in."""

    index: Tensor
    labels: Tensor
    student_hidden: Tensor
    teacher_hidden: Tensor | None
    dtype: torch.dtype

    @staticmethod
    def gather(head: HeadTensors, index: Tensor, labels: Tensor, dtype: torch.dtype, with_teacher: bool) -> RowChunk:
        teacher_hidden = None
        if with_teacher and head.teacher_hidden is not None:
            teacher_hidden = head.teacher_hidden.detach().index_select(0, index)
        return RowChunk(
            index=index,
            labels=labels.index_select(0, index),
            student_hidden=head.student_hidden.detach().index_select(0, index),
            teacher_hidden=teacher_hidden,
            dtype=dtype,
        )


def block_logits(
    head: HeadTensors, chunk: RowChunk, start: int, stop: int, with_teacher: bool
) -> tuple[Tensor, Tensor | None]:
    """Student and teacher logits of ``chunk`` on local columns ``[start, stop)``, in the
    statistics dtype (logits are never rounded to bf16/fp16). Padding columns read −inf."""
    dtype = chunk.dtype
    student = _mask_padding(head, start, logits_mm(chunk.student_hidden, head.weight.detach()[start:stop], dtype))
    if not with_teacher:
        return student, None
    if head.teacher_logits is not None:
        teacher = head.teacher_logits.detach()[:, start:stop].index_select(0, chunk.index).to(dtype)
    else:
        assert chunk.teacher_hidden is not None
        teacher = logits_mm(chunk.teacher_hidden, head.teacher_head.detach()[start:stop], dtype)
    return student, _mask_padding(head, start, teacher)


def _mask_padding(head: HeadTensors, start: int, logits: Tensor) -> Tensor:
    """Set the block's padding columns (local index ≥ ``head.real_columns``) to −inf, in place."""
    if head.real_columns is not None and start + logits.shape[1] > head.real_columns:
        logits[:, max(0, head.real_columns - start) :] = float("-inf")
    return logits
