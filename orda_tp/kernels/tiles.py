"""Tile shapes of the kernels (``BLOCK_R × BLOCK_C``, and the programs the column splits aim at),
keyed on the bucket of a block's columns, never on its row count, so a new sequence length neither
re-tunes nor recompiles; the CUDA entries chosen by ``benchmarks/tune_kernels.py`` on an H200.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CUDA_TILES", "HALF_PRECISION_TILES", "INTERPRETED", "SPARSE_TEACHER_TILES", "Tiles"]


@dataclass(frozen=True)
class Tiles:
    block_r: int
    block_c: int
    num_warps: int
    programs: int  # how many programs the column splits aim at


INTERPRETED = Tiles(block_r=16, block_c=128, num_warps=4, programs=256)  # small: CPU tests stay quick

#: (kernel kind, wide block: at least 2**15 columns) -> tiles on a CUDA device. Measured on an H200
#: (benchmarks/tune_kernels.py, 256 rows of fp32 logits, 16064 / 128256 / 256000 columns): the wide
#: entries move 2.7 (partition), 3.4 (sums) and 3.4 (grads) TB/s at 128256 columns.
CUDA_TILES: dict[tuple[str, bool], Tiles] = {
    ("partition", True): Tiles(block_r=1, block_c=2048, num_warps=4, programs=528),
    ("sums", True): Tiles(block_r=1, block_c=2048, num_warps=8, programs=528),
    ("grads", True): Tiles(block_r=16, block_c=128, num_warps=8, programs=528),
    ("partition", False): Tiles(block_r=8, block_c=512, num_warps=8, programs=1056),
    ("sums", False): Tiles(block_r=1, block_c=2048, num_warps=4, programs=1056),
    ("grads", False): Tiles(block_r=8, block_c=256, num_warps=8, programs=528),
}

#: Entries that replace CUDA_TILES' where the student's logits are stored in 2 bytes (bf16/fp16
#: logits given to ``KDLoss``): half the bytes per element, so more work per byte. Measured on an
#: H200 with ``benchmarks/tune_kernels.py --dtype bf16 --rows 8192 --cols 128256,256000 --kinds
#: partition,grads --programs 528`` (the whole batch in one chunk): partition 1.67 ms (2.52 TB/s)
#: against 1.91 ms with CUDA_TILES' entry at 128256 columns, grads 3.5 TB/s.
HALF_PRECISION_TILES: dict[tuple[str, bool], Tiles] = {
    ("partition", True): Tiles(block_r=16, block_c=128, num_warps=8, programs=528),
    ("grads", True): Tiles(block_r=2, block_c=1024, num_warps=8, programs=528),
}

#: Entries that replace CUDA_TILES' where the teacher is a top-k cache's rows
#: (``orda_tp.teachers.source.SparseLogits``): the gradient kernel puts a row's listed values into
#: each tile, one compare-and-select per listed id, while any row of the tile has one left inside
#: it; one-row tiles need no reduction across rows for that. Measured on an H200 (BT = 8192,
#: H = 4096, V = 128256, bf16, top-64 cache, two runs): 45.9–46.5 ms per call against 46.8–47.6 ms
#: with CUDA_TILES' 16 × 128; the dense cache and tied KD unchanged within 0.3 ms with this tile.
SPARSE_TEACHER_TILES: dict[tuple[str, bool], Tiles] = {
    ("grads", True): Tiles(block_r=1, block_c=2048, num_warps=4, programs=528),
}
