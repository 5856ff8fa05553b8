"""Can a Triton GEMM that stores scaled exponentials be as fast as cuBLAS storing fp32 logits?

The loss engine forms a tied head's student and teacher logits per chunk of R tokens in one cuBLAS
GEMM, ``logits_mm(cat([h_s, h_t]), W, float32)``: a (2R, C) fp32 tensor from (R, H) bf16 hidden
states and a (C, H) bf16 head. This probe times, for the same rows, a persistent TMA Triton GEMM
(the form of Triton's tutorial 09-persistent-matmul.py) whose epilogue writes, per output tile of
BM/2 tokens × BN columns (z_s = h_s·Wᵀ, z_t = h_t·Wᵀ accumulated in fp32):

- E = exp(z_s − m_s) and D = exp(z_t − m_t) − E, formed in fp32, stored as bf16 into (R, C) tensors,
  where m_s, m_t are each row's max over the tile's columns;
- per (row, column tile) fp32 statistics (m_s, m_t, Σ exp(z_s − m_s), Σ exp(z_t − m_t)) into an
  (R, n_col_tiles, 4) tensor;
- optionally (``+labels``) the label logits z_s[r, labels[r]], z_t[r, labels[r]] into (R, 2) fp32,
  written by the one tile that holds column labels[r].

The exponentials are exp2(z·log2e − m·log2e) (one FMA and one exp2 per element). Columns past C in
the last tile are -inf: they add 0 to the sums, never win the max, and are not stored.

How the two sides share the tensor cores (``--pairing``), the point of the probe:

- ``interleave8``: one accumulator over a pre-interleaved (2R, H) A operand, rows in groups of 16
  (8 student rows, then the same 8 tokens' teacher rows). On Hopper's wgmma accumulator layout a
  thread holds rows i and i + 8 of each 16, so the student and the teacher value of one (token,
  column) sit in the same thread; the epilogue splits them with reshape/permute/split.
- ``halves``: one accumulator; a tile's first BM/2 rows are students, the last BM/2 the same
  tokens' teachers (A grouped by BM/2 rows, so its layout depends on the tile height).
- ``two_acc``: two (BM/2, BN) accumulators, the student and the teacher tiles loaded separately,
  sharing the W tile (the earlier probe's form, 0.75-0.79 × cuBLAS).

The interleave copies (building A from h_s and h_t) are outside the kernels' times; they are timed
on their own, beside the engine's ``torch.cat``. E/D are stored by TMA store descriptors
(``tma``) or by masked ``tl.store`` (``ptr``).

Baselines per chunk shape: cuBLAS fp32-out (``orda_tp.engine.logits.logits_mm``, as the engine
runs it) and cuBLAS bf16-out (``torch.mm``) on ``cat([h_s, h_t])``. TFLOP/s count 2·2R·H·C; the
ratios are speed ratios (cuBLAS time / this time: above 1 is faster than cuBLAS). The gate per
shape: the best fused time ≤ the fp32-out time, printed for the fused kernels without and with
the label logits. Times: CUDA events around each of 10 calls issued back to back after 3 warm-ups,
the median.

Every kernel variant (pairing × tile config × labels × store) is checked first at a small shape
(R=256, H=256, C=1008: a partial last column tile, divisible by 16 so that the timed shapes reuse
the compiled kernels) against an fp64 torch reference; one that fails to compile, runs out of
shared memory or fails the check is reported and not timed. Each compiled variant's shared memory,
registers, spills and the number of layout conversions in its TTGIR are printed beside its check
(compare the pairings' counts to see what the in-register split costs). Results go to ``--out`` as
fused_logits_probe.json (written again after every row, so an aborted run keeps what it had).

Commands (from the repository root):
  python3 benchmarks/fused_logits_probe.py --out $OUT                       # an H100/H200
  python3 benchmarks/fused_logits_probe.py --small                          # the check alone, GPU
  TRITON_INTERPRET=1 python3 benchmarks/fused_logits_probe.py --small --device cpu   # interpreter
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orda_tp.engine.logits import logits_mm  # noqa: E402

PAIRINGS = {"interleave8": 0, "halves": 1, "two_acc": 2}
STORES = ("tma", "ptr")
HEADS = ((4096, 128256), (2304, 256000))  # (H, C)
CHUNK_ROWS = (512, 1024, 2048)  # R tokens per chunk (2R GEMM rows)
SMALL = (256, 256, 1008)  # (R, H, C) of the correctness check
SMEM_LIMIT = 227 * 1024  # bytes of shared memory a Hopper block may have
WARMUPS, REPEATS = 3, 10
LOG2E = tl.constexpr(1.4426950408889634)  # a constexpr: a @triton.jit function may read it


@dataclass(frozen=True)
class TileConfig:
    """One output tile of BM GEMM rows (BM/2 tokens per side) × BN columns, BK deep per K step."""

    bm: int
    bn: int
    bk: int
    stages: int
    warps: int
    group_m: int = 8

    @property
    def name(self) -> str:
        return f"{self.bm}x{self.bn}x{self.bk}s{self.stages}w{self.warps}"

    @property
    def pipeline_smem(self) -> int:
        """Shared memory of the K loop's bf16 A and W tiles over its stages (the epilogue's not counted)."""
        return (self.bm * self.bk + self.bn * self.bk) * 2 * self.stages


CONFIGS = (
    TileConfig(128, 256, 64, 3, 8),
    TileConfig(128, 256, 64, 4, 8),
    TileConfig(256, 128, 64, 3, 8),
    TileConfig(128, 128, 64, 4, 8),
    TileConfig(128, 128, 64, 4, 4),
    TileConfig(256, 256, 64, 3, 8),
)


@dataclass(frozen=True)
class Variant:
    pairing: str
    config: TileConfig
    labels: bool
    store: str

    @property
    def name(self) -> str:
        return f"{self.pairing}/{self.config.name}/{self.store}{'+labels' if self.labels else ''}"


@dataclass
class Outputs:
    """What the fused kernel writes for a chunk of R tokens."""

    e: Tensor  # (R, C) bf16: exp(z_s - m_s)
    d: Tensor  # (R, C) bf16: exp(z_t - m_t) - E
    stats: Tensor  # (R, n_col_tiles, 4) fp32: m_s, m_t, Σ exp(z_s - m_s), Σ exp(z_t - m_t)
    label_logits: Tensor  # (R, 2) fp32: z_s, z_t at each row's label

    @staticmethod
    def empty(rows: int, columns: int, bn: int, device: torch.device) -> Outputs:
        tiles = triton.cdiv(columns, bn)
        return Outputs(
            e=torch.empty(rows, columns, device=device, dtype=torch.bfloat16),
            d=torch.empty(rows, columns, device=device, dtype=torch.bfloat16),
            stats=torch.empty(rows, tiles, 4, device=device),
            label_logits=torch.empty(rows, 2, device=device),
        )

    def poison(self) -> None:
        """NaN everywhere, so that an element the kernel leaves unwritten fails the check."""
        for tensor in (self.e, self.d, self.stats, self.label_logits):
            tensor.fill_(float("nan"))


@dataclass
class Report:
    """Everything the run found, written as JSON after every row."""

    meta: dict[str, Any]
    checks: list[dict[str, Any]] = field(default_factory=list)
    copies: list[dict[str, Any]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    gates: list[dict[str, Any]] = field(default_factory=list)
    path: Path | None = None

    def save(self) -> None:
        if self.path is not None:
            body = {name: value for name, value in vars(self).items() if name != "path"}
            self.path.write_text(json.dumps(body, indent=1))


# ---------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def _tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_SIZE_M: tl.constexpr):
    """Grouped ordering (tutorial 09): GROUP_SIZE_M row tiles walk the column tiles together, so
    that a W tile is read from L2 by the whole group."""
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _split_sides(acc, PAIRING: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """The student and the teacher half of a paired (BM, BN) accumulator, each (BM/2, BN), rows in
    token order."""
    if PAIRING == 0:
        # rows 16g + i (student) and 16g + 8 + i (teacher) are token 8g + i
        sides = tl.permute(tl.reshape(acc, (BM // 16, 2, 8, BN)), (0, 2, 3, 1))
        z_s, z_t = tl.split(sides)
        z_s = tl.reshape(z_s, (BM // 2, BN))
        z_t = tl.reshape(z_t, (BM // 2, BN))
    else:
        # rows i (student) and BM/2 + i (teacher) are token i
        sides = tl.permute(tl.reshape(acc, (2, BM // 2, BN)), (1, 2, 0))
        z_s, z_t = tl.split(sides)
    return z_s, z_t


@triton.jit
def _exp_epilogue(
    z_s,
    z_t,
    pid_m,
    pid_n,
    R,
    C,
    e_desc,
    d_desc,
    e_ptr,
    d_ptr,
    stats_ptr,
    labels_ptr,
    label_logits_ptr,
    TOK: tl.constexpr,
    BN: tl.constexpr,
    LABELS: tl.constexpr,
    TMA_STORE: tl.constexpr,
):
    """E, D, the tile's statistics and (LABELS) the label logits of one (TOK, BN) output tile."""
    tokens = pid_m * TOK + tl.arange(0, TOK)
    columns = pid_n * BN + tl.arange(0, BN)
    row_ok = tokens < R
    col_ok = columns < C
    # columns past C: -inf, so exp gives 0 and the max ignores them
    z_s = tl.where(col_ok[None, :], z_s, float("-inf"))
    z_t = tl.where(col_ok[None, :], z_t, float("-inf"))
    m_s = tl.max(z_s, axis=1)
    m_t = tl.max(z_t, axis=1)
    # exp(z - m) = 2^(z·log2e - m·log2e): an FMA and an exp2; the max's own term is exactly 2^0
    e = tl.exp2(z_s * LOG2E - (m_s * LOG2E)[:, None])
    p_t = tl.exp2(z_t * LOG2E - (m_t * LOG2E)[:, None])
    sum_s = tl.sum(e, axis=1)
    sum_t = tl.sum(p_t, axis=1)
    d = p_t - e  # in fp32, before the rounding to bf16

    if TMA_STORE:
        e_desc.store([pid_m * TOK, pid_n * BN], e.to(tl.bfloat16))  # the copy engine clips rows/columns out of bounds
        d_desc.store([pid_m * TOK, pid_n * BN], d.to(tl.bfloat16))
    else:
        offsets = tokens.to(tl.int64)[:, None] * C + columns[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        tl.store(e_ptr + offsets, e.to(tl.bfloat16), mask=mask)
        tl.store(d_ptr + offsets, d.to(tl.bfloat16), mask=mask)

    stats = stats_ptr + (tokens.to(tl.int64) * tl.cdiv(C, BN) + pid_n) * 4
    tl.store(stats, m_s, mask=row_ok)
    tl.store(stats + 1, m_t, mask=row_ok)
    tl.store(stats + 2, sum_s, mask=row_ok)
    tl.store(stats + 3, sum_t, mask=row_ok)

    if LABELS:
        labels = tl.load(labels_ptr + tokens, mask=row_ok, other=-1)
        hit = columns[None, :] == labels[:, None]  # at most one column per row, never a masked one
        mine = row_ok & (labels >= pid_n * BN) & (labels < pid_n * BN + BN)
        label_logits = label_logits_ptr + tokens.to(tl.int64) * 2
        tl.store(label_logits, tl.sum(tl.where(hit, z_s, 0.0), axis=1), mask=mine)
        tl.store(label_logits + 1, tl.sum(tl.where(hit, z_t, 0.0), axis=1), mask=mine)


@triton.jit
def fused_exp_kernel(
    a_desc,
    t_desc,
    w_desc,
    e_desc,
    d_desc,
    e_ptr,
    d_ptr,
    stats_ptr,
    labels_ptr,
    label_logits_ptr,
    R,
    C,
    H,
    PAIRING: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    NUM_SMS: tl.constexpr,
    LABELS: tl.constexpr,
    TMA_STORE: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    """Persistent over output tiles (tutorial 09's descriptor-persistent matmul). PAIRING 0/1: a_desc
    reads the paired (2R, H) operand in (BM, BK) tiles (t_desc unused); PAIRING 2: a_desc reads h_s
    and t_desc h_t, each in (BM/2, BK) tiles. w_desc reads W (C, H) in (BN, BK) tiles."""
    TOK: tl.constexpr = BM // 2
    start_pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(R, TOK)
    num_pid_n = tl.cdiv(C, BN)
    k_tiles = tl.cdiv(H, BK)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    # the epilogue recomputes its tile from its own counter (as the tutorial does), so that the
    # flattened loop's prologue and epilogue share no value
    tile_id_c = start_pid - NUM_SMS

    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_SIZE_M)
        off_n = pid_n * BN
        if PAIRING == 2:
            acc_s = tl.zeros((TOK, BN), dtype=tl.float32)
            acc_t = tl.zeros((TOK, BN), dtype=tl.float32)
            for ki in range(k_tiles):
                w = w_desc.load([off_n, ki * BK])
                acc_s = tl.dot(a_desc.load([pid_m * TOK, ki * BK]), w.T, acc_s)
                acc_t = tl.dot(t_desc.load([pid_m * TOK, ki * BK]), w.T, acc_t)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for ki in range(k_tiles):
                acc = tl.dot(a_desc.load([pid_m * BM, ki * BK]), w_desc.load([off_n, ki * BK]).T, acc)

        tile_id_c += NUM_SMS
        pid_m, pid_n = _tile_coords(tile_id_c, num_pid_in_group, num_pid_m, GROUP_SIZE_M)
        if PAIRING == 2:
            z_s, z_t = acc_s, acc_t
        else:
            z_s, z_t = _split_sides(acc, PAIRING, BM, BN)
        _exp_epilogue(
            z_s, z_t, pid_m, pid_n, R, C, e_desc, d_desc, e_ptr, d_ptr, stats_ptr, labels_ptr, label_logits_ptr,
            TOK, BN, LABELS, TMA_STORE,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


def pairing_group(pairing: str, bm: int) -> int:
    """Rows of one side that sit together in the paired A operand."""
    return 8 if pairing == "interleave8" else bm // 2


def kernel_operands(h_s: Tensor, h_t: Tensor, pairing: str, bm: int) -> tuple[Tensor, Tensor]:
    """The kernel's A operand(s): h_s and h_t as they are for two_acc; else one (2R, H) tensor of
    groups of ``pairing_group`` student rows, each followed by the same tokens' teacher rows."""
    if pairing == "two_acc":
        return h_s, h_t
    rows, hidden = h_s.shape
    group = pairing_group(pairing, bm)
    if rows % group:
        raise ValueError(f"{pairing} needs R divisible by {group}, got R={rows}")
    paired = torch.stack([h_s.view(rows // group, group, hidden), h_t.view(rows // group, group, hidden)], dim=1)
    return paired.view(2 * rows, hidden), paired.view(2 * rows, hidden)


def fused_launcher(
    variant: Variant,
    a_s: Tensor,
    a_t: Tensor,
    weight: Tensor,
    labels: Tensor,
    out: Outputs,
    num_sms: int,
    flatten: bool,
) -> Callable[[], object]:
    """One launch of the fused kernel with its descriptors built once; it returns the compiled kernel
    (None under the interpreter)."""
    cfg = variant.config
    rows, columns, hidden = out.e.shape[0], weight.shape[0], weight.shape[1]
    a_rows = cfg.bm // 2 if variant.pairing == "two_acc" else cfg.bm
    a_desc = TensorDescriptor.from_tensor(a_s, [a_rows, cfg.bk])
    t_desc = TensorDescriptor.from_tensor(a_t, [a_rows, cfg.bk])
    w_desc = TensorDescriptor.from_tensor(weight, [cfg.bn, cfg.bk])
    e_desc = TensorDescriptor.from_tensor(out.e, [cfg.bm // 2, cfg.bn])
    d_desc = TensorDescriptor.from_tensor(out.d, [cfg.bm // 2, cfg.bn])
    tiles = triton.cdiv(rows, cfg.bm // 2) * triton.cdiv(columns, cfg.bn)
    grid = (min(num_sms, tiles),)

    def launch() -> object:
        return fused_exp_kernel[grid](
            a_desc, t_desc, w_desc, e_desc, d_desc, out.e, out.d, out.stats, labels, out.label_logits,
            rows, columns, hidden,
            PAIRING=PAIRINGS[variant.pairing], BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_SIZE_M=cfg.group_m,
            NUM_SMS=num_sms, LABELS=variant.labels, TMA_STORE=variant.store == "tma", FLATTEN=flatten,
            num_warps=cfg.warps, num_stages=cfg.stages,
        )  # fmt: skip

    return launch


def operand_dtype(device: torch.device) -> torch.dtype:
    """bf16 on the GPU. Under the interpreter the same bf16 values are held in fp32: its tl.dot
    multiplies bf16 operands' raw uint16 bits (Triton 3.6/3.7 interpreter: create_dot converts fp8
    operands, not bf16), while an fp32 dot of bf16 values gives the bf16 GEMM's exact products."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def chunk_inputs(rows: int, hidden: int, columns: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Fresh h_s, h_t (R, H) and W (C, H) of bf16 values (logits of standard deviation about 2), and
    labels (R,), two of them in the last, partial column tile."""
    dtype = operand_dtype(device)
    h_s = torch.randn(rows, hidden, device=device).bfloat16().to(dtype)
    h_t = torch.randn(rows, hidden, device=device).bfloat16().to(dtype)
    weight = (torch.randn(columns, hidden, device=device) * 2 * hidden**-0.5).bfloat16().to(dtype)
    labels = torch.randint(0, columns, (rows,), device=device)
    labels[0], labels[1] = columns - 1, columns - 5
    return h_s, h_t, weight, labels


# ---------------------------------------------------------------------------------------------
# Correctness
# ---------------------------------------------------------------------------------------------


def reference(h_s: Tensor, h_t: Tensor, weight: Tensor, labels: Tensor, bn: int) -> dict[str, Tensor]:
    """The kernel's outputs in fp64 from the same bf16 inputs (exact products, so only the order of
    the fp32 sums separates the kernel from this)."""
    w = weight.double()
    rows, columns = h_s.shape[0], weight.shape[0]
    tiles = triton.cdiv(columns, bn)

    def per_tile(z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        padded = torch.nn.functional.pad(z, (0, tiles * bn - columns), value=float("-inf")).view(rows, tiles, bn)
        m = padded.amax(dim=-1)
        p = torch.exp(padded - m[..., None])
        return m, p.sum(dim=-1), p.view(rows, tiles * bn)[:, :columns]

    z_s, z_t = h_s.double() @ w.T, h_t.double() @ w.T
    m_s, sum_s, e = per_tile(z_s)
    m_t, sum_t, p_t = per_tile(z_t)
    at_label = torch.stack([z_s.gather(1, labels[:, None]), z_t.gather(1, labels[:, None])], dim=-1).view(rows, 2)
    return {
        "m": torch.stack([m_s, m_t], -1),
        "sums": torch.stack([sum_s, sum_t], -1),
        "e": e,
        "d": p_t - e,
        "p_t": p_t,
        "label_logits": at_label,
    }


def worst(error: Tensor, bound: Tensor) -> tuple[bool, float]:
    """Whether every |error| is within its bound (NaN fails), and the largest error/bound."""
    ratio = error.abs() / bound
    ok = bool((error.abs() <= bound).all())
    return ok, float(ratio.nan_to_num(float("inf")).max())


def bf16_rounding(device: torch.device) -> float:
    """The relative error of rounding fp32 to bf16: half an ulp (2^-8, 3.9e-3) on the GPU, which
    rounds to nearest; a whole ulp (2^-7) under the interpreter, whose fp32 -> bf16 cast without a
    rounding mode truncates (Triton 3.6/3.7 interpreter, _convert_float)."""
    return 4e-3 if device.type == "cuda" else 8e-3


def compare(out: Outputs, ref: dict[str, Tensor], labels: bool) -> dict[str, tuple[bool, float]]:
    """Each output against its tolerance: m |Δ| ≤ 1e-4 + 1e-5·|m|; sums 1e-4 relative; E, D within
    bf16 rounding ρ (|ΔE| ≤ ρ·|E| + 1e-6, |ΔD| ≤ ρ·max(exp(z_t − m_t), |E|) + 1e-6); label logits
    1e-4 relative plus 1e-4 absolute (as m: a logit can be near 0)."""
    m, sums = out.stats[..., :2].double(), out.stats[..., 2:].double()
    e, d = out.e.double(), out.d.double()
    rho = bf16_rounding(out.e.device)
    found = {
        "m": worst(m - ref["m"], 1e-4 + 1e-5 * ref["m"].abs()),
        "sums": worst(sums - ref["sums"], 1e-4 * ref["sums"].abs()),
        "e": worst(e - ref["e"], rho * ref["e"].abs() + 1e-6),
        "d": worst(d - ref["d"], rho * torch.maximum(ref["p_t"], ref["e"].abs()) + 1e-6),
    }
    if labels:
        got = out.label_logits.double()
        found["label_logits"] = worst(got - ref["label_logits"], 1e-4 + 1e-4 * ref["label_logits"].abs())
    return found


def kernel_resources(compiled: Any) -> dict[str, int]:
    """What the compiler made of a variant: shared memory, registers and spills per thread, and the
    layout conversions in its TTGIR (the paired epilogue's split may add some); empty under the
    interpreter."""
    asm = getattr(compiled, "asm", None)
    if not asm:
        return {}
    return {
        "smem_kb": compiled.metadata.shared // 1024,
        "regs": getattr(compiled, "n_regs", -1),
        "spills": getattr(compiled, "n_spills", -1),
        "convert_layouts": asm["ttgir"].count("ttg.convert_layout"),
    }


def check_variant(
    variant: Variant, device: torch.device, num_sms: int, flatten: bool
) -> tuple[bool, str, dict[str, int]]:
    """Run one variant at the small shape on fresh inputs and compare; (passed, what was found, its
    kernel's resources)."""
    rows, hidden, columns = SMALL
    h_s, h_t, weight, labels = chunk_inputs(rows, hidden, columns, device)
    a_s, a_t = kernel_operands(h_s, h_t, variant.pairing, variant.config.bm)
    out = Outputs.empty(rows, columns, variant.config.bn, device)
    out.poison()
    resources = kernel_resources(fused_launcher(variant, a_s, a_t, weight, labels, out, num_sms, flatten)())
    found = compare(out, reference(h_s, h_t, weight, labels, variant.config.bn), variant.labels)
    passed = all(ok for ok, _ in found.values())
    detail = " ".join(f"{k}:{'ok' if ok else 'FAIL'}({r:.2g})" for k, (ok, r) in found.items())
    return passed, detail, resources


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


def check_all(
    variants: list[Variant], device: torch.device, num_sms: int, flatten: bool, report: Report
) -> list[Variant]:
    """The variants that compile, fit and pass the check, each reported as it goes."""
    print(f"== correctness at R={SMALL[0]} H={SMALL[1]} C={SMALL[2]} (fp64 reference; worst error/bound in brackets)")
    passing = []
    for variant in variants:
        cfg = variant.config
        started = time.perf_counter()
        resources: dict[str, int] = {}
        if cfg.pipeline_smem > SMEM_LIMIT:
            status, detail = "skipped", f"pipeline needs {cfg.pipeline_smem // 1024} KB > {SMEM_LIMIT // 1024} KB"
        else:
            try:
                passed, detail, resources = check_variant(variant, device, num_sms, flatten)
                status = "pass" if passed else "FAIL"
            except Exception as error:  # a compile error, out of shared memory/registers, a bad launch
                status, detail = "failed", first_line(error)
        seconds = time.perf_counter() - started
        built = " ".join(f"{k}={v}" for k, v in resources.items())
        print(f"{variant.name:44s} {status:7s} {seconds:5.1f} s  {detail}  {built}".rstrip(), flush=True)
        report.checks.append(
            {"variant": variant.name, "status": status, "detail": detail, "seconds": round(seconds, 2), **resources}
        )
        report.save()
        if status == "pass":
            passing.append(variant)
        if device.type == "cuda":
            torch.cuda.synchronize()  # a sticky CUDA error surfaces here, before anything is timed
    return passing


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def median_ms(step: Callable[[], object]) -> float:
    """Median of REPEATS calls issued back to back after WARMUPS, each between its own CUDA events."""
    for _ in range(WARMUPS):
        step()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPEATS)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def time_copies(h_s: Tensor, h_t: Tensor, configs: list[TileConfig], report: Report, shape: dict[str, int]) -> None:
    """The A operands' construction (torch ops, outside the kernels' times)."""
    builds: dict[str, Callable[[], object]] = {"cat (engine)": partial(torch.cat, [h_s, h_t])}
    builds["interleave8"] = partial(kernel_operands, h_s, h_t, "interleave8", 16)
    for bm in sorted({cfg.bm for cfg in configs}):
        builds[f"halves (BM={bm})"] = partial(kernel_operands, h_s, h_t, "halves", bm)
    for name, build in builds.items():
        ms = median_ms(build)
        moved = 2 * 2 * h_s.numel() * h_s.element_size()  # read both sides, write them once
        print(f"  copy {name:18s} {ms * 1e3:8.1f} us  ({moved / ms / 1e9:.2f} TB/s)")
        report.copies.append({**shape, "copy": name, "ms": ms})


def print_row(row: dict[str, Any]) -> None:
    ms = row["ms"]
    cells = (
        f"{ms:8.3f} {row['tflops']:7.1f} {row['vs_fp32']:6.3f} {row['vs_bf16']:6.3f}"
        if ms is not None
        else "   (not timed)"
    )
    print(f"{row['H']:5d}x{row['C']:<6d} {row['R']:5d} {row['impl']:44s} {cells} {row['status']}", flush=True)


def time_shape(
    hidden: int, columns: int, rows: int, variants: list[Variant], device: torch.device, num_sms: int, flatten: bool,
    report: Report,
) -> None:  # fmt: skip
    """The baselines and every passing variant at one chunk shape, then its gate."""
    shape = {"H": hidden, "C": columns, "R": rows}
    flop = 2 * (2 * rows) * hidden * columns
    h_s, h_t, weight, labels = chunk_inputs(rows, hidden, columns, device)
    stacked = torch.cat([h_s, h_t])
    fp32_ms = median_ms(lambda: logits_mm(stacked, weight, torch.float32))
    bf16_ms = median_ms(lambda: torch.mm(stacked, weight.T))

    def add(impl: str, ms: float | None, status: str, **extra: object) -> None:
        row = {**shape, "impl": impl, "ms": ms, "status": status, **extra}
        if ms is not None:
            row.update(tflops=flop / ms / 1e9, vs_fp32=fp32_ms / ms, vs_bf16=bf16_ms / ms)
        report.rows.append(row)
        report.save()
        print_row(row)

    add("cuBLAS fp32-out (logits_mm)", fp32_ms, "ok")
    add("cuBLAS bf16-out (torch.mm)", bf16_ms, "ok")
    time_copies(h_s, h_t, sorted({v.config for v in variants}, key=lambda c: c.name), report, shape)

    outputs: dict[int, Outputs] = {}
    for variant in variants:
        cfg = variant.config
        details = {"pairing": variant.pairing, "config": cfg.name, "labels": variant.labels, "store": variant.store}
        try:
            a_s, a_t = kernel_operands(h_s, h_t, variant.pairing, cfg.bm)
            if cfg.bn not in outputs:
                outputs.clear()  # one set of E/D at a time: 2·R·C bf16
                outputs[cfg.bn] = Outputs.empty(rows, columns, cfg.bn, device)
            launch = fused_launcher(variant, a_s, a_t, weight, labels, outputs[cfg.bn], num_sms, flatten)
            add(variant.name, median_ms(launch), "ok", **details)
        except Exception as error:
            add(variant.name, None, f"failed: {first_line(error)}", **details)
    gate(shape, fp32_ms, report)


def gate(shape: dict[str, int], fp32_ms: float, report: Report) -> None:
    """Best fused time at this shape against cuBLAS fp32-out, without and with the label logits."""
    mine = [
        r for r in report.rows if all(r[k] == v for k, v in shape.items()) and "pairing" in r and r["ms"] is not None
    ]
    for labels in (False, True):
        timed = [r for r in mine if r["labels"] == labels]
        best = min(timed, key=lambda r: r["ms"], default=None)
        best_per_pairing = {p: min((r["ms"] for r in timed if r["pairing"] == p), default=None) for p in PAIRINGS}
        verdict = "no fused variant timed" if best is None else ("PASS" if best["ms"] <= fp32_ms else "fail")
        line = {
            **shape,
            "labels": labels,
            "fp32_ms": fp32_ms,
            "best": best and best["impl"],
            "best_ms": best and best["ms"],
            "best_per_pairing_ms": best_per_pairing,
            "verdict": verdict,
        }
        report.gates.append(line)
        report.save()
        pairs = ", ".join(f"{p} {ms:.3f}" for p, ms in best_per_pairing.items() if ms is not None)
        speed = f" = {fp32_ms / best['ms']:.3f} x fp32-out" if best else ""
        print(
            f"GATE H={shape['H']} C={shape['C']} R={shape['R']} {'with' if labels else 'without'} labels: "
            f"best {best and best['impl']} {best and round(best['ms'], 3)} ms vs fp32-out {fp32_ms:.3f} ms{speed} "
            f"-> {verdict}  [best per pairing, ms: {pairs}]",
            flush=True,
        )


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def variants_of(pairings: list[str], stores: list[str], configs: tuple[TileConfig, ...]) -> list[Variant]:
    return [
        Variant(pairing, cfg, labels, store)
        for pairing in pairings
        for cfg in configs
        for store in stores
        for labels in (False, True)
    ]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairing", default="all", help=f"comma separated of {', '.join(PAIRINGS)}, or all")
    parser.add_argument("--stores", default=",".join(STORES), help="E/D stores to try: tma, ptr (comma separated)")
    parser.add_argument("--small", action="store_true", help="the correctness check only")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1 (with --small)")
    parser.add_argument("--no-flatten", action="store_true", help="a plain persistent loop, not tl.range(flatten=True)")
    parser.add_argument("--out", type=Path, default=None, help="directory for fused_logits_probe.json")
    args = parser.parse_args()
    args.pairings = list(PAIRINGS) if args.pairing == "all" else args.pairing.split(",")
    args.stores = args.stores.split(",")
    unknown = [p for p in args.pairings if p not in PAIRINGS] + [s for s in args.stores if s not in STORES]
    if unknown:
        parser.error(f"unknown pairing/store: {unknown}")
    if args.device == "cpu" and not args.small:
        parser.error("timing needs a GPU: on the CPU only --small (under TRITON_INTERPRET=1)")
    return args


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    flatten = not args.no_flatten
    if device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        name = torch.cuda.get_device_name(device)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False  # as the loss runs its GEMMs
        # device-side scratch that some Triton lowerings ask for at launch
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, device=device, dtype=torch.int8))
    else:
        num_sms, name = 4, "cpu (Triton interpreter)"
    report = Report(
        meta={
            "device": name,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "num_sms": num_sms,
            "flatten": flatten,
            "warmups": WARMUPS,
            "repeats": REPEATS,
            "ratio": "cuBLAS time / this time (above 1: faster)",
        }
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report.path = args.out / "fused_logits_probe.json"
    print(f"{name}; torch {torch.__version__}; triton {triton.__version__}; {num_sms} SMs; flatten={flatten}")

    torch.manual_seed(0)
    passing = check_all(variants_of(args.pairings, args.stores, CONFIGS), device, num_sms, flatten, report)
    failed = [c["variant"] for c in report.checks if c["status"] != "pass"]
    print(
        f"{len(passing)} of {len(report.checks)} variants passed"
        + (f"; not passed: {', '.join(failed)}" if failed else "")
    )
    if args.small:
        sys.exit(0 if not failed else 1)

    print("\n  H x C       R impl                                               ms TFLOP/s  /fp32  /bf16")
    for hidden, columns in HEADS:
        for rows in CHUNK_ROWS:
            time_shape(hidden, columns, rows, passing, device, num_sms, flatten, report)
            torch.cuda.empty_cache()
    if report.path is not None:
        print(f"wrote {report.path}")


if __name__ == "__main__":
    main()
