"""The row walk: rows in chunks, columns in blocks, never a (rows, V) tensor.

One walker serves the fused loss (logits formed from hidden states and head weights) and the
logits-level losses (logits the caller holds). Per chunk of rows ``[begin, end)``:

1. its logits blocks over this device's real columns come from a :class:`.logits.LogitsSource`
   (stored, ``hidden · weight_blockᵀ``, or one GEMM for a tied head's two sides);
2. round 1 and round 2 merge the blocks' records through the exchange (identity on one device,
   one all-gather per round across a tensor-parallel group) and the row steps finalize each row
   (:func:`.rounds.chunk_row_stats`), unless statistics ``saved`` by an earlier walk are given;
3. when asked (a :class:`GradTarget`), the grad step forms the chunk's gradient row constants
   and the block math writes each block's logit gradients into the target's views: a staging
   buffer for the fused path's gradient GEMMs, the logits' gradient itself for the logits path.

A chunk's logits live only while the chunk is processed: the next chunk's are formed after they
are freed. Nothing here knows the variant, the number of ranks or what the gradients feed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from ..exchange import RecordExchange
from ..parallel.layout import VocabLayout
from ..plan import LossPlan
from .block_math import BlockMath
from .logits import ColumnRange, LogitGrads, LogitsSource, column_blocks
from .rounds import chunk_row_stats, grad_rows
from .stats import RowStats

__all__ = ["GradDestination", "GradTarget", "RowRange", "RowWalk", "row_ranges", "walk_rows"]

RowRange = tuple[int, int]  # half-open rows [begin, end) of the batch


def row_ranges(begin: int, end: int, size: int) -> list[RowRange]:
    """``[begin, end)`` cut into consecutive ranges of ``size`` rows (the last one shorter)."""
    return [(start, min(end, start + size)) for start in range(begin, end, size)]


@dataclass(frozen=True)
class RowWalk:
    """What a walk reads besides the logits.

    ``labels``: (rows,) the labels the statistics read (an ignored row's too: its values go
    unused); ``valid``: (rows,) the rows that count; ``exchange``: how records meet those of the
    other shards; ``layout``: this device's columns; ``math``: how a block becomes records and
    gradients (torch or Triton).
    """

    plan: LossPlan
    labels: Tensor
    valid: Tensor
    exchange: RecordExchange
    layout: VocabLayout
    math: BlockMath


class GradDestination(Protocol):
    """Where a walk writes logit gradients."""

    def views(self, begin: int, end: int, start: int, stop: int) -> LogitGrads:
        """The views for batch rows ``[begin, end)`` and local columns ``[start, stop)``."""
        ...


@dataclass(frozen=True)
class GradTarget:
    """Logit gradients wanted: written into ``destination``, for the upstream gradient
    ``upstream`` (÷ N for "mean"; 0-d, or (rows,) per row) in the statistics dtype."""

    destination: GradDestination
    upstream: Tensor


def walk_rows(
    walk: RowWalk,
    source: LogitsSource,
    chunks: Sequence[RowRange],
    dtype: torch.dtype,
    saved: Sequence[RowStats] | None = None,
    grads: GradTarget | None = None,
) -> list[RowStats]:
    """Walk ``chunks`` in order: each chunk's row statistics (computed, or ``saved[i]`` for
    ``chunks[i]``), with ``grads`` its logit gradients written. Returns the statistics in chunk
    order. ``dtype``: the statistics dtype."""
    like = torch.empty(0, dtype=dtype, device=walk.labels.device)
    columns = walk.layout.real_local_columns
    column_ranges = column_blocks(columns, walk.math.block_columns(walk.plan.config.vocab_block, columns))
    walked = []
    for index, (begin, end) in enumerate(chunks):
        stats = None if saved is None else saved[index]
        walked.append(_walk_chunk(walk, source, begin, end, column_ranges, stats, grads, like))
    return walked


def _walk_chunk(
    walk: RowWalk,
    source: LogitsSource,
    begin: int,
    end: int,
    column_ranges: Sequence[ColumnRange],
    stats: RowStats | None,
    grads: GradTarget | None,
    like: Tensor,
) -> RowStats:
    """One chunk: its logits, its statistics (computed unless given), and with ``grads`` its logit
    gradients. The logits live only as long as this call."""
    blocks = source.blocks(begin, end, column_ranges, like.dtype, walk.math.reads_stored_cache)
    labels = walk.labels[begin:end]
    vocab_start = walk.layout.vocab_start
    if stats is None:
        stats = chunk_row_stats(walk.plan, blocks, vocab_start, labels, walk.exchange, walk.math, like)
    if grads is not None:
        upstream = grads.upstream[begin:end] if grads.upstream.dim() else grads.upstream
        rows = grad_rows(walk.plan, stats, upstream, walk.valid[begin:end], walk.math, like)
        for block in blocks:
            walk.math.stage_logit_grads(
                walk.plan, rows, block.student, block.teacher, labels, vocab_start + block.start,
                grads.destination.views(begin, end, block.start, block.stop),
            )  # fmt: skip
    return stats
