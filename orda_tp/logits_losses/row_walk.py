"""The rows of given logits in chunks: the fused path's statistics and logit gradients, reading
logits blocks instead of forming them from hidden states.

Per row chunk, each column block of the student's logits (and the teacher's: stored too, or
``hidden · weight_blockᵀ``) feeds the same block math as the fused path
(:mod:`orda_tp.backends.block_math` on torch, :mod:`orda_tp.backends.triton_math` with the
generated kernels), the records merge through the same exchange (identity on one device, one
all-gather per round across a tensor-parallel group) and :func:`chunk_row_stats` finalizes the
rows. Nothing here knows the variant or the number of ranks.

Memory: the torch backend converts one chunk's blocks to the statistics dtype (``chunk_rows ×
V_local`` values per side, none for fp32/fp64 logits, which are read in place); the Triton kernels
read the stored logits (bf16 included) tile by tile and upcast in registers: no fp32 copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from ..backends import block_math_of, select_backend
from ..backends.block_math import BlockMath
from ..backends.chunk_stats import RowStats, chunk_row_stats, grad_row_constants
from ..backends.gemm import logits_mm
from ..backends.head import column_blocks, stored_logits_block
from ..exchange import LocalExchange, RecordExchange
from ..options import LogitsOptions
from ..parallel.layout import VocabLayout
from ..parallel.shard_exchange import ShardExchange
from ..plan import LossPlan

__all__ = [
    "HeadLogits",
    "LogitsProblem",
    "LogitsSource",
    "StoredLogits",
    "build_problem",
    "row_statistics",
    "stage_student_grads",
]


class LogitsSource(Protocol):
    def block(self, begin: int, end: int, start: int, stop: int, dtype: torch.dtype, as_stored: bool) -> Tensor:
        """Logits of rows ``[begin, end)`` on local columns ``[start, stop)``: in ``dtype``, or as
        stored when ``as_stored`` and the source stores them."""
        ...


@dataclass(frozen=True)
class StoredLogits:
    """Logits held in memory, (rows, local columns)."""

    logits: Tensor

    def block(self, begin: int, end: int, start: int, stop: int, dtype: torch.dtype, as_stored: bool) -> Tensor:
        return stored_logits_block(self.logits, begin, end, start, stop, dtype, as_stored)


@dataclass(frozen=True)
class HeadLogits:
    """Logits ``hidden · weightᵀ`` formed block by block (never rounded below the statistics
    dtype, never all at once): ``hidden`` (rows, D), ``weight`` (local columns, D)."""

    hidden: Tensor
    weight: Tensor

    def block(self, begin: int, end: int, start: int, stop: int, dtype: torch.dtype, as_stored: bool) -> Tensor:
        return logits_mm(self.hidden.detach()[begin:end], self.weight.detach()[start:stop], dtype)


@dataclass(frozen=True)
class LogitsProblem:
    """Everything of a call besides the logits.

    ``labels``: (rows,) labels as the statistics read them (each valid row's label column is owned
    by exactly one rank); ``valid``: (rows,) rows that count; ``chunk_rows``: rows per chunk, the
    same on every rank of a group (it sets the collectives).
    """

    plan: LossPlan
    labels: Tensor
    valid: Tensor
    exchange: RecordExchange
    layout: VocabLayout
    math: BlockMath
    chunk_rows: int

    def chunks(self) -> Iterator[tuple[int, int]]:
        rows = self.labels.shape[0]
        for begin in range(0, rows, self.chunk_rows):
            yield begin, min(rows, begin + self.chunk_rows)


def build_problem(
    options: LogitsOptions,
    plan: LossPlan,
    labels: Tensor,
    valid: Tensor,
    group: dist.ProcessGroup | None,
    layout: VocabLayout,
    dtype: torch.dtype,
) -> LogitsProblem:
    """The problem of a call: its exchange (local, or across ``group``), block math (the backend
    selected for ``dtype`` on the labels' device) and rows per chunk (``options.chunk_rows``, or
    as many as fit the default workspace of fp32 student and teacher rows, sized from the widest
    shard so that every rank walks the same chunks)."""
    chunk_rows = options.chunk_rows
    if chunk_rows == 0:
        rows, columns = labels.shape[0], layout.max_local_columns
        chunk_rows = options.config.row_layout(rows, columns, 2 * dtype.itemsize, 0, layout.world_size).chunk_rows
    exchange = LocalExchange() if group is None else ShardExchange(group, sequence_parallel=False, local_error=None)
    math = block_math_of(select_backend(options.backend, labels.device, dtype))
    return LogitsProblem(plan, labels, valid, exchange, layout, math, chunk_rows)


def _chunk_blocks(
    problem: LogitsProblem, student: LogitsSource, teacher: LogitsSource, begin: int, end: int, dtype: torch.dtype
) -> list[tuple[int, int, Tensor, Tensor]]:
    """``(start, stop, student, teacher)`` blocks of rows ``[begin, end)`` over the local columns."""
    math = problem.math
    columns = problem.layout.real_local_columns
    width = math.block_columns(problem.plan.config.vocab_block, columns)
    as_stored = math.reads_stored_cache
    return [
        (
            start,
            stop,
            student.block(begin, end, start, stop, dtype, as_stored),
            teacher.block(begin, end, start, stop, dtype, as_stored),
        )
        for start, stop in column_blocks(columns, width)
    ]


def row_statistics(
    problem: LogitsProblem, student: LogitsSource, teacher: LogitsSource, dtype: torch.dtype
) -> list[RowStats]:
    """Each chunk's finalized row statistics, in row order (a chunk's blocks live only while its
    statistics are formed)."""
    like = torch.empty(0, dtype=dtype, device=problem.labels.device)
    walked = []
    for begin, end in problem.chunks():
        blocks = _chunk_blocks(problem, student, teacher, begin, end, dtype)
        starts = [(problem.layout.vocab_start + start, s, t) for start, _, s, t in blocks]
        labels = problem.labels[begin:end]
        walked.append(chunk_row_stats(problem.plan, starts, labels, problem.exchange, problem.math, like))
    problem.exchange.finish(like)
    return walked


def stage_student_grads(
    problem: LogitsProblem,
    student: LogitsSource,
    teacher: LogitsSource,
    saved: list[RowStats],
    upstream_scale: Tensor,
    out: Tensor,
) -> None:
    """Write ``∂loss/∂s`` of every row into ``out`` (rows, local columns), in its dtype, chunk by
    chunk from the statistics ``saved`` by :func:`row_statistics`. ``upstream_scale`` (0-d, the
    statistics dtype) multiplies every valid row; ignored rows get exactly 0, rows whose label no
    column owns NaN (:func:`grad_row_constants`)."""
    dtype = upstream_scale.dtype
    like = torch.empty(0, dtype=dtype, device=out.device)
    for (begin, end), stats in zip(problem.chunks(), saved):
        valid = problem.valid[begin:end]
        constants, names = grad_row_constants(problem.plan, stats, upstream_scale, valid, problem.math, like)
        for start, stop, s, t in _chunk_blocks(problem, student, teacher, begin, end, dtype):
            problem.math.stage_logit_grads(
                problem.plan, constants, names, s, t, problem.labels[begin:end], problem.layout.vocab_start + start,
                (out[begin:end, start:stop], None),
            )  # fmt: skip
