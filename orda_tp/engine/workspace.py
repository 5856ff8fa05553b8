"""The workspace of a call and the rows per chunk and per gradient group within it, by which every
door sizes its chunks: ``C·(R·logit_bytes + G·staged_bytes)`` bytes for chunks of ``R`` rows and
groups of ``G`` over ``C`` local columns (docs/architecture.md, "Memory").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..arguments.config import HOST_WORKSPACE_MIB, ExecutionConfig

__all__ = [
    "CHUNKS_PER_GROUP",
    "FAST_FACTOR",
    "FREE_MEMORY_SHARE",
    "HOST_WORKSPACE_MIB",
    "LAYOUT_COSTS",
    "MIN_CHUNK_ROWS",
    "WORKSPACE_STEPS_MIB",
    "RowLayout",
    "default_workspace_mib",
    "row_layout",
]
#: The default workspaces on a CUDA device, largest first; the last one also where less is free.
WORKSPACE_STEPS_MIB = (2048, 1024, 512)
#: The default workspace is at most this fraction's inverse of the free device memory.
FREE_MEMORY_SHARE = 16


def default_workspace_mib(device: torch.device) -> int:
    """The default workspace of a call on ``device``, in MiB: on CUDA the largest step of
    :data:`WORKSPACE_STEPS_MIB` at most 1/:data:`FREE_MEMORY_SHARE` of the free memory, else the
    smallest; elsewhere :data:`HOST_WORKSPACE_MIB`. No synchronization with the device."""
    if device.type != "cuda":
        return HOST_WORKSPACE_MIB
    # The driver's and the allocator's counters, never a tensor: nothing waits for the device.
    free_bytes, _ = torch.cuda.mem_get_info(device)
    # What PyTorch's allocator holds unused is free to this call too.
    free_bytes += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    share_mib = free_bytes // FREE_MEMORY_SHARE >> 20
    return next((step for step in WORKSPACE_STEPS_MIB if step <= share_mib), WORKSPACE_STEPS_MIB[-1])


#: The default's rows per chunk are at least this (× the group's size, × FAST_FACTOR with
#: ``ChunkSize(fast=True)``), whatever the workspace: below it, launches cost more than memory saves.
MIN_CHUNK_ROWS = 256
#: ``ChunkSize(fast=True)``: this many times the workspace and the minimum rows.
FAST_FACTOR = 4
#: Chunks per gradient group where the rows per chunk are asked for (``nrows``, ``num_chunks``,
#: ``max_chunks``) or the workspace is too small for every layout of :data:`LAYOUT_COSTS`.
CHUNKS_PER_GROUP = 3

#: The layouts the default chooses from: (chunk rows, group rows) → the call's time walked so,
#: relative to the fastest layout measured (2048/8192), averaged over the problems of
#: ``benchmarks/layout_sweep.py`` on an H200 (KD at BT = 8192 and 32768 at V = 128256 and at
#: V = 256000, CE at V = 128256; docs/benchmarks.md). Layouts that another one beats in less memory
#: are left out. Under a tensor-parallel group the rows are multiplied by its size (a shard holds
#: 1/tp of the columns: the same memory).
LAYOUT_COSTS: dict[tuple[int, int], float] = {
    (256, 512): 1.145,
    (256, 768): 1.111,
    (256, 1024): 1.094,
    (256, 2048): 1.056,
    (512, 1024): 1.060,
    (512, 1536): 1.047,
    (512, 2048): 1.028,
    (512, 4096): 1.024,
    (1024, 2048): 1.015,
    (1024, 4096): 1.008,
    (2048, 4096): 1.004,
    (2048, 8192): 1.001,
}


@dataclass(frozen=True)
class RowLayout:
    """How a call walks its rows: ``chunk_rows`` rows share one pass of logits and statistics;
    ``group_rows`` (a multiple of ``chunk_rows``) share one pair of gradient GEMMs."""

    chunk_rows: int
    group_rows: int

    def workspace_bytes(self, columns: int, logit_bytes: int, staged_bytes: int) -> int:
        """``C·(R·logit_bytes + G·staged_bytes)``: a chunk's logits and a group's staged logit
        gradients over ``columns`` columns."""
        return columns * (self.chunk_rows * logit_bytes + self.group_rows * staged_bytes)


def row_layout(
    config: ExecutionConfig,
    total_rows: int,
    local_vocab: int,
    logit_bytes: int,
    staged_bytes: int,
    shards: int = 1,
    workspace_mib: int = HOST_WORKSPACE_MIB,
) -> RowLayout:
    """Rows per chunk and per gradient group for ``local_vocab`` columns (``KernelConfig``'s
    chunking fields), the same on every rank that passes the same arguments.

    ``logit_bytes``: bytes one row of a chunk keeps per column (4 per fp32 logits side);
    ``staged_bytes``: bytes one staged row takes per column (0 when no gradient is formed);
    ``shards``: the tensor-parallel group's size; ``workspace_mib``: the default workspace, which
    ``config.workspace_mib`` replaces.

    - Rows asked for: ``chunk_size.nrows``, or ``ceil(rows / num_chunks)``, or
      ``ceil(rows / max_chunks)`` where the workspace's layout would make more than ``max_chunks``
      chunks; a dynamic ``chunk_size`` lowers them to fit an explicit ``workspace_mib``. Groups of
      :data:`CHUNKS_PER_GROUP` chunks.
    - Otherwise the layout of :data:`LAYOUT_COSTS` of lowest cost that fits the workspace
      (× FAST_FACTOR with ``chunk_size.fast``), rows × ``shards``; where none fits, the most rows
      that fit with :data:`CHUNKS_PER_GROUP` chunks per group, a multiple of 64 (default
      workspace: at least ``MIN_CHUNK_ROWS × shards``) or of 16 (explicit workspace: at least 1).
    """
    size = config.chunk_size
    factor = FAST_FACTOR if size.fast else 1
    explicit = config.workspace_mib is not None
    budget = (workspace_mib if config.workspace_mib is None else config.workspace_mib) * factor * (1 << 20)
    columns = max(local_vocab, 1)
    rows = max(total_rows, 1)
    # The most rows with CHUNKS_PER_GROUP chunks per group, and those as a multiple of 16 (at least 1).
    row_bytes = columns * (logit_bytes + CHUNKS_PER_GROUP * staged_bytes)
    fitting = budget // row_bytes if row_bytes else rows  # a chunk that keeps nothing per column: any rows fit
    fitting_16 = max(1, fitting - fitting % 16 if fitting >= 16 else fitting)
    # Rows × shards: a shard holds 1/tp of the columns, so a chunk does one device's work in the same memory.
    candidates = [(cost, RowLayout(chunk * shards, group * shards)) for (chunk, group), cost in LAYOUT_COSTS.items()]
    fits = [(cost, c) for cost, c in candidates if c.workspace_bytes(columns, logit_bytes, staged_bytes) <= budget]
    layout = min(fits, key=lambda fit: fit[0])[1] if fits else None
    if layout is None:
        chunk = fitting_16 if explicit else max(MIN_CHUNK_ROWS * factor * shards, fitting - fitting % 64)
        layout = RowLayout(chunk, chunk * CHUNKS_PER_GROUP)
    requested = None
    if size.nrows is not None:
        requested = size.nrows
    elif config.num_chunks is not None:
        requested = -(-rows // config.num_chunks)
    elif config.max_chunks is not None and -(-rows // layout.chunk_rows) > config.max_chunks:
        requested = -(-rows // config.max_chunks)
    if requested is not None:
        if explicit and size.dynamic:
            requested = min(requested, fitting_16)
        layout = RowLayout(requested, requested * CHUNKS_PER_GROUP)
    chunk = max(1, min(layout.chunk_rows, rows))
    group = layout.group_rows if staged_bytes > 0 else chunk  # nothing staged: a group is one chunk
    # A whole number of chunks, no more than the batch needs (at least one chunk).
    group = max(chunk, min(group - group % chunk, -(-total_rows // chunk) * chunk))
    return RowLayout(chunk_rows=chunk, group_rows=group)
