"""Where a chunk's logits come from, block by block over this device's columns: a
:class:`LogitsSource` (stored, a head's product per block, or one GEMM for a tied head's two sides),
formed in the statistics dtype, never rounded to bf16/fp16 first (docs/architecture.md, "GEMMs").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from ..teachers.source import SparseLogits, TeacherBlocks

__all__ = [
    "ColumnRange",
    "HeadLogits",
    "HeadTensors",
    "LogitGrads",
    "LogitsBlock",
    "LogitsSource",
    "PairedLogits",
    "SideLogits",
    "StoredLogits",
    "TeacherBlock",
    "TiedLogits",
    "logits_mm",
    "logits_source",
    "softcapped",
    "statistics_dtype",
    "stored_logits_block",
]

ColumnRange = tuple[int, int]  # half-open local columns [start, stop)
TeacherBlock = Tensor | SparseLogits  # a block of teacher logits, dense or sparse (a top-k cache's)
LOW_PRECISION = (torch.float16, torch.bfloat16)


def statistics_dtype(*tensors: Tensor | None) -> torch.dtype:
    """fp64 when any input is fp64 (the oracle's precision), fp32 otherwise."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def logits_mm(hidden: Tensor, weight_block: Tensor, dtype: torch.dtype) -> Tensor:
    """``hidden · weight_blockᵀ`` in ``dtype`` (fp32/fp64), never rounded through the inputs' dtype
    (fp16/bf16 operands of one dtype on CUDA: the tensor cores' fp32 result)."""
    same_low_precision = hidden.dtype == weight_block.dtype and hidden.dtype in LOW_PRECISION
    if hidden.is_cuda and same_low_precision and dtype == torch.float32:
        # The tensor cores' fp32 accumulator written as it is: the logits are never rounded to bf16/fp16.
        return torch.mm(hidden, weight_block.T, torch.float32)
    # CPU, fp32/fp64 or mixed operands: cast first, so the product is formed in the statistics dtype.
    return hidden.to(dtype) @ weight_block.to(dtype).T


_ADDMM_OUT_DTYPE = [True]  # cleared once if this torch has no addmm(..., out_dtype=...)


def addmm_fp32_into(target: Tensor, left: Tensor, right: Tensor, beta: float, alpha: float) -> bool:
    """``target = beta·target + alpha·left·right`` for bf16/fp16 CUDA operands of one dtype into a
    contiguous fp32 ``target``, added in the GEMM's epilogue (β = 0: ``target`` is not read, NaN
    included); False, with nothing written, where this torch or these tensors cannot."""
    fits = left.is_cuda and left.dtype == right.dtype and left.dtype in LOW_PRECISION
    if not (_ADDMM_OUT_DTYPE[0] and fits and target.dtype == torch.float32 and target.is_contiguous()):
        return False
    try:
        # out=target: the fp32 accumulator scaled and added in the epilogue, no product tensor.
        torch.addmm(target, left, right, beta=beta, alpha=alpha, out_dtype=torch.float32, out=target)
    except TypeError:  # a torch without addmm(out_dtype=...)
        _ADDMM_OUT_DTYPE[0] = False  # remembered: the caller's fallback from now on
        return False
    return True


def softcapped(logits: Tensor, cap: float | None) -> Tensor:
    """``cap·tanh(logits/cap)`` in place (Gemma 2's soft-capping), for the torch block math (the
    Triton kernels cap a tile as they load it); ``logits`` when ``cap`` is None."""
    # In place: its callers hand it a GEMM's fresh output, which nothing else holds.
    return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)


@dataclass(frozen=True)
class LogitsBlock:
    """A chunk's logits on local columns ``[start, stop)``: ``student`` and ``teacher`` (None: no
    teacher logits; :class:`SparseLogits` only for a block math that reads stored logits as stored)."""

    start: int
    stop: int
    student: Tensor
    teacher: TeacherBlock | None


@dataclass(frozen=True)
class LogitGrads:
    """Logit gradients (or views of them, one block's): ``student``, and ``teacher`` when the
    teacher is trained (else None); ``stacked``, where set, is one (2·rows, columns) tensor whose
    halves are ``student`` and ``teacher`` (a fused call's row group)."""

    student: Tensor
    teacher: Tensor | None
    stacked: Tensor | None = None


class SideLogits(Protocol):
    """One side's logits."""

    def block(self, begin: int, end: int, start: int, stop: int, dtype: torch.dtype, as_stored: bool) -> Tensor:
        """Rows ``[begin, end)`` on local columns ``[start, stop)``: in ``dtype``, or as stored when
        ``as_stored`` and the side stores them."""
        ...


class LogitsSource(Protocol):
    """Both sides' logits of a row chunk."""

    def blocks(
        self, begin: int, end: int, columns: Sequence[ColumnRange], dtype: torch.dtype, as_stored: bool
    ) -> list[LogitsBlock]:
        """The blocks of rows ``[begin, end)`` over the column ranges ``columns``, in order."""
        ...


def stored_logits_block(
    logits: Tensor, begin: int, end: int, start: int, stop: int, dtype: torch.dtype, as_stored: bool
) -> Tensor:
    """Rows ``[begin, end)`` and local columns ``[start, stop)`` of stored logits, detached: a view
    in the stored dtype when ``as_stored`` (unit column stride: a copy of the block otherwise),
    else in ``dtype``; never a copy of the whole tensor."""
    block = logits.detach()[begin:end, start:stop]
    if not as_stored:
        return block.to(dtype)
    # The kernels read columns at unit stride; only a strided block is copied, in its stored dtype.
    return block if block.stride(1) == 1 or block.shape[1] <= 1 else block.contiguous()


@dataclass(frozen=True)
class StoredLogits:
    """Logits held in memory, (rows, local columns)."""

    logits: Tensor

    def block(self, begin: int, end: int, start: int, stop: int, dtype: torch.dtype, as_stored: bool) -> Tensor:
        return stored_logits_block(self.logits, begin, end, start, stop, dtype, as_stored)


def biased_and_scaled(logits: Tensor, bias: Tensor | None, scale: float, start: int, stop: int) -> Tensor:
    """``(logits + bias[start:stop])·scale`` in place (a GEMM's fresh output): the bias added in the
    statistics dtype, then the scale, TRL's rounding order; ``logits`` when there is neither."""
    if bias is not None:
        logits.add_(bias.detach()[start:stop].to(logits.dtype))
    return logits if scale == 1.0 else logits.mul_(scale)


@dataclass(frozen=True)
class HeadLogits:
    """Logits ``cap(scale·(hidden · weightᵀ + bias))`` formed block by block: ``hidden`` (rows, D),
    ``weight`` (local columns, D), ``bias`` (local columns,) or None; soft-capped by ``cap`` when
    given (``scale`` and ``cap``: the side's logit scale and soft-cap)."""

    hidden: Tensor
    weight: Tensor
    cap: float | None = None
    bias: Tensor | None = None
    scale: float = 1.0

    def block(self, begin: int, end: int, start: int, stop: int, dtype: torch.dtype, as_stored: bool) -> Tensor:
        logits = logits_mm(self.hidden.detach()[begin:end], self.weight.detach()[start:stop], dtype)
        if self.bias is not None or self.scale != 1.0:
            logits = biased_and_scaled(logits, self.bias, self.scale, start, stop)
        return logits if self.cap is None else softcapped(logits, self.cap)


@dataclass(frozen=True)
class PairedLogits:
    """A student side and a teacher side (None: no teacher logits), each formed on its own."""

    student: SideLogits
    teacher: TeacherBlocks | None

    def blocks(
        self, begin: int, end: int, columns: Sequence[ColumnRange], dtype: torch.dtype, as_stored: bool
    ) -> list[LogitsBlock]:
        teacher = self.teacher
        return [
            LogitsBlock(
                start,
                stop,
                self.student.block(begin, end, start, stop, dtype, as_stored),
                None if teacher is None else teacher.block(begin, end, start, stop, dtype, as_stored),
            )
            for start, stop in columns
        ]


@dataclass(frozen=True)
class TiedLogits:
    """Student and teacher rows through one head ``weight`` (and ``bias``, one ``scale``): per chunk
    the rows are stacked once, and per block one GEMM ``[h_s; h_t] · weight_blockᵀ`` gives both
    sides' logits."""

    student_hidden: Tensor
    teacher_hidden: Tensor
    weight: Tensor
    student_cap: float | None = None
    teacher_cap: float | None = None
    bias: Tensor | None = None
    scale: float = 1.0

    def blocks(
        self, begin: int, end: int, columns: Sequence[ColumnRange], dtype: torch.dtype, as_stored: bool
    ) -> list[LogitsBlock]:
        # Stacked once per chunk: each block's one GEMM reads the weight block once for both sides.
        stacked = torch.cat([self.student_hidden.detach()[begin:end], self.teacher_hidden.detach()[begin:end]])
        rows = end - begin
        blocks = []
        for start, stop in columns:
            both = logits_mm(stacked, self.weight.detach()[start:stop], dtype)
            if self.bias is not None or self.scale != 1.0:  # both sides at once
                both = biased_and_scaled(both, self.bias, self.scale, start, stop)
            student, teacher = both[:rows], both[rows:]
            if self.student_cap is not None or self.teacher_cap is not None:
                student, teacher = softcapped(student, self.student_cap), softcapped(teacher, self.teacher_cap)
            blocks.append(LogitsBlock(start, stop, student, teacher))
        return blocks


class HeadTensors(NamedTuple):
    """The fused path's differentiable tensors: ``weight`` (V_local, H) is the student head; the
    teacher reads ``teacher_weight`` when set, ``weight`` when tied (neither ``teacher_weight`` nor
    ``teacher_logits``), or ``teacher_logits`` (a cache, (BT, V_local)). ``bias`` and
    ``teacher_bias`` (V_local,): the heads' biases, or None (a tied teacher reads ``bias``)."""

    student_hidden: Tensor
    weight: Tensor
    teacher_hidden: Tensor | None
    teacher_weight: Tensor | None
    teacher_logits: Tensor | None
    bias: Tensor | None = None
    teacher_bias: Tensor | None = None


def logits_source(
    head: HeadTensors,
    with_teacher: bool,
    tied: bool,
    teacher_blocks: TeacherBlocks | None = None,
    caps: tuple[float | None, float | None] = (None, None),
    scales: tuple[float, float] = (1.0, 1.0),
) -> LogitsSource:
    """The student's logits ``h_s·Wᵀ + b`` and, ``with_teacher``, the teacher's: through the same
    GEMM as the student's where the head is ``tied`` (``LossPlan.tied_head``), the blocks it forms
    itself (``teacher_blocks``, a top-k cache), from the cache, or ``h_t·W_tᵀ + b_t``; a head's
    logits scaled by ``scales`` and soft-capped by ``caps`` (student, teacher)."""
    student_cap, teacher_cap = caps
    student = HeadLogits(head.student_hidden, head.weight, student_cap, head.bias, scales[0])
    if not with_teacher:
        return PairedLogits(student, None)
    if tied:  # the plan holds a tied head's two scales equal
        assert head.teacher_hidden is not None
        return TiedLogits(
            head.student_hidden, head.teacher_hidden, head.weight, student_cap, teacher_cap, head.bias, scales[0]
        )
    if teacher_blocks is not None:
        return PairedLogits(student, teacher_blocks)
    if head.teacher_logits is not None:
        return PairedLogits(student, StoredLogits(head.teacher_logits))
    assert head.teacher_hidden is not None and head.teacher_weight is not None
    teacher = HeadLogits(head.teacher_hidden, head.teacher_weight, teacher_cap, head.teacher_bias, scales[1])
    return PairedLogits(student, teacher)
