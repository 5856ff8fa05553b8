"""GPU validation of orda_tp: correctness against the fp64 reference, and tensor-parallel TP=2 against
TP=1, in one command. Speed and memory are measured by ``benchmarks/bench.py``. The problems are the
tests' (``tests/support/cases.py``: ``Problem``, the loss keywords of ``call_kwargs``, ``loss_and_grads``,
``relative_error``) on a larger, padded shape; the harness is ``benchmarks/harness.py``.

Parts (each step is guarded: a failure is printed, counted as FAIL, and the script goes on):

(a) correctness (the default; ``--check`` says the same): ``backend="triton"`` and
    ``backend="torch"`` against ``backend="reference"`` run in fp64 on the SAME rounded inputs
    upcast, for every variant × teacher mode (tied, separate, precomputed logits, a top-64 cache of
    them, "topk"; mutual/cojeffreys must raise with a precomputed teacher) × input dtype (fp32,
    fp16, bf16) × reduction ("mean", "none"), with T_s ≠ T_t where allowed, 1 row in 7 ignored, a
    padded vocabulary (vocab_size < V), several row chunks and V not a multiple of the column
    block; and "forward+terms", "skew_js+terms": those variants with label smoothing 0.1, a z-loss
    (weight 1e-3), token weights in [-0.5, 1.5] and soft-caps (student 5, teacher head 4) added.
    ‖a−b‖/‖b‖ of the loss, the components and every gradient: fp32 1e-5 values / 1e-4 grads;
    fp16/bf16 1e-5 values / 1e-2 grads. On a GPU, an informational probe of host synchronization
    follows.
(b) ``--tp`` under torchrun (NCCL on GPUs, gloo on CPU): TP=2 (head rows sharded unevenly in
    torch.chunk order, ``tp_group=WORLD``) against TP=1 (the full head on each rank), every variant ×
    mode, fp32 and bf16: loss and components bitwise equal across ranks; equal to TP=1 within 1e-6
    relative; weight-gradient slices and hidden gradients within 1e-5 (bf16: 1e-3, gradients are
    rounded to bf16 after the fp32 shard sums).

Results go to stdout (a table row per case, a summary last) and to ``--out`` (default $OUT, else
./gpu_check_out): ``<stem>.json`` with every number and ``<stem>.log`` with the full output.
The exit status is 1 when any check failed.

Commands (``--check-time-limit S``: start no new case after S seconds):
  python3 checks/gpu_check.py --check --out $OUT                                      # (a) on one GPU
  torchrun --standalone --nproc-per-node 2 checks/gpu_check.py --tp --check --out $OUT  # (b)
  torchrun --standalone --nproc-per-node 2 checks/gpu_check.py --tp --check --shared-gpu --out $OUT  # (b), one GPU:
      # gloo ranks that all use cuda:0 (NCCL refuses two ranks on one device)
  TRITON_INTERPRET=1 python checks/gpu_check.py --device cpu --small --variants forward,dkd   # CPU debug
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# Run from a checkout without installing: the repository root holds `orda_tp`, the harness this script
# shares with the benchmark (`benchmarks/harness.py`) and the tests' problems (`tests/support/cases.py`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402  (first: it sets the NCCL and Triton environment)
    IGNORE_EVERY,
    IGNORE_INDEX,
    Reporter,
    Runtime,
    add_common_args,
    column_ranges,
    fmt,
    guarded,
    max_over_ranks,
    run_script,
    sync_device,
)
from orda_tp import (  # noqa: E402
    KL_VARIANTS,
    ChunkSize,
    DistillationLossOutput,
    KernelConfig,
    TiedTeacher,
    distillation_loss,
)
from tests.support.cases import (  # noqa: E402
    COTRAINED,
    TEACHER_MODES,
    Problem,
    call_kwargs,
    loss_and_grads,
    relative_error,
    shard_problem,
)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
REDUCTIONS = ("mean", "sum", "none")
CHECK_BACKENDS = ("triton", "torch")
PAD_FILL = 30.0  # cached teacher logits on padding columns: large, so that any leak into padding shows
FIELDS = ("loss", "student_ce", "teacher_ce", "kl", "z_loss")
#: Cases with the student's loss terms on (orda_tp/divergences/terms.py), named "<variant>+terms": the
#: variant's case with label smoothing and a z-loss added.
TERMS = {"label_smoothing": 0.1, "z_loss_weight": 1e-3}
TERM_CASES = ("forward+terms", "skew_js+terms")
#: The teacher modes of (a): the tests' three and "topk", a top-64 cache of the cached logits
#: (``tests.support.cases.Problem.teacher``); (b) runs the tests' three.
CHECK_MODES = (*TEACHER_MODES, "topk")
GRAD_NAMES = {
    "tied": ("student_hidden", "weight", "teacher_hidden"),
    "separate": ("student_hidden", "weight", "teacher_hidden", "teacher_weight"),
    "precomputed": ("student_hidden", "weight"),
    "topk": ("student_hidden", "weight"),
}
# (values, gradients) relative-error limits.
CHECK_TOLERANCE = {"fp32": (1e-5, 1e-4), "fp16": (1e-5, 1e-2), "bf16": (1e-5, 1e-2)}
TP_TOLERANCE = {"fp32": (1e-6, 1e-5), "fp16": (1e-6, 1e-3), "bf16": (1e-6, 1e-3)}


@dataclass(frozen=True)
class CheckShape:
    rows: int
    hidden: int
    vocab: int  # rows of the head (padded vocabulary)
    vocab_size: int  # real vocabulary: columns at or past it are padding
    teacher_hidden: int  # width of the separate teacher's hidden states and head
    chunk_rows: int
    vocab_block: int

    def config(self) -> KernelConfig:
        return KernelConfig(chunk_size=ChunkSize(nrows=self.chunk_rows), vocab_block=self.vocab_block)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, default_out="gpu_check_out")
    parser.add_argument("--check", action="store_true", help="the correctness checks (the default)")
    parser.add_argument(
        "--variants", default="all", help=f"comma list of KL variants and {', '.join(TERM_CASES)} (default: all)"
    )
    parser.add_argument("--modes", default="all", help="comma list of teacher modes: tied,separate,precomputed,topk")
    parser.add_argument("--dtypes", default=None, help="comma list of fp32,fp16,bf16 (default: all; CPU: fp32)")
    parser.add_argument("--reductions", default="mean,none", help="comma list of mean,sum,none (default mean,none)")
    parser.add_argument("--backends", default="triton,torch", help="backends under test: triton,torch")
    parser.add_argument("--rows", type=int, default=None, help="BT of the checks (default 512; --small 24)")
    parser.add_argument("--hidden", type=int, default=None, help="H of the checks (default 256; --small 16)")
    parser.add_argument("--vocab", type=int, default=None, help="V of the checks (default 32003; --small 203)")
    parser.add_argument("--vocab-size", type=int, default=None, help="real vocabulary (default V - 13; --small V - 3)")
    parser.add_argument("--chunk-rows", type=int, default=None, help="rows per chunk (default 192; --small 7)")
    parser.add_argument("--vocab-block", type=int, default=None, help="columns per block (default 8192; --small 64)")
    parser.add_argument(
        "--check-time-limit",
        type=float,
        default=0.0,
        help="seconds after which (a)/(b) start no new case; the rest are reported NOT RUN (0: no limit)",
    )
    return parser.parse_args(argv)


def _choose(text: str | None, allowed: tuple[str, ...], default: tuple[str, ...], what: str) -> tuple[str, ...]:
    if text is None or text == "all":
        return default
    chosen = tuple(item.strip() for item in text.split(",") if item.strip())
    unknown = [item for item in chosen if item not in allowed]
    if unknown:
        raise SystemExit(f"unknown {what}: {unknown}; choose from {list(allowed)}")
    return chosen


def selections(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    dtype_default = ("fp32",) if args.device == "cpu" else tuple(DTYPES)
    return {
        "variants": _choose(args.variants, KL_VARIANTS + TERM_CASES, KL_VARIANTS + TERM_CASES, "variants"),
        "modes": _choose(args.modes, CHECK_MODES, CHECK_MODES, "modes"),
        "dtypes": _choose(args.dtypes, tuple(DTYPES), dtype_default, "dtypes"),
        "reductions": _choose(args.reductions, REDUCTIONS, REDUCTIONS, "reductions"),
        "backends": _choose(args.backends, CHECK_BACKENDS, CHECK_BACKENDS, "backends"),
    }


def check_shape(args: argparse.Namespace) -> CheckShape:
    small = args.small
    rows = args.rows or (24 if small else 512)
    hidden = args.hidden or (16 if small else 256)
    vocab = args.vocab or (203 if small else 32003)
    vocab_size = args.vocab_size or (vocab - 3 if small else vocab - 13)
    return CheckShape(
        rows=rows,
        hidden=hidden,
        vocab=vocab,
        vocab_size=vocab_size,
        teacher_hidden=hidden + 3,
        chunk_rows=args.chunk_rows or (7 if small else 192),
        vocab_block=args.vocab_block or (64 if small else 8192),
    )


# ------------------------------------------------------------------------------------------------ problems


def stable_seed(*parts: object) -> int:  # STEP-A: the old seed, for a bitwise comparison; removed after
    return zlib.crc32(repr(parts).encode()) % 1_000_003


def make_check_problem(shape: CheckShape, seed: int, device: torch.device, mode: str) -> tuple[Problem, Tensor]:
    """The problem of one case as the tests hold it (``tests.support.cases.Problem``; a separate teacher reads
    its own hidden states, of width H + 3, as in ``tests.support.cases.separate_problem``), in fp64 on
    ``device``: logits of standard deviation ≈ 2, 1 row in 7 ignored, labels below vocab_size, cached
    logits of PAD_FILL on the padding columns. Also returned: the weights of a per-row loss's
    gradient (reduction="none"), exact in fp32."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int, scale: float = 1.0) -> Tensor:
        return torch.randn(*size, generator=generator, device=device, dtype=torch.float64) * scale

    rows, hidden, width = shape.rows, shape.hidden, shape.teacher_hidden
    labels = torch.randint(0, shape.vocab_size, (rows,), generator=generator, device=device)
    labels[3::IGNORE_EVERY] = IGNORE_INDEX
    teacher_weight = randn(shape.vocab, width, scale=2.0 / width**0.5)
    logits = randn(rows, width) @ teacher_weight.T
    logits[:, shape.vocab_size :] = PAD_FILL
    student_hidden = randn(rows, hidden)
    weight = randn(shape.vocab, hidden, scale=2.0 / hidden**0.5)
    tied_hidden, separate_hidden = randn(rows, hidden), randn(rows, width)
    upstream = torch.rand(rows, generator=generator, device=device, dtype=torch.float64).float().double()
    problem = Problem(
        student_hidden=student_hidden.requires_grad_(),
        weight=weight.requires_grad_(),
        labels=labels,
        teacher_hidden=(separate_hidden if mode == "separate" else tied_hidden).requires_grad_(),
        teacher_weight=teacher_weight.requires_grad_(),
        teacher_logits=logits,
        real_columns=shape.vocab_size,
    )
    return problem, upstream


def check_kwargs(variant: str, mode: str, reduction: str, shape: CheckShape, device: torch.device) -> dict[str, object]:
    """The tests' loss keywords (``tests.support.cases.call_kwargs``: every term on, T_s ≠ T_t where the
    variant allows it) on this shape's padded vocabulary and chunks; a ``<variant>+terms`` case
    adds label smoothing, a z-loss, token weights in [-0.5, 1.5] and soft-caps."""
    name, plus, _ = variant.partition("+")
    extra: dict[str, object] = {}
    if plus:
        weights = torch.linspace(-0.5, 1.5, shape.rows, dtype=torch.float32, device=device)
        extra = {**TERMS, "token_weights": weights, "logit_softcap": 5.0}
        if mode in ("tied", "separate"):  # a cache is taken as capped
            extra["teacher_logit_softcap"] = 4.0
    return {**call_kwargs(name, mode, reduction), **extra, "vocab_size": shape.vocab_size, "config": shape.config()}


def loss_weights(upstream: Tensor, problem: Problem, reduction: str) -> Tensor | None:
    """The gradient of a per-row loss (reduction="none") in the loss's dtype (fp32, or fp64 for fp64
    inputs); None for a scalar loss."""
    if reduction != "none":
        return None
    return upstream.to(torch.promote_types(problem.student_hidden.dtype, torch.float32))


Outcome = tuple[DistillationLossOutput, list[Tensor | None]]


def _within(error: float, tolerance: float) -> bool:
    return math.isfinite(error) and error <= tolerance


@dataclass
class Comparison:
    values: dict[str, float]
    grads: dict[str, float]
    problems: list[str]

    @property
    def worst_value(self) -> float:
        return _worst(self.values.values())

    @property
    def worst_grad(self) -> float:
        return _worst(self.grads.values())


def _worst(errors: Any) -> float:
    errors = list(errors)
    if any(not math.isfinite(e) for e in errors):
        return math.inf
    return max(errors, default=0.0)


def compare(
    actual: Outcome,
    expected: Outcome,
    mode: str,
    tolerances: tuple[float, float],
    grad_dtype: torch.dtype | None,
    head_columns: tuple[int, int] | None = None,
) -> Comparison:
    """Values and gradients of ``actual`` against ``expected``; ``head_columns`` slices the
    expected head gradients to this rank's shard."""
    (out, grads), (ref, ref_grads) = actual, expected
    value_tol, grad_tol = tolerances
    result = Comparison({}, {}, [])
    for name in FIELDS:
        value, want = getattr(out, name), getattr(ref, name)
        if value.shape != want.shape:
            result.problems.append(f"{name} shape {tuple(value.shape)} != {tuple(want.shape)}")
            result.values[name] = math.inf
            continue
        result.values[name] = error = relative_error(value, want)
        if not _within(error, value_tol):
            result.problems.append(f"{name} err {error:.2e} > {value_tol:.0e}")
    for name, grad, want in zip(GRAD_NAMES[mode], grads, ref_grads):
        if (grad is None) != (want is None):
            result.problems.append(f"d{name} is {'None' if grad is None else 'set'}, the reference's is not")
            continue
        if grad is None or want is None:
            continue
        if head_columns is not None and name.endswith("weight"):
            want = want[head_columns[0] : head_columns[1]]
        if grad.shape != want.shape:
            result.problems.append(f"d{name} shape {tuple(grad.shape)} != {tuple(want.shape)}")
            result.grads[name] = math.inf
            continue
        if grad_dtype is not None and grad.dtype != grad_dtype:
            result.problems.append(f"d{name} dtype {grad.dtype} != {grad_dtype}")
        result.grads[name] = error = relative_error(grad, want)
        if not _within(error, grad_tol):
            result.problems.append(f"d{name} err {error:.2e} > {grad_tol:.0e}")
    return result


# ------------------------------------------------------------------------------------------------ (a) checks


CHECK_HEADER = (
    f"{'dtype':<5} {'mode':<11} {'variant':<16} {'red':<4} {'backend':<7} "
    f"{'loss err':>9} {'values':>9} {'grads':>9} {'secs':>6}  result"
)


def _row(dtype: str, mode: str, variant: str, reduction: str, backend: str) -> str:
    return f"{dtype:<5} {mode:<11} {variant:<16} {reduction:<4} {backend:<7}"


def run_checks(args: argparse.Namespace, reporter: Reporter, device: torch.device) -> None:
    """(a): every backend against the fp64 reference on the same rounded inputs."""
    chosen = selections(args)
    shape = check_shape(args)
    reporter.line(
        f"== (a) correctness vs backend='reference' (fp64 on {device.type}): BT={shape.rows} H={shape.hidden} "
        f"V={shape.vocab} vocab_size={shape.vocab_size} H_teacher={shape.teacher_hidden} "
        f"chunk_rows={shape.chunk_rows} vocab_block={shape.vocab_block}; 1 row in {IGNORE_EVERY} ignored"
    )
    reporter.line("   tolerances (values, grads): " + ", ".join(f"{k} {v}" for k, v in CHECK_TOLERANCE.items()))
    reporter.line(CHECK_HEADER)
    rows: list[dict[str, Any]] = []
    reporter.data["check"] = {"shape": shape.__dict__, "selection": chosen, "rows": rows}
    started = time.perf_counter()
    not_run = 0
    for dtype_name in chosen["dtypes"]:
        for mode in chosen["modes"]:
            for variant in chosen["variants"]:
                for reduction in chosen["reductions"]:
                    if _out_of_time(args, started):
                        not_run += len(chosen["backends"])
                        continue
                    rows += check_case(
                        reporter, device, shape, chosen["backends"], dtype_name, mode, variant, reduction
                    )
                    reporter.dump()
    _report_not_run(reporter, "check", not_run)
    elapsed = time.perf_counter() - started
    reporter.data["check"]["seconds"] = elapsed
    if device.type == "cuda" and "triton" in chosen["backends"]:
        sync_probe(reporter, device, shape)
    summarize_checks(reporter, rows, elapsed)


def _out_of_time(args: argparse.Namespace, started: float) -> bool:
    return args.check_time_limit > 0 and time.perf_counter() - started > args.check_time_limit


def _report_not_run(reporter: Reporter, part: str, count: int) -> None:
    """Cases skipped by --check-time-limit count as one failure: they were not verified."""
    reporter.data[part]["not_run"] = count
    if count:
        reporter.line(f"-- {count} {part} cases NOT RUN: --check-time-limit reached")
        reporter.fail(f"{part}: {count} cases not run (--check-time-limit)")


def check_case(
    reporter: Reporter,
    device: torch.device,
    shape: CheckShape,
    backends: tuple[str, ...],
    dtype_name: str,
    mode: str,
    variant: str,
    reduction: str,
) -> list[dict[str, Any]]:
    """One (dtype, mode, variant, reduction): the reference once, then each backend."""
    dtype = DTYPES[dtype_name]
    kwargs = check_kwargs(variant, mode, reduction, shape, device)
    label = f"{dtype_name}/{mode}/{variant}/{reduction}"
    results: list[dict[str, Any]] = []
    ok, prepared = guarded(reporter, f"{label} inputs", lambda: _prepare(shape, label, mode, dtype, device))
    if not ok:
        for backend in backends:
            results.append(_record(reporter, dtype_name, mode, variant, reduction, backend, None, 0.0, [prepared]))
        return results
    rounded, exact, upstream = prepared
    rounded_weights = loss_weights(upstream, rounded, reduction)
    exact_weights = loss_weights(upstream, exact, reduction)
    if variant in COTRAINED and mode in ("precomputed", "topk"):
        for backend in backends:
            started = time.perf_counter()
            problems = _expect_value_error(
                lambda b=backend: loss_and_grads(rounded, mode, rounded_weights, backend=b, **kwargs)
            )
            seconds = time.perf_counter() - started
            results.append(_record(reporter, dtype_name, mode, variant, reduction, backend, None, seconds, problems))
        return results
    ok, expected = guarded(
        reporter,
        f"{label} reference",
        lambda: loss_and_grads(exact, mode, exact_weights, backend="reference", **kwargs),
    )
    for backend in backends:
        started = time.perf_counter()
        if not ok:
            results.append(
                _record(reporter, dtype_name, mode, variant, reduction, backend, None, 0.0, ["no reference"])
            )
            continue

        def run(b: str = backend) -> Comparison:
            actual = loss_and_grads(rounded, mode, rounded_weights, backend=b, **kwargs)
            sync_device(device)
            return compare(actual, expected, mode, CHECK_TOLERANCE[dtype_name], dtype)

        passed, comparison = guarded(reporter, f"{label} {backend}", run)
        seconds = time.perf_counter() - started
        if passed:
            results.append(
                _record(
                    reporter, dtype_name, mode, variant, reduction, backend, comparison, seconds, comparison.problems
                )
            )
        else:
            results.append(
                _record(reporter, dtype_name, mode, variant, reduction, backend, None, seconds, [comparison])
            )
    return results


def _prepare(
    shape: CheckShape, label: str, mode: str, dtype: torch.dtype, device: torch.device
) -> tuple[Problem, Problem, Tensor]:
    """The problem rounded to ``dtype``, the same values upcast to fp64, and the per-row loss weights."""
    base, upstream = make_check_problem(shape, stable_seed(label), device, mode)
    rounded = base.to(dtype)
    return rounded, rounded.to(torch.float64), upstream


def _expect_value_error(call: Callable[[], Any]) -> list[str]:
    try:
        call()
    except ValueError as error:
        return [] if "PrecomputedTeacher" in str(error) else [f"ValueError without 'PrecomputedTeacher': {error}"]
    except Exception as error:  # noqa: BLE001
        return [f"raised {type(error).__name__} instead of ValueError: {error}"[:300]]
    return ["no ValueError for a co-training variant with a PrecomputedTeacher"]


def _record(
    reporter: Reporter,
    dtype: str,
    mode: str,
    variant: str,
    reduction: str,
    backend: str,
    comparison: Comparison | None,
    seconds: float,
    problems: list[str],
) -> dict[str, Any]:
    status = "PASS" if not problems else "FAIL"
    if comparison is None:
        errors = f"{'-':>9} {'-':>9} {'-':>9}"
        note = "raises ValueError as documented" if not problems else problems[0]
    else:
        errors = f"{comparison.values['loss']:>9.2e} {comparison.worst_value:>9.2e} {comparison.worst_grad:>9.2e}"
        note = "; ".join(problems[:2])
    reporter.line(
        f"{_row(dtype, mode, variant, reduction, backend)} {errors} {seconds:>6.2f}  {status} {note}".rstrip()
    )
    if problems:
        reporter.fail(f"check {dtype}/{mode}/{variant}/{reduction}/{backend}: {'; '.join(problems)}")
    return {
        "dtype": dtype,
        "mode": mode,
        "variant": variant,
        "reduction": reduction,
        "backend": backend,
        "status": status,
        "seconds": seconds,
        "values": None if comparison is None else comparison.values,
        "grads": None if comparison is None else comparison.grads,
        "problems": problems,
    }


def sync_probe(reporter: Reporter, device: torch.device, shape: CheckShape) -> None:
    """Informational (not counted): does one triton call (bf16, tied, forward, labels assumed valid)
    run under torch.cuda.set_sync_debug_mode("error")?"""
    problem = make_check_problem(shape, 11, device, "tied")[0].to(torch.bfloat16)
    config = KernelConfig(assume_valid_labels=True)

    def call() -> None:
        out = distillation_loss(
            problem.student_hidden, problem.weight, problem.labels, TiedTeacher(problem.teacher_hidden.detach()),
            teacher_ce_weight=0.0, kl_weight=1.0, backend="triton", config=config,
        )  # fmt: skip
        torch.autograd.grad(out.loss, [problem.student_hidden, problem.weight])

    try:
        call()  # warm-up (compilation may synchronize)
        sync_device(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
            verdict = "no host synchronization"
        finally:
            torch.cuda.set_sync_debug_mode(0)
    except Exception as error:  # noqa: BLE001
        verdict = f"synchronizes: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]
    sync_device(device)
    reporter.line(f"INFO sync-debug probe (triton, bf16, tied, forward, assume_valid_labels): {verdict}")
    reporter.data["check"]["sync_probe"] = verdict


def summarize_checks(reporter: Reporter, rows: list[dict[str, Any]], elapsed: float) -> None:
    passed = sum(r["status"] == "PASS" for r in rows)
    reporter.line(f"-- (a) {passed}/{len(rows)} cases pass in {elapsed:.1f} s; worst errors (values, grads):")
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["backend"], row["dtype"]), []).append(row)
    for (backend, dtype), group in sorted(groups.items()):
        measured = [r for r in group if r["values"] is not None]
        worst_v = _worst(e for r in measured for e in r["values"].values()) if measured else None
        worst_g = _worst(e for r in measured for e in r["grads"].values()) if measured else None
        bad = sum(r["status"] != "PASS" for r in group)
        reporter.line(
            f"   {backend:<7} {dtype:<5} values {fmt(worst_v, '.2e')}  grads {fmt(worst_g, '.2e')}  "
            f"(limits {CHECK_TOLERANCE[dtype]})  {len(group) - bad}/{len(group)} pass"
        )


# ------------------------------------------------------------------------------------------------ (b) TP


def _pack(out: DistillationLossOutput | None, capacity: int, device: torch.device) -> Tensor:
    """Loss and components as one fp64 vector of fixed length (count, values, zeros); −1 when absent."""
    packed = torch.zeros(1 + capacity, dtype=torch.float64, device=device)
    if out is None:
        packed[0] = -1
        return packed
    values = torch.cat([v.detach().reshape(-1).double() for v in out])
    packed[0] = values.numel()
    packed[1 : 1 + min(values.numel(), capacity)] = values[:capacity]
    return packed


TP_HEADER = (
    f"{'dtype':<5} {'mode':<11} {'variant':<16} {'red':<4} {'backend':<7} "
    f"{'loss err':>9} {'values':>9} {'grads':>9} {'ranks=':>6}  result"
)


def run_tp_checks(args: argparse.Namespace, reporter: Reporter, runtime: Runtime) -> None:
    """(b): TP=world_size against TP=1 on every rank."""
    chosen = selections(args)
    dtypes = tuple(d for d in chosen["dtypes"] if args.dtypes is not None or d in ("fp32", "bf16"))
    shape = check_shape(args)
    ranges = column_ranges(shape.vocab, runtime.world)
    reporter.line(
        f"== (b) TP={runtime.world} vs TP=1 ({dist.get_backend()}): BT={shape.rows} H={shape.hidden} V={shape.vocab} "
        f"vocab_size={shape.vocab_size} shards={ranges}; tolerances {TP_TOLERANCE}"
    )
    reporter.line(TP_HEADER)
    rows: list[dict[str, Any]] = []
    reporter.data["tp_check"] = {"shape": shape.__dict__, "ranges": ranges, "rows": rows}
    started = time.perf_counter()
    not_run = 0
    for dtype_name in dtypes:
        for mode in (mode for mode in chosen["modes"] if mode in TEACHER_MODES):
            for variant in chosen["variants"]:
                for reduction in chosen["reductions"]:
                    for backend in chosen["backends"]:
                        # Every rank stops at the same case: rank 0's clock decides.
                        late = float(runtime.rank == 0 and _out_of_time(args, started))
                        if max_over_ranks([late], runtime.device)[0]:
                            not_run += 1
                            continue
                        rows.append(
                            tp_case(reporter, runtime, shape, ranges, dtype_name, mode, variant, reduction, backend)
                        )
                        reporter.dump()
    _report_not_run(reporter, "tp_check", not_run)
    elapsed = time.perf_counter() - started
    passed = sum(r["status"] == "PASS" for r in rows)
    reporter.line(f"-- (b) {passed}/{len(rows)} cases pass on every rank in {elapsed:.1f} s")
    reporter.data["tp_check"]["seconds"] = elapsed


def tp_case(
    reporter: Reporter,
    runtime: Runtime,
    shape: CheckShape,
    ranges: list[tuple[int, int]],
    dtype_name: str,
    mode: str,
    variant: str,
    reduction: str,
    backend: str,
) -> dict[str, Any]:
    """One TP comparison; every rank runs the same collectives whatever fails locally."""
    device = runtime.device
    dtype = DTYPES[dtype_name]
    label = f"tp {dtype_name}/{mode}/{variant}/{reduction}/{backend}"
    kwargs = check_kwargs(variant, mode, reduction, shape, device)
    columns = ranges[runtime.rank]
    problems: list[str] = []
    full = local = weights = None
    try:
        base, upstream = make_check_problem(shape, stable_seed(label), device, mode)
        with torch.no_grad():  # bitwise the same problem on every rank
            for tensor in (base.student_hidden, base.weight, base.teacher_hidden, base.teacher_weight,
                           base.teacher_logits, base.labels, upstream):  # fmt: skip
                dist.broadcast(tensor, src=0)
        full = base.to(dtype)
        local = shard_problem(full, columns)
        weights = loss_weights(upstream, full, reduction)
    except Exception as error:  # noqa: BLE001
        problems.append(f"inputs: {type(error).__name__}: {error}"[:300])
    expect_error = variant in COTRAINED and mode == "precomputed"
    single = sharded = None
    if full is not None and local is not None and not expect_error:
        ok, single = guarded(
            reporter, f"{label} TP=1", lambda: loss_and_grads(full, mode, weights, backend=backend, **kwargs)
        )
        if not ok:
            problems.append(f"TP=1 raised {single}")
            single = None
        ok, sharded = guarded(
            reporter,
            f"{label} TP={runtime.world}",
            lambda: loss_and_grads(local, mode, weights, backend=backend, tp_group=dist.group.WORLD, **kwargs),
        )
        if not ok:
            problems.append(f"TP raised {sharded}")
            sharded = None
    elif expect_error and local is not None:
        problems += _expect_value_error(
            lambda: loss_and_grads(local, mode, weights, backend=backend, tp_group=dist.group.WORLD, **kwargs)
        )
    # Collectives every rank reaches: the outputs of every rank, bitwise.
    packed = _pack(
        sharded[0] if sharded is not None else None, len(DistillationLossOutput._fields) * shape.rows, device
    )
    gathered = [torch.empty_like(packed) for _ in range(runtime.world)]
    dist.all_gather(gathered, packed)
    if not expect_error and not all(torch.equal(g, gathered[0]) for g in gathered):
        problems.append("loss/components differ across ranks")
    comparison = None
    if single is not None and sharded is not None:
        try:
            comparison = compare(sharded, single, mode, TP_TOLERANCE[dtype_name], dtype, head_columns=columns)
            problems += comparison.problems
        except Exception as error:  # noqa: BLE001
            problems.append(f"compare: {type(error).__name__}: {error}"[:300])
    loss_err = comparison.values.get("loss", math.inf) if comparison else (0.0 if expect_error else math.inf)
    worst_v = comparison.worst_value if comparison else (0.0 if expect_error else math.inf)
    worst_g = comparison.worst_grad if comparison else (0.0 if expect_error else math.inf)
    loss_err, worst_v, worst_g, failing = max_over_ranks([loss_err, worst_v, worst_g, float(bool(problems))], device)
    failed_ranks = [r for r, flag in enumerate(_gather_flags(bool(problems), runtime)) if flag]
    status = "FAIL" if failing else "PASS"
    if problems:
        reporter.line(f"  {label}: {'; '.join(problems[:3])}", every_rank=True)
        reporter.fail(f"{label} (rank {runtime.rank}): {'; '.join(problems)}")
    if expect_error:
        errors, note = f"{'-':>9} {'-':>9} {'-':>9}", "raises ValueError as documented" if not failing else ""
    else:
        errors, note = f"{loss_err:>9.2e} {worst_v:>9.2e} {worst_g:>9.2e}", ""
    same = "yes" if not any("differ across ranks" in p for p in problems) else "NO"
    ranks_note = f" failing ranks {failed_ranks}" if failed_ranks else ""
    head = _row(dtype_name, mode, variant, reduction, backend)
    reporter.line(f"{head} {errors} {same:>6}  {status} {note}{ranks_note}".rstrip())
    return {
        "dtype": dtype_name,
        "mode": mode,
        "variant": variant,
        "reduction": reduction,
        "backend": backend,
        "status": status,
        "loss_err": loss_err,
        "values_err": worst_v,
        "grads_err": worst_g,
        "failed_ranks": failed_ranks,
        "problems_rank0": problems if runtime.rank == 0 else None,
    }


def _gather_flags(flag: bool, runtime: Runtime) -> list[bool]:
    tensor = torch.tensor([float(flag)], device=runtime.device)
    gathered = [torch.empty_like(tensor) for _ in range(runtime.world)]
    dist.all_gather(gathered, tensor)
    return [bool(t.item()) for t in gathered]


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def body(reporter: Reporter, runtime: Runtime) -> None:
        if args.tp:
            run_tp_checks(args, reporter, runtime)
        else:
            run_checks(args, reporter, runtime.device)

    return run_script(args, "gpu_check_" + ("tp" if args.tp else "single") + "_check", body)


if __name__ == "__main__":
    sys.exit(main())
