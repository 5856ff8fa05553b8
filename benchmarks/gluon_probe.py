"""Can a warp-specialized Gluon GEMM that stores scaled exponentials be as fast as cuBLAS storing logits?

The gate probe of the route in docs/architecture.md §8.3 ("Scaled exponentials in the logits GEMM"):
the kernels of ``benchmarks/gluon_exp_gemm.py`` write, per (row, column tile), the tile maximum and
``Σ e^{s−m}`` and, per element, ``E = e^{s−m}`` in bf16 (and, with two sides, the teacher's
statistics and ``D = e^{t−m_t} − e^{s−m_s}``) instead of the logits. Their gate: no slower than
cuBLAS writing the same GEMM's bf16 logits (``torch.mm(h, W.T)``), against which the time ratio
is printed, beside the ratio to cuBLAS writing fp32 logits (``logits_mm(h, W, float32)``, as the
engine runs it). A two-sided variant is timed against cuBLAS on the stacked 2R rows (the engine's
``cat([h_s, h_t])``).

On a GPU (H100/H200), from the repository root:

    python3 benchmarks/gluon_probe.py --out DIR [--time-limit 540] [--variants pingpong,2side]

1. Smoke check, each variant in its own subprocess (a kernel that deadlocks is killed there, after
   ``SMOKE_TIMEOUT`` seconds, and the others go on): small shapes with partial row, column and K
   tiles, on all SMs and on 3 CTAs (many tiles per CTA, the ring's phases wrapping), against an
   fp64 reference; outputs poisoned with NaN first.
2. Per chunk shape R ∈ {512, 1024, 2048} × (H, C) ∈ {(4096, 128256), (2304, 256000)}, on fresh
   inputs: each variant that passed the smoke check is checked against the fp64 reference (row
   blocks), then timed, as are the cuBLAS baselines (CUDA events, median of REPEATS after WARMUPS).
3. The gate table; every number into DIR/gluon_probe.json (written again after every step, so an
   interrupted run keeps what it had).

Tolerances (norm-relative, ‖got − ref‖ / ‖ref‖ over the chunk): each statistic ≤ 1e-5, or ≤ 2×
the error of the same statistic formed exactly from cuBLAS's fp32 logits (printed beside it) where
the fp32 accumulator alone exceeds 1e-5 (accumulating with truncation, as tensor cores measured on
earlier generations do, a simulated fp32 accumulator over H = 4096 puts the sums at 1.0e-5); E and
D ≤ 2^-8, and element by element |Δ| ≤ 2^-8·|ref| + 2e-4·x with x = E for E and e^{t−m_t} + E for
D: bf16 rounding of the fp32 result, whose own error (≤ 9e-5 relative in that simulation) the
2e-4 covers.
Exit status: 1 if any variant failed a check or could not run, else 0 (a failed gate is a
measurement, not a failure).

Without a GPU:

    python3 benchmarks/gluon_probe.py --compile-only

compiles every variant for sm_90 (``GPUTarget("cuda", 90, 32)``) through Gluon's frontend and
``ptxas`` — the arguments bound and specialized as a launch binds them — and prints each kernel's
registers, spills and shared memory; exit 1 if one fails to compile or needs more shared memory
than an sm_90 CTA has.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import triton
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gluon_exp_gemm import SMEM_LIMIT, VARIANTS, Outputs, Variant, launch_arguments, launcher  # noqa: E402
from orda_tp.engine.logits import logits_mm  # noqa: E402

HEADS = ((4096, 128256), (2304, 256000))  # (H, C)
CHUNK_ROWS = (512, 1024, 2048)
SMOKE_SHAPES = ((200, 328, 1000), (520, 328, 19992))  # (R, H, C): partial row, K and column tiles
FEW_CTAS = 3  # the smoke check's second grid: many tiles per CTA
SMOKE_TIMEOUT = 60  # seconds for one variant's smoke subprocess (about 15 s: CUDA start, compile, checks)
WARMUPS, REPEATS = 3, 15
BLOCK_ROWS = 256  # rows per block of the fp64 reference
STATS_TOLERANCE = 1e-5
BF16_ROUNDING = 2.0**-8
ACCUMULATION = 2e-4
CUBLAS_FACTOR = 2.0
DENSE_TFLOPS, BANDWIDTH_TBS = 790.0, 4.25  # one H200: measured dense bf16, and its memory bandwidth


# ---------------------------------------------------------------------------------------------
# Compile only (no GPU)
# ---------------------------------------------------------------------------------------------


def compile_for_sm90(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Compile one launch of a Gluon kernel for sm_90 without a driver: the arguments are bound and
    specialized by the binder a launch uses, then compiled from a ``GluonASTSource`` (raises the
    compiler's error)."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = dict(kwargs)
    # what JITFunction.run adds to a launch's keyword arguments before binding them
    options["debug"] = options.get("debug", kernel.debug) or knobs.runtime.debug
    options["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, rest = binder(*args, **options)
    parsed, signature, constexprs, attrs = kernel._pack_args(backend, options, bound, specialization, rest)
    source = GluonASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=parsed.__dict__)


def ptxas_resources(ptx: str) -> dict[str, int]:
    """Registers per thread, spill stores/loads (bytes) and stack frame of a PTX text, from
    ``ptxas -v`` for sm_90a (the launch's register count: a warp-specialized kernel's partitions
    then trade registers by ``setmaxnreg``)."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        command = [knobs.nvidia.ptxas.path, "-v", "--gpu-name=sm_90a", str(source), "-o", str(source) + ".o"]
        log = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    found = {
        "regs": re.search(r"Used (\d+) registers", log),
        "spill_stores": re.search(r"(\d+) bytes spill stores", log),
        "spill_loads": re.search(r"(\d+) bytes spill loads", log),
        "stack": re.search(r"(\d+) bytes stack frame", log),
    }
    return {name: int(match.group(1)) if match else -1 for name, match in found.items()}


def partition_registers(ptx: str) -> list[int]:
    """The register counts the kernel's warpgroups set for themselves (``setmaxnreg``), largest first."""
    return sorted(
        {int(n) for n in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)}, reverse=True
    )


def compile_all(variants: list[Variant]) -> int:
    """Compile every variant for sm_90 on CPU tensors (the specialization of a launch: no integer
    arguments, 16-byte aligned pointers); 1 if any fails or exceeds the shared memory limit."""
    rows, hidden, columns = SMOKE_SHAPES[1]
    h_s = torch.empty(rows, hidden, dtype=torch.bfloat16)
    h_t = torch.empty_like(h_s)
    weight = torch.empty(columns, hidden, dtype=torch.bfloat16)
    failures = 0
    print(f"triton {triton.__version__}: compiling {len(variants)} variant(s) for sm_90")
    for variant in variants:
        started = time.perf_counter()
        try:
            args, kwargs = launch_arguments(
                variant, h_s, h_t, weight, Outputs.empty(variant, rows, columns, h_s.device)
            )
            compiled = compile_for_sm90(variant.kernel, args, kwargs)
            ptx = compiled.asm["ptx"]
            res = ptxas_resources(ptx)
            smem = int(compiled.metadata.shared)
            warps = int(compiled.metadata.num_warps)
            fits = smem <= SMEM_LIMIT
            failures += not fits
            partitions = partition_registers(ptx)
            print(
                f"{'compiled' if fits else 'TOO BIG '}  {variant.name:34s} {time.perf_counter() - started:5.1f} s  "
                f"warps={warps} regs={res['regs']} spills={res['spill_stores']}/{res['spill_loads']} B "
                f"stack={res['stack']} B smem={smem} B ({smem / 1024:.1f} KiB of {SMEM_LIMIT // 1024})"
                + (f" setmaxnreg={partitions}" if partitions else ""),
                flush=True,
            )
        except Exception as error:  # noqa: BLE001 - each variant is reported, then the next
            failures += 1
            print(f"FAILED    {variant.name}: {type(error).__name__}: {error}", flush=True)
    print(f"{'FAIL' if failures else 'PASS'}: {failures} of {len(variants)} variant(s) failed for sm_90")
    return 1 if failures else 0


# ---------------------------------------------------------------------------------------------
# Correctness
# ---------------------------------------------------------------------------------------------


def chunk_inputs(rows: int, hidden: int, columns: int, sides: int) -> tuple[Tensor, Tensor | None, Tensor]:
    """Fresh bf16 h_s, h_t (None for one side) and W on the GPU: logits of standard deviation 2."""
    device = torch.device("cuda")
    h_s = torch.randn(rows, hidden, device=device).bfloat16()
    h_t = torch.randn(rows, hidden, device=device).bfloat16() if sides == 2 else None
    weight = (torch.randn(columns, hidden, device=device) * 2 * hidden**-0.5).bfloat16()
    return h_s, h_t, weight


def tile_reference(logits: Tensor, bn: int) -> tuple[Tensor, Tensor, Tensor]:
    """fp64 (m, Σ e^{s−m}, e^{s−m}) of a block of logits (rows, C) per tile of ``bn`` columns:
    m and the sums (T, rows), the exponentials (rows, C)."""
    rows, columns = logits.shape
    tiles = -(-columns // bn)
    padded = torch.nn.functional.pad(logits.double(), (0, tiles * bn - columns), value=float("-inf"))
    padded = padded.view(rows, tiles, bn)
    m = padded.amax(dim=-1)
    p = torch.exp(padded - m[..., None])
    return m.T, p.sum(dim=-1).T, p.view(rows, tiles * bn)[:, :columns]


@dataclass
class Error:
    """Running norms of one output's error: ‖Δ‖², ‖ref‖², and the worst |Δ|/bound element."""

    squared_error: float = 0.0
    squared_reference: float = 0.0
    worst: float = 0.0

    def add(self, got: Tensor, ref: Tensor, bound: Tensor | None = None) -> None:
        delta = got.double() - ref
        self.squared_error += float(delta.square().sum())
        self.squared_reference += float(ref.square().sum())
        if bound is not None:
            self.worst = max(self.worst, float((delta.abs() / bound).nan_to_num(float("inf")).max()))

    @property
    def relative(self) -> float:
        return math.sqrt(self.squared_error / self.squared_reference) if self.squared_reference else math.inf

    def passes(self, tolerance: float, elementwise: bool) -> bool:
        """Norm-relative error within ``tolerance`` (NaN fails) and, if ``elementwise``, every element
        within its bound."""
        return self.relative <= tolerance and (not elementwise or self.worst <= 1.0)


def compare(
    variant: Variant, h_s: Tensor, h_t: Tensor | None, weight: Tensor, out: Outputs
) -> dict[str, dict[str, Any]]:
    """Every output of a variant against the fp64 reference, by blocks of rows: per output its
    norm-relative error, worst element/bound and whether it passes; per statistic also the error of
    the same statistic formed exactly from cuBLAS's fp32 logits (the engine's route), which passes
    the statistic at up to CUBLAS_FACTOR times it where the fp32 accumulator alone exceeds 1e-5."""
    w64 = weight.double()
    sides = [(h_s, "s")] + ([(h_t, "t")] if variant.sides == 2 and h_t is not None else [])
    kernel = {f"{stat}_{side}": Error() for _, side in sides for stat in ("m", "l")}
    cublas = {name: Error() for name in kernel}
    kernel.update({name: Error() for name in ("e", "d")[: len(sides)]})
    for start in range(0, h_s.shape[0], BLOCK_ROWS):
        block = slice(start, start + BLOCK_ROWS)
        exponentials = []
        for index, (h, side) in enumerate(sides):
            m, sums, p = tile_reference(h[block].double() @ w64.T, variant.bn)
            m32, sums32, _ = tile_reference(logits_mm(h[block], weight, torch.float32), variant.bn)
            kernel[f"m_{side}"].add(out.stats[2 * index, :, block], m)
            kernel[f"l_{side}"].add(out.stats[2 * index + 1, :, block], sums)
            cublas[f"m_{side}"].add(m32, m)
            cublas[f"l_{side}"].add(sums32, sums)
            exponentials.append(p)
        e = exponentials[0]
        kernel["e"].add(out.e[block], e, (BF16_ROUNDING + ACCUMULATION) * e + 1e-30)
        if len(exponentials) == 2 and out.d is not None:
            p_t = exponentials[1]
            d = p_t - e
            kernel["d"].add(out.d[block], d, BF16_ROUNDING * d.abs() + ACCUMULATION * (p_t + e) + 1e-30)
    report: dict[str, dict[str, Any]] = {}
    for name, error in kernel.items():
        if name in cublas:
            route = cublas[name].relative
            ok = error.passes(STATS_TOLERANCE, False) or error.passes(CUBLAS_FACTOR * route, False)
            report[name] = {"relative": error.relative, "cublas_relative": route, "ok": ok}
        else:
            report[name] = {"relative": error.relative, "worst": error.worst, "ok": error.passes(BF16_ROUNDING, True)}
    return report


def first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def check_line(found: dict[str, dict[str, Any]]) -> str:
    """``name:ok(norm-relative error|cuBLAS route's)`` per statistic, ``name:ok(error/worst element's
    share of its bound)`` per exponential tensor."""
    cells = []
    for name, v in found.items():
        detail = f"cuBLAS {v['cublas_relative']:.1e}" if "cublas_relative" in v else f"{v['worst']:.2f}"
        cells.append(f"{name}:{'ok' if v['ok'] else 'FAIL'}({v['relative']:.1e}|{detail})")
    return " ".join(cells)


def kernel_resources(compiled: Any) -> dict[str, int]:
    """Registers, spills and shared memory of a kernel compiled and loaded on this GPU."""
    return {
        "regs": int(getattr(compiled, "n_regs", -1)),
        "spills": int(getattr(compiled, "n_spills", -1)),
        "smem": int(compiled.metadata.shared),
    }


def smoke(variant: Variant) -> dict[str, Any]:
    """The small-shape check of one variant (this process may be killed by its parent if it hangs):
    every smoke shape on all SMs and on FEW_CTAS CTAs."""
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    runs = []
    resources: dict[str, int] = {}
    passed = True
    for rows, hidden, columns in SMOKE_SHAPES:
        h_s, h_t, weight = chunk_inputs(rows, hidden, columns, variant.sides)
        for ctas in (num_sms, FEW_CTAS):
            out = Outputs.empty(variant, rows, columns, h_s.device)
            out.poison()
            resources = kernel_resources(launcher(variant, h_s, h_t, weight, out, ctas)())
            torch.cuda.synchronize()
            found = compare(variant, h_s, h_t, weight, out)
            ok = all(v["ok"] for v in found.values())
            passed &= ok
            runs.append({"R": rows, "H": hidden, "C": columns, "ctas": ctas, "ok": ok, "errors": found})
            print(f"  {variant.name} R={rows} H={hidden} C={columns} ctas={ctas}: {check_line(found)}", flush=True)
    return {"variant": variant.name, "status": "pass" if passed else "FAIL", "runs": runs, **resources}


def smoke_in_subprocess(variant: Variant) -> dict[str, Any]:
    """:func:`smoke` in a child process, killed after SMOKE_TIMEOUT seconds (a deadlocked kernel);
    its result is the last line of its output, as JSON."""
    command = [sys.executable, str(Path(__file__).resolve()), "--smoke", variant.name]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=SMOKE_TIMEOUT)
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        print(output, end="")
        return {"variant": variant.name, "status": f"hung (killed after {SMOKE_TIMEOUT} s)", "seconds": SMOKE_TIMEOUT}
    lines = done.stdout.strip().splitlines()
    if lines[:-1]:
        print("\n".join(lines[:-1]))
    seconds = round(time.perf_counter() - started, 1)
    try:
        return {**json.loads(lines[-1]), "seconds": seconds}
    except (IndexError, json.JSONDecodeError):
        tail = (done.stdout + done.stderr).strip()[-2000:]
        print(tail)
        return {
            "variant": variant.name,
            "status": f"failed (exit {done.returncode})",
            "detail": tail,
            "seconds": seconds,
        }


# ---------------------------------------------------------------------------------------------
# Timing and the gate
# ---------------------------------------------------------------------------------------------


def median_ms(step: Callable[[], object]) -> float:
    """Median of REPEATS calls launched back to back after WARMUPS, each between its own CUDA events."""
    for _ in range(WARMUPS):
        step()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPEATS)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


@dataclass
class Report:
    """Everything the run found, written as JSON after every step."""

    meta: dict[str, Any]
    smoke: list[dict[str, Any]] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)
    baselines: list[dict[str, Any]] = field(default_factory=list)
    timings: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    path: Path | None = None

    def save(self) -> None:
        if self.path is not None:
            body = {name: value for name, value in vars(self).items() if name != "path"}
            self.path.write_text(json.dumps(body, indent=1))


class Deadline:
    """The run's time limit: ``expired()`` once fewer than ``margin`` seconds are left."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def expired(self, margin: float = 0.0) -> bool:
        return time.monotonic() > self.end - margin


def predicted_ms(variant_sides: int, rows: int, hidden: int, columns: int, bn: int) -> float:
    """The floor of one variant at one shape on an H200: its FLOPs at DENSE_TFLOPS or its bytes
    (operands once, E/D and the statistics written) at BANDWIDTH_TBS, whichever is longer."""
    flop = 2 * variant_sides * rows * columns * hidden
    moved = 2 * (variant_sides * rows + columns) * hidden + variant_sides * rows * columns * 2
    moved += 2 * variant_sides * 4 * rows * -(-columns // bn)
    return max(flop / DENSE_TFLOPS / 1e9, moved / BANDWIDTH_TBS / 1e9)


def run_shape(
    hidden: int, columns: int, rows: int, variants: list[Variant], num_sms: int, report: Report, deadline: Deadline
) -> bool:
    """Check then time every variant at one chunk shape, after the cuBLAS baselines on R and 2R rows;
    False if a check failed or a variant could not run."""
    shape = {"H": hidden, "C": columns, "R": rows}
    sides_needed = sorted({v.sides for v in variants})
    h_s, h_t, weight = chunk_inputs(rows, hidden, columns, max(sides_needed))
    stacked = torch.cat([h_s, h_t]) if h_t is not None else h_s
    baseline: dict[tuple[int, str], float] = {}
    for sides in sides_needed:
        lhs = stacked if sides == 2 else h_s
        baseline[sides, "bf16"] = median_ms(partial(torch.mm, lhs, weight.T))
        baseline[sides, "fp32"] = median_ms(partial(logits_mm, lhs, weight, torch.float32))
        for dtype in ("bf16", "fp32"):
            flop = 2 * sides * rows * columns * hidden
            ms = baseline[sides, dtype]
            report.baselines.append({**shape, "rows": sides * rows, "out": dtype, "ms": ms, "tflops": flop / ms / 1e9})
            print(f"{hidden:5d}x{columns:<6d} R={rows:<5d} cuBLAS {dtype}-out, {sides * rows} rows: {ms:8.3f} ms "
                  f"{flop / ms / 1e9:6.1f} TFLOP/s", flush=True)  # fmt: skip
    report.save()

    all_ok = True
    for variant in variants:
        if deadline.expired(margin=20):
            report.skipped.append(f"{variant.name} at {shape} (time limit)")
            continue
        entry: dict[str, Any] = {**shape, "variant": variant.name}
        try:
            out = Outputs.empty(variant, rows, columns, h_s.device)
            out.poison()
            launch = launcher(variant, h_s, h_t, weight, out, num_sms)
            launch()
            torch.cuda.synchronize()
            found = compare(variant, h_s, h_t, weight, out)
            ok = all(v["ok"] for v in found.values())
            entry.update(status="pass" if ok else "FAIL", errors=found)
            print(f"  check {variant.name}: {'pass' if ok else 'FAIL'} {check_line(found)}", flush=True)
            if ok:
                ms = median_ms(launch)
                flop = 2 * variant.sides * rows * columns * hidden
                timing = {
                    **shape,
                    "variant": variant.name,
                    "sides": variant.sides,
                    "ms": ms,
                    "tflops": flop / ms / 1e9,
                    "vs_bf16": ms / baseline[variant.sides, "bf16"],
                    "vs_fp32": ms / baseline[variant.sides, "fp32"],
                    "predicted_floor_ms": predicted_ms(variant.sides, rows, hidden, columns, variant.bn),
                }
                report.timings.append(timing)
                ratios = f"/cuBLAS bf16 {timing['vs_bf16']:.3f}  /cuBLAS fp32 {timing['vs_fp32']:.3f}"
                print(f"  time  {variant.name}: {ms:8.3f} ms {timing['tflops']:6.1f} TFLOP/s  {ratios}", flush=True)
            del out
        except Exception as error:  # noqa: BLE001 - a launch or resource error of one variant, then the next
            ok = False
            entry.update(status="failed", detail=first_line(error))
            print(f"  FAILED {variant.name}: {first_line(error)}", flush=True)
        all_ok &= ok
        report.checks.append(entry)
        report.save()
    return all_ok


def print_gate(report: Report) -> None:
    """One line per (shape, variant): time, TFLOP/s, time / cuBLAS bf16-out (the gate: ≤ 1.0) and
    time / cuBLAS fp32-out; then each shape's best variant per side count."""
    print("\n== gate: kernel time / cuBLAS time on the same rows (≤ 1.0: no slower)")
    columns = f"{'variant':34s} {'ms':>8} {'TFLOP/s':>8} {'/bf16':>7} {'/fp32':>7} {'floor ms':>8}  gate"
    print(f"{'H':>5} {'C':>7} {'R':>5}  {columns}")
    for t in report.timings:
        verdict = "PASS" if t["vs_bf16"] <= 1.0 else "fail"
        print(f"{t['H']:5d} {t['C']:7d} {t['R']:5d}  {t['variant']:34s} {t['ms']:8.3f} {t['tflops']:8.1f} "
              f"{t['vs_bf16']:7.3f} {t['vs_fp32']:7.3f} {t['predicted_floor_ms']:8.3f}  {verdict}")  # fmt: skip
    print("\n== best per shape")
    keys = sorted({(t["H"], t["C"], t["R"], t["sides"]) for t in report.timings})
    for hidden, columns, rows, sides in keys:
        mine = [t for t in report.timings if (t["H"], t["C"], t["R"], t["sides"]) == (hidden, columns, rows, sides)]
        best = min(mine, key=lambda t: t["ms"])
        verdict = "PASS" if best["vs_bf16"] <= 1.0 else "fail"
        print(f"{hidden:5d} {columns:7d} {rows:5d} {sides} side(s): {best['variant']:34s} /bf16 {best['vs_bf16']:.3f} "
              f"/fp32 {best['vs_fp32']:.3f} -> {verdict}")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def select(names: str) -> list[Variant]:
    """The variants whose name contains every comma-separated part of ``names`` ("all": every one)."""
    if names == "all":
        return list(VARIANTS)
    parts = names.split(",")
    return [v for v in VARIANTS if all(part in v.name for part in parts)]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="directory for gluon_probe.json")
    parser.add_argument("--compile-only", action="store_true", help="compile every variant for sm_90, no GPU")
    parser.add_argument("--time-limit", type=float, default=540.0, help="seconds the whole run may take")
    parser.add_argument("--variants", default="all", help="comma-separated parts every chosen name contains")
    parser.add_argument("--smoke", default=None, help=argparse.SUPPRESS)  # one variant's smoke check (a child)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.smoke is not None:
        torch.manual_seed(0)
        variant = next(v for v in VARIANTS if v.name == args.smoke)
        try:
            result = smoke(variant)
        except Exception as error:  # noqa: BLE001 - reported to the parent as this variant's status
            result = {"variant": variant.name, "status": "failed", "detail": first_line(error)}
        print(json.dumps(result))
        return 0
    variants = select(args.variants)
    if not variants:
        print(f"no variant matches {args.variants!r}; the variants: {', '.join(v.name for v in VARIANTS)}")
        return 1
    if args.compile_only:
        os.environ.pop("TRITON_INTERPRET", None)
        return compile_all(variants)
    if not torch.cuda.is_available():
        print("no GPU: run with --compile-only on a machine without one")
        return 1

    deadline = Deadline(args.time_limit)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False  # as the loss runs its GEMMs
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    name = torch.cuda.get_device_name(0)
    report = Report(
        meta={
            "device": name,
            "num_sms": num_sms,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "warmups": WARMUPS,
            "repeats": REPEATS,
            "ratios": "kernel time / cuBLAS time on the same rows (two sides: cuBLAS on the stacked 2R rows)",
            "stats_layout": "stats[k, j, r]: k = m_s, l_s (, m_t, l_t); j = column tile of BN; r = row",
        }
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report.path = args.out / "gluon_probe.json"
    print(f"{name}; {num_sms} SMs; torch {torch.__version__}; triton {triton.__version__}", flush=True)

    print(f"== smoke check (each variant in a subprocess, {SMOKE_TIMEOUT} s at most)", flush=True)
    passing = []
    hung: set[tuple[str, int]] = set()  # (kind, sides) of a variant that hung: its siblings share its code
    for variant in variants:
        if deadline.expired(margin=SMOKE_TIMEOUT + 60) or (variant.kind, variant.sides) in hung:
            report.skipped.append(f"{variant.name} (time limit, or a variant of its code hung)")
            continue
        result = smoke_in_subprocess(variant)
        if result["status"].startswith("hung"):
            hung.add((variant.kind, variant.sides))
        report.smoke.append(result)
        report.save()
        built = f"regs={result.get('regs')} spills={result.get('spills')} smem={result.get('smem')}"
        print(f"{variant.name:34s} {result['status']}  {result.get('detail', '')}  {built}", flush=True)
        if result["status"] == "pass":
            passing.append(variant)
    all_ok = len(passing) == len(variants)

    torch.manual_seed(1)
    for hidden, columns in HEADS:
        for rows in CHUNK_ROWS:
            if deadline.expired(margin=30):
                report.skipped.append(f"shape H={hidden} C={columns} R={rows} (time limit)")
                continue
            print(f"\n== H={hidden} C={columns} R={rows}", flush=True)
            all_ok &= run_shape(hidden, columns, rows, passing, num_sms, report, deadline)
            torch.cuda.empty_cache()
    print_gate(report)
    for line in report.skipped:
        print(f"skipped: {line}")
    report.save()
    if report.path is not None:
        print(f"wrote {report.path}")
    print(f"{'PASS' if all_ok else 'FAIL'}: checks" + ("" if all_ok else " (a variant failed or could not run)"))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
