"""The logits-level losses' problem: what the row walk (:mod:`orda_tp.engine.row_walk`) reads
besides the logits, and the rows per chunk.

The walk is the fused path's, reading logits blocks instead of forming them from hidden states:
each column block of the student's logits (and the teacher's: stored too, or
``hidden · weight_blockᵀ``) feeds the same block math, the records merge through the same
exchange (none on one device, one all-gather per round across a tensor-parallel group) and
the same row steps finalize the rows. Nothing here knows the variant or the number of ranks.

Memory: the torch backend converts one chunk's blocks to the statistics dtype (``chunk_rows ×
V_local`` values per side, none for fp32/fp64 logits, which are read in place); the Triton kernels
read the stored logits (bf16 included) tile by tile and upcast in registers: no fp32 copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..arguments.options import LogitsOptions
from ..arguments.plan import LossPlan
from ..parallel.layout import VocabLayout
from ..parallel.shard_exchange import ShardExchange
from .block_math import select_backend
from .logits import LogitsSource
from .row_walk import GradTarget, RowRange, RowWalk, row_ranges, walk_rows
from .stats import RowStats
from .workspace import row_layout

__all__ = ["LogitsProblem", "build_problem", "row_statistics"]


@dataclass(frozen=True)
class LogitsProblem:
    """Everything of a call besides the logits: the walk's inputs (``walk.labels``: (rows,) labels
    as the statistics read them, each valid row's label column owned by exactly one rank;
    ``walk.valid``: (rows,) rows that count) and ``chunk_rows``, rows per chunk, the same on every
    rank of a group (it sets the collectives)."""

    walk: RowWalk
    chunk_rows: int

    def chunks(self) -> list[RowRange]:
        return row_ranges(0, self.walk.labels.shape[0], self.chunk_rows)


def build_problem(
    options: LogitsOptions,
    plan: LossPlan,
    labels: Tensor,
    valid: Tensor,
    group: dist.ProcessGroup | None,
    layout: VocabLayout,
    dtype: torch.dtype,
    formed_sides: int = 0,
) -> LogitsProblem:
    """The problem of a call: its exchange (none on one device, else across ``group``), block math
    (the backend selected for ``dtype`` on the labels' device) and rows per chunk:
    ``options.chunk_rows``, or as many as fit the default workspace of the ``dtype`` logits a chunk
    holds, sized from the widest shard so that every rank walks the same chunks. A chunk holds
    the ``formed_sides`` sides it forms (a teacher head's product, a top-k cache's blocks) and, on
    a block math that converts stored logits (torch), the two stored sides' copies too; when it
    holds none (the Triton kernels read both sides in place), the whole batch is one chunk: its
    temporaries are a few values per row."""
    math = select_backend(options.backend, labels.device.type, dtype)
    assert math is not None  # the logits-level losses have no "reference" backend
    chunk_rows, rows = options.chunk_rows, labels.shape[0]
    if chunk_rows == 0:
        held_sides = formed_sides if math.reads_stored_cache else 2
        chunk_rows = max(rows, 1)
        if held_sides:
            columns, shards = layout.max_local_columns, layout.world_size
            held = held_sides * dtype.itemsize
            chunk_rows = row_layout(options.config, rows, columns, held, 0, shards, layout.workspace_mib).chunk_rows
    exchange = None
    if group is not None:  # no local value checks here: nothing to share
        exchange = ShardExchange(group, False, None, shares_errors=False, inconsistent=layout.inconsistent)
    return LogitsProblem(RowWalk(plan, labels, valid, exchange, layout, math), chunk_rows)


def row_statistics(
    problem: LogitsProblem, source: LogitsSource, dtype: torch.dtype, target: GradTarget | None = None
) -> list[RowStats]:
    """Each chunk's finalized row statistics, in row order, with ``target`` the logit gradients
    written in the same walk, and the end of the call's exchange (a chunk's blocks live only while
    it is walked)."""
    walked = walk_rows(problem.walk, source, problem.chunks(), dtype, None, target)
    if problem.walk.exchange is not None:
        problem.walk.exchange.finish(torch.empty(0, dtype=dtype, device=problem.walk.labels.device))
    return walked
