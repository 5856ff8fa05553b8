"""Hopper (sm_90) GEMMs in Gluon that store scaled exponentials instead of logits.

For a chunk of R rows of hidden states ``h`` (R, H) and a head ``W`` (C, H), both bf16, the logits
``s = h·Wᵀ`` are accumulated in fp32 per output tile of BM rows × BN columns and never written. Per
(row, column tile) the epilogue writes the tile's maximum ``m`` and ``Σ e^{s−m}`` (fp32), and per
element ``E = e^{s−m}`` (bf16, R × C). With two sides (``SIDES=2``: the student's ``h_s`` and the
teacher's ``h_t`` against the one W tile), it also writes the teacher's statistics and
``D = e^{t−m_t} − e^{s−m_s}``, formed in fp32 and stored bf16.

Outputs (the contract the probe checks):

- ``e`` (R, C) bf16: ``E``; ``d`` (R, C) bf16: ``D`` (two sides only);
- ``stats`` (2·SIDES, T, R) fp32 with T = ⌈C / BN⌉: ``stats[0, j, r]`` is the maximum of row r's
  logits over column tile j and ``stats[1, j, r]`` their ``Σ e^{s−m}``; ``stats[2]``, ``stats[3]``
  the teacher's. Rows are contiguous, so a tile's statistics are stored coalesced.

Columns past C (the last tile's, zero-filled by TMA) are −∞ before the maximum: they add 0 to the
sums and are never stored (TMA stores clip them). Rows past R are computed on zeros and not stored.

Kernels (persistent: one CTA per SM, each taking tiles ``pid, pid + #CTAs, …`` in grouped order,
GROUP_M row tiles walking the column tiles together so that a W tile is read from L2 by the group):

- ``exp_gemm_pipelined_kernel``: one partition; a ring of STAGES TMA buffers refilled one step
  behind the asynchronous wgmma, loads running ahead across tile boundaries; the epilogue is not
  overlapped with MMAs.
- ``exp_gemm_pingpong_kernel``: ``gl.warp_specialize`` with a one-warp TMA producer and two
  consumer warpgroups (the default partition and a worker) that take alternate tiles from the
  producer's ring: while one consumer's epilogue runs, the other runs its tile's wgmmas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.constexpr_function
def accumulator_layout(block_m: int, block_n: int, warps: int) -> gl.NVMMADistributedLayout:
    """The wgmma accumulator layout of a (block_m, block_n) fp32 tile over ``warps`` warps stacked
    along M (each warp 16 rows per repetition; one wgmma of N = block_n per 16-deep K step)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, block_n, 16])


@gluon.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """Grouped order: GROUP_M row tiles take the column tiles together (tile → (pid_m, pid_n))."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    in_group = tile % per_group
    return first_m + in_group % group_m, in_group // group_m


@gluon.jit
def _load_step(it, k_tiles, descs, bufs, ready, slot, pred, SIDES: gl.constexpr, GROUP_M: gl.constexpr):
    """TMA loads of this CTA's K step ``it`` (its tile ``it // k_tiles``) into ring slot ``slot``,
    completing ``ready[slot]``; nothing where ``pred`` is false. ``descs`` = (h_s, h_t, W)
    descriptors, ``bufs`` = their rings (h_t's read only with two sides)."""
    hs_desc, ht_desc, w_desc = descs
    a_bufs, t_bufs, w_bufs = bufs
    BM: gl.constexpr = hs_desc.block_type.shape[0]
    BK: gl.constexpr = hs_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    num_pid_m = gl.cdiv(hs_desc.shape[0], BM)
    num_pid_n = gl.cdiv(w_desc.shape[0], BN)
    tile = gl.program_id(0) + (it // k_tiles) * gl.num_programs(0)
    pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
    k = (it % k_tiles) * BK
    bar = ready.index(slot)
    mbarrier.expect(bar, SIDES * hs_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(hs_desc, [pid_m * BM, k], bar, a_bufs.index(slot), pred)
    if SIDES == 2:
        tma.async_copy_global_to_shared(ht_desc, [pid_m * BM, k], bar, t_bufs.index(slot), pred)
    tma.async_copy_global_to_shared(w_desc, [pid_n * BN, k], bar, w_bufs.index(slot), pred)


@gluon.jit
def _scaled_exp(acc, col_ok):
    """(m, e^{s−m}, Σ e^{s−m}) of one accumulator tile, columns where ``col_ok`` is false at −∞."""
    z = gl.where(col_ok[None, :], acc, float("-inf"))
    m = gl.max(z, axis=1)
    # e^{s−m} = 2^{s·log2e − m·log2e}: one FMA and one ex2 per element (the argument off by m·log2e's rounding)
    e = gl.exp2(z * LOG2E - (m * LOG2E)[:, None])
    return m, e, gl.sum(e, axis=1)


@gluon.jit
def _epilogue(acc_s, acc_t, pid_m, pid_n, R, C, e_desc, d_desc, stats_ptr, out_smem, SIDES: gl.constexpr):
    """Statistics and exponentials of one output tile (``acc_t`` read only with two sides): the
    statistics by plain stores, E (and D) as bf16 through ``out_smem`` (SIDES (BM, BN) staging
    tiles) by TMA stores, which clip rows and columns out of bounds."""
    BM: gl.constexpr = acc_s.shape[0]
    BN: gl.constexpr = acc_s.shape[1]
    layout: gl.constexpr = acc_s.type.layout
    num_col_tiles = gl.cdiv(C, BN)
    cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    rows = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    row_ok = rows < R
    m_s, e, l_s = _scaled_exp(acc_s, cols < C)
    gl.store(stats_ptr + pid_n * R + rows, m_s, mask=row_ok)
    gl.store(stats_ptr + (num_col_tiles + pid_n) * R + rows, l_s, mask=row_ok)
    tma.store_wait(pendings=0)  # the previous tile's TMA stores have read the staging tiles
    out_smem.index(0).store(e.to(gl.bfloat16))
    if SIDES == 2:
        m_t, p_t, l_t = _scaled_exp(acc_t, cols < C)
        gl.store(stats_ptr + (2 * num_col_tiles + pid_n) * R + rows, m_t, mask=row_ok)
        gl.store(stats_ptr + (3 * num_col_tiles + pid_n) * R + rows, l_t, mask=row_ok)
        # D in fp32 before its rounding: p_t ≈ e must not cancel in bf16
        out_smem.index(1).store((p_t - e).to(gl.bfloat16))
    fence_async_shared()  # the generic-proxy writes above, before the TMA engine reads the staging tiles
    tma.async_copy_shared_to_global(e_desc, [pid_m * BM, pid_n * BN], out_smem.index(0))
    if SIDES == 2:
        tma.async_copy_shared_to_global(d_desc, [pid_m * BM, pid_n * BN], out_smem.index(1))


@gluon.jit
def exp_gemm_pipelined_kernel(
    hs_desc,
    ht_desc,
    w_desc,
    e_desc,
    d_desc,
    stats_ptr,
    SIDES: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    num_warps: gl.constexpr,
):
    """One partition of ``num_warps`` warps (BM ≥ 16·num_warps); ``ht_desc``/``d_desc`` are read only
    with two sides."""
    BM: gl.constexpr = hs_desc.block_type.shape[0]
    BK: gl.constexpr = hs_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    layout: gl.constexpr = accumulator_layout(BM, BN, num_warps)
    R = hs_desc.shape[0]
    C = w_desc.shape[0]
    num_pid_m = gl.cdiv(R, BM)
    num_pid_n = gl.cdiv(C, BN)
    k_tiles = gl.cdiv(hs_desc.shape[1], BK)
    my_tiles = gl.cdiv(num_pid_m * num_pid_n - gl.program_id(0), gl.num_programs(0))
    total = my_tiles * k_tiles

    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], hs_desc.layout)
    t_bufs = a_bufs  # one side: never read
    if SIDES == 2:
        t_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], ht_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], w_desc.layout)
    out_smem = gl.allocate_shared_memory(gl.bfloat16, [SIDES, BM, BN], e_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    descs = (hs_desc, ht_desc, w_desc)
    bufs = (a_bufs, t_bufs, w_bufs)

    for p in gl.static_range(STAGES - 1):
        _load_step(p, k_tiles, descs, bufs, ready, p, p < total, SIDES, GROUP_M)

    acc_s = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
    if SIDES == 2:
        acc_t = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
    for it in range(total):
        slot = it % STAGES
        ki = it % k_tiles
        mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
        w_tile = w_bufs.index(slot).permute((1, 0))
        acc_s = warpgroup_mma(a_bufs.index(slot), w_tile, acc_s, use_acc=ki > 0, is_async=True)
        if SIDES == 2:
            acc_t = warpgroup_mma(t_bufs.index(slot), w_tile, acc_t, use_acc=ki > 0, is_async=True)
            acc_s, acc_t = warpgroup_mma_wait(num_outstanding=2, deps=(acc_s, acc_t))
        else:
            acc_s = warpgroup_mma_wait(num_outstanding=1, deps=(acc_s,))
        # the previous step's wgmmas are done: its slot takes step it + STAGES - 1
        ahead = it + STAGES - 1
        _load_step(ahead, k_tiles, descs, bufs, ready, ahead % STAGES, ahead < total, SIDES, GROUP_M)
        if ki == k_tiles - 1:
            tile = gl.program_id(0) + (it // k_tiles) * gl.num_programs(0)
            pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
            if SIDES == 2:
                acc_s, acc_t = warpgroup_mma_wait(num_outstanding=0, deps=(acc_s, acc_t))
                _epilogue(acc_s, acc_t, pid_m, pid_n, R, C, e_desc, d_desc, stats_ptr, out_smem, SIDES)
                acc_t = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
            else:
                acc_s = warpgroup_mma_wait(num_outstanding=0, deps=(acc_s,))
                _epilogue(acc_s, acc_s, pid_m, pid_n, R, C, e_desc, d_desc, stats_ptr, out_smem, SIDES)
            # a fresh accumulator, so that the finished one dies in the epilogue (use_acc=False ignores it)
            acc_s = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
    tma.store_wait(pendings=0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


@gluon.jit
def _producer(descs, ring, SIDES: gl.constexpr, GROUP_M: gl.constexpr):
    """The TMA partition: every K step of this CTA's tiles, in order, into the ring, each slot once
    its consumer has released it."""
    hs_desc, ht_desc, w_desc = descs
    bufs, ready, empty = ring
    STAGES: gl.constexpr = bufs[0].shape[0]
    BM: gl.constexpr = hs_desc.block_type.shape[0]
    BK: gl.constexpr = hs_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    k_tiles = gl.cdiv(hs_desc.shape[1], BK)
    num_tiles = gl.cdiv(hs_desc.shape[0], BM) * gl.cdiv(w_desc.shape[0], BN)
    my_tiles = gl.cdiv(num_tiles - gl.program_id(0), gl.num_programs(0))
    for it in range(my_tiles * k_tiles):
        slot = it % STAGES
        # an mbarrier starts with its phase before phase 0 complete: the first pass over the ring waits on nothing
        mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
        _load_step(it, k_tiles, descs, bufs, ready, slot, True, SIDES, GROUP_M)


@gluon.jit
def _consumer(
    hs_desc,
    w_desc,
    e_desc,
    d_desc,
    stats_ptr,
    ring,
    out_smem,
    FIRST: gl.constexpr,
    SIDES: gl.constexpr,
    GROUP_M: gl.constexpr,
):
    """One consumer warpgroup: tiles FIRST, FIRST + 2, … of this CTA's sequence, each slot released
    as soon as the wgmmas reading it are done, then the tile's epilogue."""
    bufs, ready, empty = ring
    a_bufs, t_bufs, w_bufs = bufs
    STAGES: gl.constexpr = a_bufs.shape[0]
    BM: gl.constexpr = hs_desc.block_type.shape[0]
    BK: gl.constexpr = hs_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    layout: gl.constexpr = accumulator_layout(BM, BN, 4)
    R = hs_desc.shape[0]
    C = w_desc.shape[0]
    num_pid_m = gl.cdiv(R, BM)
    num_pid_n = gl.cdiv(C, BN)
    k_tiles = gl.cdiv(hs_desc.shape[1], BK)
    my_tiles = gl.cdiv(num_pid_m * num_pid_n - gl.program_id(0), gl.num_programs(0))

    acc_s = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
    if SIDES == 2:
        acc_t = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
    for j in range(FIRST, my_tiles, 2):
        for ki in range(k_tiles):
            it = j * k_tiles + ki
            slot = it % STAGES
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            w_tile = w_bufs.index(slot).permute((1, 0))
            acc_s = warpgroup_mma(a_bufs.index(slot), w_tile, acc_s, use_acc=ki > 0, is_async=True)
            if SIDES == 2:
                acc_t = warpgroup_mma(t_bufs.index(slot), w_tile, acc_t, use_acc=ki > 0, is_async=True)
                acc_s, acc_t = warpgroup_mma_wait(num_outstanding=2, deps=(acc_s, acc_t))
            else:
                acc_s = warpgroup_mma_wait(num_outstanding=1, deps=(acc_s,))
            # the previous step's wgmmas are done: its slot goes back to the producer
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=ki > 0)
        last = (j * k_tiles + k_tiles - 1) % STAGES
        tile = gl.program_id(0) + j * gl.num_programs(0)
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        if SIDES == 2:
            acc_s, acc_t = warpgroup_mma_wait(num_outstanding=0, deps=(acc_s, acc_t))
            mbarrier.arrive(empty.index(last))
            _epilogue(acc_s, acc_t, pid_m, pid_n, R, C, e_desc, d_desc, stats_ptr, out_smem, SIDES)
            acc_t = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
        else:
            acc_s = warpgroup_mma_wait(num_outstanding=0, deps=(acc_s,))
            mbarrier.arrive(empty.index(last))
            _epilogue(acc_s, acc_s, pid_m, pid_n, R, C, e_desc, d_desc, stats_ptr, out_smem, SIDES)
        acc_s = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
    tma.store_wait(pendings=0)


@gluon.jit
def exp_gemm_pingpong_kernel(
    hs_desc,
    ht_desc,
    w_desc,
    e_desc,
    d_desc,
    stats_ptr,
    SIDES: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Warp-specialized: the default partition (num_warps = 4, one warpgroup) and a 4-warp worker
    are the two consumers, each a BM × BN tile (BM a multiple of 64), a 1-warp worker the TMA
    producer; ``ht_desc``/``d_desc`` are read only with two sides. Launch with ``maxnreg`` such that
    the three warpgroups' 3·128·maxnreg registers fit the SM's 65,536: the workers then take
    CONSUMER_REGS and PRODUCER_REGS per thread, the default partition what is left."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    BM: gl.constexpr = hs_desc.block_type.shape[0]
    BK: gl.constexpr = hs_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], hs_desc.layout)
    t_bufs = a_bufs  # one side: never read
    if SIDES == 2:
        t_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], ht_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], w_desc.layout)
    out_first = gl.allocate_shared_memory(gl.bfloat16, [SIDES, BM, BN], e_desc.layout)
    out_second = gl.allocate_shared_memory(gl.bfloat16, [SIDES, BM, BN], e_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)

    ring = ((a_bufs, t_bufs, w_bufs), ready, empty)
    gl.warp_specialize(
        [
            (_consumer, (hs_desc, w_desc, e_desc, d_desc, stats_ptr, ring, out_first, 0, SIDES, GROUP_M)),
            (_consumer, (hs_desc, w_desc, e_desc, d_desc, stats_ptr, ring, out_second, 1, SIDES, GROUP_M)),
            (_producer, ((hs_desc, ht_desc, w_desc), ring, SIDES, GROUP_M)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------

# The ping-pong kernel's 4 + 4 + 1 warps take three warpgroups: 3·128 threads × 168 registers fill
# the SM's 65,536, which its partitions then share as 232 (each consumer) + 40 (the producer).
PINGPONG_MAXNREG = 168
CONSUMER_REGS = 232
PRODUCER_REGS = 40
SMEM_LIMIT = 232448  # bytes of shared memory one CTA may have on sm_90 (227 KiB)


@dataclass(frozen=True)
class Variant:
    """One kernel configuration: ``kind`` "pipelined" (one partition of ``warps`` warps) or
    "pingpong" (warp-specialized, each consumer warpgroup a BM × BN tile); ``sides`` 1 (E) or 2
    (E and D); statistics per BN columns."""

    kind: str
    sides: int
    bm: int
    bn: int
    stages: int
    warps: int = 4
    bk: int = 64
    group_m: int = 8

    @property
    def name(self) -> str:
        warps = f"w{self.warps}" if self.kind == "pipelined" else "ws"
        return f"{self.kind}/{self.sides}side/{self.bm}x{self.bn}x{self.bk}/s{self.stages}{warps}"

    @property
    def kernel(self) -> Any:
        return exp_gemm_pipelined_kernel if self.kind == "pipelined" else exp_gemm_pingpong_kernel


VARIANTS = (
    Variant("pipelined", 1, 128, 128, 4),
    Variant("pipelined", 1, 128, 256, 3, warps=8),
    Variant("pingpong", 1, 128, 128, 4),
    Variant("pingpong", 1, 128, 128, 5),
    Variant("pingpong", 1, 64, 256, 4),
    Variant("pipelined", 2, 128, 128, 3, warps=8),
    Variant("pingpong", 2, 64, 128, 4),
    Variant("pingpong", 2, 64, 128, 5),
)


@dataclass
class Outputs:
    """What a variant writes for a chunk of R rows and C columns (the module's contract)."""

    e: Tensor  # (R, C) bf16
    d: Tensor | None  # (R, C) bf16, two sides only
    stats: Tensor  # (2·sides, ⌈C/BN⌉, R) fp32

    @staticmethod
    def empty(variant: Variant, rows: int, columns: int, device: torch.device) -> Outputs:
        tiles = -(-columns // variant.bn)
        e = torch.empty(rows, columns, dtype=torch.bfloat16, device=device)
        d = torch.empty_like(e) if variant.sides == 2 else None
        return Outputs(e, d, torch.empty(2 * variant.sides, tiles, rows, device=device))

    def poison(self) -> None:
        """NaN everywhere, so that an element left unwritten fails the comparison."""
        for tensor in (self.e, self.d, self.stats):
            if tensor is not None:
                tensor.fill_(float("nan"))


def _descriptor(tensor: Tensor, block: list[int]) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(tensor, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))


def launch_arguments(
    variant: Variant, h_s: Tensor, h_t: Tensor | None, weight: Tensor, out: Outputs
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments of one launch (tensors on any device: the compile-only
    path builds them on the CPU). ``h_t`` and ``out.d`` are read only with two sides."""
    if variant.sides == 2 and (h_t is None or out.d is None):
        raise ValueError("a two-sided variant needs h_t and out.d")
    hs_desc = _descriptor(h_s, [variant.bm, variant.bk])
    ht_desc = _descriptor(h_t, [variant.bm, variant.bk]) if variant.sides == 2 and h_t is not None else hs_desc
    e_desc = _descriptor(out.e, [variant.bm, variant.bn])
    d_desc = _descriptor(out.d, [variant.bm, variant.bn]) if out.d is not None else e_desc
    args = (hs_desc, ht_desc, _descriptor(weight, [variant.bn, variant.bk]), e_desc, d_desc, out.stats)
    kwargs: dict[str, Any] = {"SIDES": variant.sides, "STAGES": variant.stages, "GROUP_M": variant.group_m}
    if variant.kind == "pingpong":
        kwargs.update(CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, maxnreg=PINGPONG_MAXNREG)
    kwargs["num_warps"] = variant.warps
    return args, kwargs


def launcher(
    variant: Variant, h_s: Tensor, h_t: Tensor | None, weight: Tensor, out: Outputs, num_ctas: int
) -> Callable[[], Any]:
    """One launch with its descriptors built once, on at most ``num_ctas`` persistent CTAs; each call
    returns the compiled kernel."""
    tiles = -(-h_s.shape[0] // variant.bm) * -(-weight.shape[0] // variant.bn)
    grid = (min(num_ctas, tiles),)
    args, kwargs = launch_arguments(variant, h_s, h_t, weight, out)
    kernel = variant.kernel

    def launch() -> Any:
        return kernel[grid](*args, **kwargs)

    return launch
