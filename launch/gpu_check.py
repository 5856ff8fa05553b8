"""GPU validation and benchmark of orda_tp: correctness against the fp64 reference, tensor-parallel
TP=2 against TP=1, and speed and memory at the anchor shapes, in one command.

Parts (each step is guarded: a failure is printed, counted as FAIL, and the script goes on):

(a) correctness (default, or ``--check``): ``backend="triton"`` and ``backend="torch"`` against
    ``backend="reference"`` run in fp64 on the SAME rounded inputs upcast, for every variant ×
    teacher mode (tied, separate, precomputed logits; mutual/cojeffreys must raise with a
    precomputed teacher) × input dtype (fp32, fp16, bf16) × reduction ("mean", "none"), with
    T_s ≠ T_t where allowed, 1 row in 7 ignored, a padded vocabulary (vocab_size < V), several row
    chunks and V not a multiple of the column block. ‖a−b‖/‖b‖ of the loss, the components and every
    gradient: fp32 1e-5 values / 1e-4 grads; fp16/bf16 1e-5 values / 1e-2 grads.
(b) ``--tp`` under torchrun (NCCL on GPUs, gloo on CPU): TP=2 (head rows sharded unevenly in
    torch.chunk order, ``tp_group=WORLD``) against TP=1 (the full head on each rank), every variant ×
    mode, fp32 and bf16: loss and components bitwise equal across ranks; equal to TP=1 within 1e-6
    relative; weight-gradient slices and hidden gradients within 1e-5 (bf16: 1e-3, gradients are
    rounded to bf16 after the fp32 shard sums).
(c) ``--bench``: fwd+bwd of the loss only at the anchor shapes of shared/ANCHORS.md (bf16; tied
    frozen teacher with teacher_ce_weight=0; student CE + forward KL at T=1; 1 label in 7 ignored),
    for backend="triton", backend="torch" and a naive full-logits torch loss (fp32 logits); a CE-only
    task; every variant and the separate / precomputed teachers with backend="triton" at the first
    shape. Median of 10 after 3 warm-ups (CUDA events), peak memory above the inputs (and above
    inputs + returned gradients), the floor at 788 TFLOP/s. Under ``--tp``: TP=1 and TP=2 per rank.

Results go to stdout (a table row per case, a summary last) and to ``--out`` (default $OUT, else
./gpu_check_out): ``<stem>.json`` with every number and ``<stem>.log`` with the full output.
The exit status is 1 when any check failed.

Commands (``--check-time-limit S``: start no new check case after S seconds, so the bench still runs):
  python3 launch/gpu_check.py --out $OUT                                             # (a) on one GPU
  python3 launch/gpu_check.py --check --bench --check-time-limit 240 --out $OUT      # (a) and (c)
  torchrun --standalone --nproc-per-node 2 launch/gpu_check.py --tp --check --bench --out $OUT   # (b), (c)
  TRITON_INTERPRET=1 python launch/gpu_check.py --device cpu --small --variants forward,dkd      # CPU debug
"""

from __future__ import annotations

import os

# NVLink multicast stays off on the lent multi-GPU machines (it can take the host's GPUs down).
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import zlib  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402

# Run from a checkout without installing: the repository root holds `orda_tp`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orda_tp  # noqa: E402
from orda_tp import (  # noqa: E402
    KL_VARIANTS,
    ChunkSize,
    EntropyGate,
    KernelConfig,
    PrecomputedTeacher,
    SeparateTeacher,
    TiedTeacher,
)

# Copied from tests/cases.py (launch/ does not import tests/).
VARIANT_KWARGS: dict[str, dict[str, object]] = {
    "forward": {},
    "reverse": {},
    "jeffreys": {},
    "mutual": {},
    "cojeffreys": {},
    "alpha_divergence": {"kl_alpha": 0.3},
    "skew_forward": {"kl_beta": 0.3},
    "skew_reverse": {"kl_beta": 0.7},
    "skew_js": {"kl_beta": 0.4},
    "entropy_adaptive": {"entropy_gate": EntropyGate(alpha_min=0.1, alpha_max=0.9, tau=0.5, scale=0.3)},
    "renyi": {"kl_alpha": 1.5},
    "renyi_reverse": {"kl_alpha": 0.6},
    "dkd": {"kl_alpha": 2.0, "kl_beta": 0.5},
    "abkd": {"kl_alpha": 0.7, "kl_beta": 1.3},
    "triangular": {},
}
COTRAINED = ("mutual", "cojeffreys")
TEACHER_MODES = ("tied", "separate", "precomputed")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
REDUCTIONS = ("mean", "sum", "none")
CHECK_BACKENDS = ("triton", "torch")
IGNORE_INDEX = -100
IGNORE_EVERY = 7  # 1 row in 7 is ignored
PAD_FILL = 30.0  # cached teacher logits on padding columns: large, so that any leak into padding shows
FIELDS = ("loss", "student_ce", "teacher_ce", "kl")
GRAD_NAMES = {
    "tied": ("student_hidden", "weight", "teacher_hidden"),
    "separate": ("student_hidden", "weight", "teacher_hidden", "teacher_weight"),
    "precomputed": ("student_hidden", "weight"),
}
# (values, gradients) relative-error limits.
CHECK_TOLERANCE = {"fp32": (1e-5, 1e-4), "fp16": (1e-5, 1e-2), "bf16": (1e-5, 1e-2)}
TP_TOLERANCE = {"fp32": (1e-6, 1e-5), "fp16": (1e-6, 1e-3), "bf16": (1e-6, 1e-3)}
BENCH_SANITY_TOLERANCE = 1e-2  # orda loss vs the naive loss (bf16-rounded logits) at the bench shapes
MATMUL_TFLOPS = 788.0  # bf16 8192³ on an H200, measured (shared/ANCHORS.md)
WARMUP, REPEATS = 3, 10


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


@dataclass(frozen=True)
class BenchShape:
    name: str
    rows: int
    hidden: int
    vocab: int

    def floor_ms(self, gemms: int, tflops: float = MATMUL_TFLOPS) -> float:
        return gemms * 2.0 * self.rows * self.hidden * self.vocab / (tflops * 1e12) * 1e3


ANCHOR_SHAPES = (
    BenchShape("BT8192_H4096_V128256", 8192, 4096, 128256),
    BenchShape("BT8192_H2304_V256000", 8192, 2304, 256000),
)
SMALL_BENCH_SHAPES = (BenchShape("BT64_H32_V1003", 64, 32, 1003), BenchShape("BT64_H24_V2000", 64, 24, 2000))
# Issue 4's targets: (shape index, task) -> (ms, MiB above the inputs or None).
BENCH_TARGETS = {(0, "KD"): (50.0, 512.0), (1, "KD"): (56.0, 1024.0), (0, "CE"): (38.0, None)}
VARIANT_RATIO_TARGET = 1.25
TP_RATIO_TARGET = 0.55


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if cuda else "cpu")
    parser.add_argument("--small", action="store_true", help="tiny shapes (BT=24, H=16, V=203) for the CPU")
    parser.add_argument("--check", action="store_true", help="run the correctness part also with --bench")
    parser.add_argument("--bench", action="store_true", help="time the anchor shapes (skips --check unless given)")
    parser.add_argument("--tp", action="store_true", help="tensor-parallel checks/bench (launch with torchrun)")
    parser.add_argument("--variants", default="all", help="comma list of KL variants (default: all 15)")
    parser.add_argument("--modes", default="all", help="comma list of teacher modes: tied,separate,precomputed")
    parser.add_argument("--dtypes", default=None, help="comma list of fp32,fp16,bf16 (default: all; CPU: fp32)")
    parser.add_argument("--reductions", default="mean,none", help="comma list of mean,sum,none (default mean,none)")
    parser.add_argument("--backends", default="triton,torch", help="backends under test: triton,torch")
    parser.add_argument("--rows", type=int, default=None, help="BT of the checks (default 512; --small 24)")
    parser.add_argument("--hidden", type=int, default=None, help="H of the checks (default 256; --small 16)")
    parser.add_argument("--vocab", type=int, default=None, help="V of the checks (default 32003; --small 203)")
    parser.add_argument("--vocab-size", type=int, default=None, help="real vocabulary (default V - 13; --small V - 3)")
    parser.add_argument("--chunk-rows", type=int, default=None, help="rows per chunk (default 192; --small 7)")
    parser.add_argument("--vocab-block", type=int, default=None, help="columns per block (default 8192; --small 64)")
    parser.add_argument("--no-naive", action="store_true", help="bench: skip the naive full-logits loss")
    parser.add_argument(
        "--bench-extras",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="bench: also every variant and the separate/precomputed teachers (triton, first shape)",
    )
    parser.add_argument(
        "--check-time-limit",
        type=float,
        default=0.0,
        help="seconds after which (a)/(b) start no new case; the rest are reported NOT RUN (0: no limit)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--collective-timeout", type=float, default=180.0, help="seconds per collective (--tp)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out", help="results directory")
    args = parser.parse_args(argv)
    args.run_check = args.check or not args.bench
    return args


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
        "variants": _choose(args.variants, KL_VARIANTS, KL_VARIANTS, "variants"),
        "modes": _choose(args.modes, TEACHER_MODES, TEACHER_MODES, "modes"),
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


# ------------------------------------------------------------------------------------------------ output


def _plain(value: Any) -> Any:
    """JSON-safe: non-finite floats as strings, tuples as lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class Reporter:
    """Prints on rank 0, keeps a log file per rank and one JSON document (rank 0)."""

    def __init__(self, out_dir: Path, stem: str, rank: int) -> None:
        self.rank = rank
        out_dir.mkdir(parents=True, exist_ok=True)
        suffix = "" if rank == 0 else f"_rank{rank}"
        self.log_path = out_dir / f"{stem}{suffix}.log"
        self.json_path = out_dir / f"{stem}.json"
        self.log_path.write_text("")
        self.data: dict[str, Any] = {}
        self.failures: list[str] = []

    def line(self, text: str = "", *, every_rank: bool = False) -> None:
        if self.rank == 0 or every_rank:
            prefix = "" if self.rank == 0 else f"[rank {self.rank}] "
            print(prefix + text, flush=True)
        with self.log_path.open("a") as log:
            log.write(text + "\n")

    def log_only(self, text: str) -> None:
        with self.log_path.open("a") as log:
            log.write(text + "\n")

    def fail(self, label: str) -> None:
        self.failures.append(label)

    def dump(self) -> None:
        if self.rank == 0:
            self.json_path.write_text(json.dumps(_plain(self.data), indent=1))


def guarded(reporter: Reporter, label: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
    """``(True, fn())``, or ``(False, message)`` after printing the error (traceback to the log)."""
    try:
        return True, fn()
    except Exception as error:  # noqa: BLE001 - every failure is reported and counted, then the script goes on
        message = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
        reporter.line(f"  ERROR {label}: {message}", every_rank=True)
        reporter.log_only(traceback.format_exc())
        _recover_device()
        return False, message


def _recover_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - a sticky CUDA error shows up again in the next step
            pass


def environment(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "orda_tp": orda_tp.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}", gpus=torch.cuda.device_count())
        info["allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
    try:
        root = Path(__file__).resolve().parents[1]
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
        info["git"] = commit.stdout.strip() or None
    except OSError:
        info["git"] = None
    return info


# ------------------------------------------------------------------------------------------------ problems


def stable_seed(*parts: object) -> int:
    """A seed that is the same in every process (``hash`` of a string is not)."""
    return zlib.crc32(repr(parts).encode()) % 1_000_003


@dataclass
class Inputs:
    """One problem's tensors; ``separate_hidden`` feeds the separate teacher's own head."""

    student_hidden: Tensor
    weight: Tensor
    labels: Tensor
    teacher_hidden: Tensor
    separate_hidden: Tensor
    teacher_weight: Tensor
    teacher_logits: Tensor
    upstream: Tensor  # the gradient of a per-row loss (reduction="none")

    def teacher(self, mode: str) -> TiedTeacher | SeparateTeacher | PrecomputedTeacher:
        if mode == "tied":
            return TiedTeacher(self.teacher_hidden)
        if mode == "separate":
            return SeparateTeacher(self.separate_hidden, self.teacher_weight)
        return PrecomputedTeacher(logits=self.teacher_logits)

    def trainable(self, mode: str) -> list[Tensor]:
        """The tensors a call with this teacher mode may differentiate (order of GRAD_NAMES)."""
        if mode == "tied":
            return [self.student_hidden, self.weight, self.teacher_hidden]
        if mode == "separate":
            return [self.student_hidden, self.weight, self.separate_hidden, self.teacher_weight]
        return [self.student_hidden, self.weight]

    def tensors(self) -> list[Tensor]:
        return [
            self.student_hidden,
            self.weight,
            self.teacher_hidden,
            self.separate_hidden,
            self.teacher_weight,
            self.teacher_logits,
            self.upstream,
        ]

    def cast(self, dtype: torch.dtype) -> Inputs:
        """Fresh leaves in ``dtype`` (hidden states and heads require grad; the cache does not)."""

        def leaf(t: Tensor) -> Tensor:
            return t.detach().to(dtype).requires_grad_()

        return Inputs(
            student_hidden=leaf(self.student_hidden),
            weight=leaf(self.weight),
            labels=self.labels,
            teacher_hidden=leaf(self.teacher_hidden),
            separate_hidden=leaf(self.separate_hidden),
            teacher_weight=leaf(self.teacher_weight),
            teacher_logits=self.teacher_logits.detach().to(dtype),
            upstream=self.upstream,
        )

    def shard(self, start: int, stop: int) -> Inputs:
        """This rank's inputs: head rows and cache columns ``[start, stop)``, every hidden row."""

        def leaf(t: Tensor) -> Tensor:
            return t.detach().clone().requires_grad_(t.requires_grad)

        return Inputs(
            student_hidden=leaf(self.student_hidden),
            weight=leaf(self.weight[start:stop]),
            labels=self.labels.clone(),
            teacher_hidden=leaf(self.teacher_hidden),
            separate_hidden=leaf(self.separate_hidden),
            teacher_weight=leaf(self.teacher_weight[start:stop]),
            teacher_logits=self.teacher_logits[:, start:stop].contiguous(),
            upstream=self.upstream,
        )


def make_inputs(shape: CheckShape, seed: int, device: torch.device) -> Inputs:
    """fp64 inputs with logits of standard deviation ≈ 2, 1 row in 7 ignored, labels below
    vocab_size, cached logits of PAD_FILL on the padding columns."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int, scale: float = 1.0) -> Tensor:
        return torch.randn(*size, generator=generator, device=device, dtype=torch.float64) * scale

    rows, hidden, width = shape.rows, shape.hidden, shape.teacher_hidden
    labels = torch.randint(0, shape.vocab_size, (rows,), generator=generator, device=device)
    labels[3::IGNORE_EVERY] = IGNORE_INDEX
    teacher_weight = randn(shape.vocab, width, scale=2.0 / width**0.5)
    logits = randn(rows, width) @ teacher_weight.T
    logits[:, shape.vocab_size :] = PAD_FILL
    return Inputs(
        student_hidden=randn(rows, hidden),
        weight=randn(shape.vocab, hidden, scale=2.0 / hidden**0.5),
        labels=labels,
        teacher_hidden=randn(rows, hidden),
        separate_hidden=randn(rows, width),
        teacher_weight=teacher_weight,
        teacher_logits=logits,
        upstream=torch.rand(rows, generator=generator, device=device, dtype=torch.float64).float().double(),
    )


def call_kwargs(variant: str, mode: str, shape: CheckShape) -> dict[str, object]:
    """As tests/test_equivalence.py: every term on, T_s ≠ T_t where the variant allows it."""
    kwargs: dict[str, object] = dict(
        student_ce_weight=0.7,
        kl_weight=1.3,
        kl_temperature=2.0,
        kl_divergence=variant,
        vocab_size=shape.vocab_size,
        config=shape.config(),
        **VARIANT_KWARGS[variant],
    )
    if variant not in COTRAINED:
        kwargs["kl_teacher_temperature"] = 1.5
    if mode == "separate":
        kwargs["teacher_ce_weight"] = 0.4
    elif mode == "precomputed":
        kwargs["teacher_ce_weight"] = 0.2
    return kwargs


Outcome = tuple[orda_tp.DistillationLossOutput, list[Tensor | None]]


def loss_and_grads(inputs: Inputs, mode: str, reduction: str, **kwargs: object) -> Outcome:
    """The loss and the gradients of ``loss`` (weighted by ``inputs.upstream`` for "none")."""
    out = orda_tp.distillation_loss(
        inputs.student_hidden, inputs.weight, inputs.labels, inputs.teacher(mode), reduction=reduction, **kwargs
    )
    params = inputs.trainable(mode)
    if not out.loss.requires_grad:
        return out, [None] * len(params)
    upstream = inputs.upstream.to(out.loss.dtype) if reduction == "none" else None
    grads = torch.autograd.grad(out.loss, params, grad_outputs=upstream, allow_unused=True)
    return out, list(grads)


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ (absolute when expected is 0), in fp64; NaN stays NaN."""
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = expected.norm().item()
    difference = (actual - expected).norm().item()
    return difference / scale if scale > 0 else difference


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    kwargs = call_kwargs(variant, mode, shape)
    label = f"{dtype_name}/{mode}/{variant}/{reduction}"
    results: list[dict[str, Any]] = []
    ok, prepared = guarded(reporter, f"{label} inputs", lambda: _prepare(shape, label, dtype, device))
    if not ok:
        for backend in backends:
            results.append(_record(reporter, dtype_name, mode, variant, reduction, backend, None, 0.0, [prepared]))
        return results
    rounded, exact = prepared
    if variant in COTRAINED and mode == "precomputed":
        for backend in backends:
            started = time.perf_counter()
            problems = _expect_value_error(
                lambda b=backend: loss_and_grads(rounded, mode, reduction, backend=b, **kwargs)
            )
            seconds = time.perf_counter() - started
            results.append(_record(reporter, dtype_name, mode, variant, reduction, backend, None, seconds, problems))
        return results
    ok, expected = guarded(
        reporter, f"{label} reference", lambda: loss_and_grads(exact, mode, reduction, backend="reference", **kwargs)
    )
    for backend in backends:
        started = time.perf_counter()
        if not ok:
            results.append(
                _record(reporter, dtype_name, mode, variant, reduction, backend, None, 0.0, ["no reference"])
            )
            continue

        def run(b: str = backend) -> Comparison:
            actual = loss_and_grads(rounded, mode, reduction, backend=b, **kwargs)
            _sync(device)
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


def _prepare(shape: CheckShape, label: str, dtype: torch.dtype, device: torch.device) -> tuple[Inputs, Inputs]:
    """The inputs rounded to ``dtype`` and the same values upcast to fp64."""
    base = make_inputs(shape, stable_seed(label), device)
    rounded = base.cast(dtype)
    return rounded, rounded.cast(torch.float64)


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
    inputs = make_inputs(shape, 11, device).cast(torch.bfloat16)
    config = KernelConfig(assume_valid_labels=True)

    def call() -> None:
        out = orda_tp.distillation_loss(
            inputs.student_hidden, inputs.weight, inputs.labels, TiedTeacher(inputs.teacher_hidden.detach()),
            teacher_ce_weight=0.0, kl_weight=1.0, backend="triton", config=config,
        )  # fmt: skip
        torch.autograd.grad(out.loss, [inputs.student_hidden, inputs.weight])

    try:
        call()  # warm-up (compilation may synchronize)
        _sync(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
            verdict = "no host synchronization"
        finally:
            torch.cuda.set_sync_debug_mode(0)
    except Exception as error:  # noqa: BLE001
        verdict = f"synchronizes: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]
    _sync(device)
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
            f"   {backend:<7} {dtype:<5} values {_fmt(worst_v, '.2e')}  grads {_fmt(worst_g, '.2e')}  "
            f"(limits {CHECK_TOLERANCE[dtype]})  {len(group) - bad}/{len(group)} pass"
        )


# ------------------------------------------------------------------------------------------------ (b) TP


@dataclass(frozen=True)
class Runtime:
    rank: int
    world: int
    device: torch.device


def init_distributed(args: argparse.Namespace) -> Runtime:
    if "RANK" not in os.environ:
        raise SystemExit("--tp runs under torchrun: torchrun --standalone --nproc-per-node 2 launch/gpu_check.py --tp")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = timedelta(seconds=args.collective_timeout)
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("WORLD_SIZE", "1"))))
        dist.init_process_group("gloo", timeout=timeout)
    return Runtime(dist.get_rank(), dist.get_world_size(), device)


def column_ranges(columns: int, world: int) -> list[tuple[int, int]]:
    """Every rank's head rows in torch.chunk order (uneven when ``columns`` is not a multiple)."""
    sizes = [len(part) for part in torch.arange(columns).chunk(world)]
    if len(sizes) != world:
        raise ValueError(f"{columns} columns do not make {world} torch.chunk shards")
    starts = [sum(sizes[:i]) for i in range(world)]
    return [(start, start + size) for start, size in zip(starts, sizes)]


def _pack(out: orda_tp.DistillationLossOutput | None, capacity: int, device: torch.device) -> Tensor:
    """Loss and components as one fp64 vector of fixed length (count, values, zeros); −1 when absent."""
    packed = torch.zeros(1 + capacity, dtype=torch.float64, device=device)
    if out is None:
        packed[0] = -1
        return packed
    values = torch.cat([v.detach().reshape(-1).double() for v in out])
    packed[0] = values.numel()
    packed[1 : 1 + min(values.numel(), capacity)] = values[:capacity]
    return packed


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    finite = [v if math.isfinite(v) else 1e300 for v in values]
    tensor = torch.tensor(finite, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [math.inf if v >= 1e300 else v for v in tensor.tolist()]


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
        for mode in chosen["modes"]:
            for variant in chosen["variants"]:
                for reduction in chosen["reductions"]:
                    for backend in chosen["backends"]:
                        # Every rank stops at the same case: rank 0's clock decides.
                        late = float(runtime.rank == 0 and _out_of_time(args, started))
                        if _max_over_ranks([late], runtime.device)[0]:
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
    kwargs = call_kwargs(variant, mode, shape)
    columns = ranges[runtime.rank]
    problems: list[str] = []
    full = local = None
    try:
        base = make_inputs(shape, stable_seed(label), device)
        for tensor in base.tensors() + [base.labels]:
            dist.broadcast(tensor, src=0)  # bitwise the same problem on every rank
        full = base.cast(dtype)
        local = full.shard(*columns)
    except Exception as error:  # noqa: BLE001
        problems.append(f"inputs: {type(error).__name__}: {error}"[:300])
    expect_error = variant in COTRAINED and mode == "precomputed"
    single = sharded = None
    if full is not None and local is not None and not expect_error:
        ok, single = guarded(
            reporter, f"{label} TP=1", lambda: loss_and_grads(full, mode, reduction, backend=backend, **kwargs)
        )
        if not ok:
            problems.append(f"TP=1 raised {single}")
            single = None
        ok, sharded = guarded(
            reporter,
            f"{label} TP={runtime.world}",
            lambda: loss_and_grads(local, mode, reduction, backend=backend, tp_group=dist.group.WORLD, **kwargs),
        )
        if not ok:
            problems.append(f"TP raised {sharded}")
            sharded = None
    elif expect_error and local is not None:
        problems += _expect_value_error(
            lambda: loss_and_grads(local, mode, reduction, backend=backend, tp_group=dist.group.WORLD, **kwargs)
        )
    # Collectives every rank reaches: the outputs of every rank, bitwise.
    packed = _pack(sharded[0] if sharded is not None else None, 4 * shape.rows, device)
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
    loss_err, worst_v, worst_g, failing = _max_over_ranks([loss_err, worst_v, worst_g, float(bool(problems))], device)
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


# ------------------------------------------------------------------------------------------------ (c) bench


def naive_loss(hidden: Tensor, weight: Tensor, labels: Tensor, teacher_hidden: Tensor | None, with_kl: bool) -> Tensor:
    """Full-logits torch: student CE + forward KL(q‖p) at T=1 (teacher frozen), fp32 logits, mean
    over the non-ignored rows (orda_tp's reduction="mean")."""
    logits = (hidden @ weight.T).float()
    ce = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)
    if not with_kl:
        return ce
    assert teacher_hidden is not None
    with torch.no_grad():
        log_q = (teacher_hidden @ weight.T).float().log_softmax(-1)
    log_p = logits.log_softmax(-1)
    valid = (labels != IGNORE_INDEX).float()
    kl_rows = (log_q.exp() * (log_q - log_p)).sum(-1)
    return ce + (kl_rows * valid).sum() / valid.sum().clamp(min=1)


@dataclass
class BenchInputs:
    hidden: Tensor
    weight: Tensor  # this rank's head (the whole head unless TP)
    labels: Tensor
    teacher_hidden: Tensor
    extra: dict[str, Tensor]  # separate teacher's hidden/head, cached logits (made on demand)


def make_bench_inputs(
    shape: BenchShape, device: torch.device, dtype: torch.dtype, columns: tuple[int, int] | None, seed: int
) -> BenchInputs:
    """Random (never zero) inputs; logits of standard deviation ≈ 2; 1 label in 7 ignored."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*size, generator=generator, device=device, dtype=torch.float32) * scale).to(dtype)

    weight = randn(shape.vocab, shape.hidden, scale=2.0 / shape.hidden**0.5)
    if columns is not None:
        weight = weight[columns[0] : columns[1]].clone()
    labels = torch.randint(0, shape.vocab, (shape.rows,), generator=generator, device=device)
    labels[3::IGNORE_EVERY] = IGNORE_INDEX
    return BenchInputs(
        hidden=randn(shape.rows, shape.hidden).requires_grad_(),
        weight=weight.requires_grad_(),
        labels=labels,
        teacher_hidden=randn(shape.rows, shape.hidden),
        extra={},
    )


Step = Callable[[], tuple[Tensor, tuple[Tensor, ...]]]


def orda_step(
    inputs: BenchInputs, task: str, backend: str, variant: str = "forward", mode: str = "tied", tp: bool = False
) -> Step:
    """fwd+bwd of orda_tp's loss: student CE (+ the KL variant at T=1 unless task == "CE")."""
    if mode == "tied":
        teacher: Any = TiedTeacher(inputs.teacher_hidden)
    elif mode == "separate":
        teacher = SeparateTeacher(inputs.extra["separate_hidden"], inputs.extra["teacher_weight"])
    else:
        teacher = PrecomputedTeacher(logits=inputs.extra["teacher_logits"])
    kwargs: dict[str, Any] = dict(
        student_ce_weight=1.0,
        teacher_ce_weight=0.0,
        kl_weight=0.0 if task == "CE" else 1.0,
        kl_temperature=1.0,
        kl_divergence=variant,
        backend=backend,
        **VARIANT_KWARGS[variant],
    )
    if tp:
        kwargs["tp_group"] = dist.group.WORLD
    params = (inputs.hidden, inputs.weight)

    def step() -> tuple[Tensor, tuple[Tensor, ...]]:
        out = orda_tp.distillation_loss(inputs.hidden, inputs.weight, inputs.labels, teacher, **kwargs)
        return out.loss.detach(), torch.autograd.grad(out.loss, params)

    return step


def naive_step(inputs: BenchInputs, task: str) -> Step:
    params = (inputs.hidden, inputs.weight)

    def step() -> tuple[Tensor, tuple[Tensor, ...]]:
        loss = naive_loss(inputs.hidden, inputs.weight, inputs.labels, inputs.teacher_hidden, task != "CE")
        return loss.detach(), torch.autograd.grad(loss, params)

    return step


@dataclass
class Timing:
    ms: float
    spread_ms: float  # max − min of the timed repeats
    peak_mib: float | None  # peak above the inputs
    workspace_mib: float | None  # peak above the inputs and the returned gradients
    loss: float


def measure(step: Step, device: torch.device, barrier: bool = False) -> Timing:
    """3 warm-ups, one run for memory, then the median of 10 timed runs (1 and 3 on the CPU, where
    the interpreter is slow and the numbers only show that the code runs)."""
    warmup, repeats = (WARMUP, REPEATS) if device.type == "cuda" else (1, 3)
    for _ in range(warmup):
        result = step()
        del result
    _sync(device)
    gc.collect()
    peak = workspace = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    loss, grads = step()
    _sync(device)
    if device.type == "cuda":
        peak_bytes = torch.cuda.max_memory_allocated(device) - base
        grad_bytes = sum(g.numel() * g.element_size() for g in grads if g is not None)
        peak, workspace = peak_bytes / 2**20, (peak_bytes - grad_bytes) / 2**20
    loss_value = float(loss) if loss.numel() == 1 else math.nan
    del loss, grads
    if barrier:
        dist.barrier()
    _sync(device)
    times: list[float] = []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for start, stop in events:
            start.record()
            result = step()
            stop.record()
            del result
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(stop) for start, stop in events]
    else:
        for _ in range(repeats):
            started = time.perf_counter()
            result = step()
            times.append((time.perf_counter() - started) * 1e3)
            del result
    return Timing(statistics.median(times), max(times) - min(times), peak, workspace, loss_value)


def matmul_rate(device: torch.device) -> float | None:
    """Measured bf16 TFLOP/s of an 8192³ product on random data (None on the CPU)."""
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    timing = measure(lambda: (torch.mm(a, b), ()), device)
    return 2 * 8192**3 / (timing.ms * 1e-3) / 1e12


BENCH_HEADER = (
    f"{'shape':<21} {'task':<13} {'impl':<7} {'ms':>8} {'spread':>7} {'floor':>6} {'x floor':>7} "
    f"{'peak MiB':>9} {'wkspc MiB':>9} {'target':>14}  note"
)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def bench_row(
    reporter: Reporter,
    rows: list[dict[str, Any]],
    shape: BenchShape,
    task: str,
    impl: str,
    gemms: int,
    step_factory: Callable[[], Step],
    device: torch.device,
    target: tuple[float, float | None] | None = None,
    barrier: bool = False,
    floor_share: float = 1.0,
) -> dict[str, Any] | None:
    label = f"bench {shape.name} {task} {impl}"
    ok, timing = guarded(reporter, label, lambda: measure(step_factory(), device, barrier))
    floor = shape.floor_ms(gemms) * floor_share
    if not ok:
        reporter.fail(f"{label}: {timing}")
        reporter.line(f"{shape.name:<21} {task:<13} {impl:<7} {'ERROR':>8}  {timing}")
        rows.append({"shape": shape.name, "task": task, "impl": impl, "error": timing, "floor_ms": floor})
        return None
    target_text, note = "", ""
    if target is not None:
        ms_target, mib_target = target
        target_text = f"<={ms_target:g}ms" + (f",{mib_target:g}MiB" if mib_target else "")
        met = timing.ms <= ms_target and (mib_target is None or (timing.peak_mib or 0.0) <= mib_target)
        note = "meets target" if met else "misses target"
    reporter.line(
        f"{shape.name:<21} {task:<13} {impl:<7} {timing.ms:>8.2f} {timing.spread_ms:>7.2f} {floor:>6.1f} "
        f"{timing.ms / floor:>7.2f} {_fmt(timing.peak_mib, '9.0f'):>9} {_fmt(timing.workspace_mib, '9.0f'):>9} "
        f"{target_text:>14}  {note}".rstrip()
    )
    row = {
        "shape": shape.name,
        "rows": shape.rows,
        "hidden": shape.hidden,
        "vocab": shape.vocab,
        "task": task,
        "impl": impl,
        "ms": timing.ms,
        "spread_ms": timing.spread_ms,
        "floor_ms": floor,
        "gemms": gemms,
        "peak_above_inputs_mib": timing.peak_mib,
        "workspace_mib": timing.workspace_mib,
        "loss": timing.loss,
        "target": target,
        "note": note,
    }
    rows.append(row)
    return row


def run_bench(args: argparse.Namespace, reporter: Reporter, device: torch.device) -> None:
    """(c) on one device: anchor shapes × {KD, CE} × {triton, torch, naive}, then the extras."""
    chosen = selections(args)
    shapes = SMALL_BENCH_SHAPES if args.small else ANCHOR_SHAPES
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    rate = matmul_rate(device)
    reps = f"{REPEATS} after {WARMUP} warm-ups" if device.type == "cuda" else "3 after 1 warm-up"
    reporter.line(
        f"== (c) bench: fwd+bwd of the loss, {str(dtype).replace('torch.', '')}, tied frozen teacher, student CE + "
        f"forward KL (T=1), 1 label in {IGNORE_EVERY} ignored; median of {reps}; floor = "
        f"GEMMs × 2·BT·H·V at {MATMUL_TFLOPS:g} TFLOP/s (measured here: {_fmt(rate, '.0f')} TFLOP/s)"
    )
    reporter.line("   peak = max allocated above the inputs; wkspc = the same less the returned gradients")
    reporter.line(BENCH_HEADER)
    rows: list[dict[str, Any]] = []
    reporter.data["bench"] = {"matmul_tflops": rate, "rows": rows, "dtype": str(dtype)}
    impls = [b for b in chosen["backends"]] + ([] if args.no_naive else ["naive"])
    for index, shape in enumerate(shapes):
        ok, inputs = guarded(
            reporter, f"bench inputs {shape.name}", lambda s=shape: make_bench_inputs(s, device, dtype, None, args.seed)
        )
        if not ok:
            reporter.fail(f"bench inputs {shape.name}: {inputs}")
            continue
        bench_row(
            reporter, rows, shape, "logits GEMM", "torch.mm", 1,
            lambda i=inputs: (lambda: (torch.mm(i.hidden.detach(), i.weight.detach().T), ())), device,
        )  # fmt: skip
        for task, gemms in (("KD", 4), ("CE", 3)):
            losses: dict[str, float] = {}
            for impl in impls:

                def factory(i: BenchInputs = inputs, t: str = task, m: str = impl) -> Step:
                    return naive_step(i, t) if m == "naive" else orda_step(i, t, m)

                target = None if args.small else BENCH_TARGETS.get((index, task))
                row = bench_row(reporter, rows, shape, task, impl, gemms, factory, device, target)
                if row is not None:
                    losses[impl] = row["loss"]
                _recover_device()
            _sanity(reporter, shape, task, losses)
        if args.bench_extras and index == 0:
            bench_extras(reporter, rows, shape, inputs, chosen, device)
        del inputs
        _recover_device()
        reporter.dump()


def _sanity(reporter: Reporter, shape: BenchShape, task: str, losses: dict[str, float]) -> None:
    """Each orda loss against the naive one (whose logits are rounded to bf16 by the GEMM)."""
    if "naive" not in losses:
        return
    for impl, value in losses.items():
        if impl == "naive":
            continue
        diff = abs(value - losses["naive"]) / max(abs(losses["naive"]), 1e-30)
        ok = math.isfinite(diff) and diff <= BENCH_SANITY_TOLERANCE
        reporter.line(f"   sanity {shape.name} {task}: {impl} loss {value:.6f} vs naive {losses['naive']:.6f} "
                      f"(rel {diff:.1e}) {'ok' if ok else 'FAIL'}")  # fmt: skip
        if not ok:
            reporter.fail(f"bench sanity {shape.name} {task} {impl}: rel diff {diff:.2e}")


def bench_extras(
    reporter: Reporter,
    rows: list[dict[str, Any]],
    shape: BenchShape,
    inputs: BenchInputs,
    chosen: dict[str, tuple[str, ...]],
    device: torch.device,
) -> None:
    """Every variant (triton, KD) against forward KL's time; the separate and precomputed teachers."""
    if "triton" not in chosen["backends"]:
        return
    times: dict[str, float] = {}
    for variant in chosen["variants"]:
        row = bench_row(
            reporter, rows, shape, f"KD {variant}"[:13], "triton", 4,
            lambda v=variant: orda_step(inputs, "KD", "triton", variant=v), device,
        )  # fmt: skip
        if row is not None:
            row["variant"] = variant
            times[variant] = row["ms"]
        _recover_device()
    if "forward" in times:
        slow = {v: t / times["forward"] for v, t in times.items() if t / times["forward"] > VARIANT_RATIO_TARGET}
        reporter.line(f"   variants over {VARIANT_RATIO_TARGET}x forward KL's time: {slow or 'none'}")
        reporter.data["bench"]["variant_ratios"] = {v: t / times["forward"] for v, t in times.items()}
    dtype = inputs.hidden.dtype
    if "separate" in chosen["modes"]:
        generator = torch.Generator(device=device).manual_seed(5)
        inputs.extra["separate_hidden"] = torch.randn(shape.rows, shape.hidden, generator=generator, device=device).to(
            dtype
        )
        inputs.extra["teacher_weight"] = (
            torch.randn(shape.vocab, shape.hidden, generator=generator, device=device) * (2.0 / shape.hidden**0.5)
        ).to(dtype)
        bench_row(
            reporter, rows, shape, "KD separate", "triton", 4,
            lambda: orda_step(inputs, "KD", "triton", mode="separate"), device,
        )  # fmt: skip
        inputs.extra.clear()
        _recover_device()
    if "precomputed" in chosen["modes"]:
        with torch.no_grad():
            inputs.extra["teacher_logits"] = inputs.teacher_hidden @ inputs.weight.detach().T
        bench_row(
            reporter, rows, shape, "KD precomp", "triton", 3,
            lambda: orda_step(inputs, "KD", "triton", mode="precomputed"), device,
        )  # fmt: skip
        inputs.extra.clear()
        _recover_device()


def run_tp_bench(args: argparse.Namespace, reporter: Reporter, runtime: Runtime) -> None:
    """(c) under --tp: TP=1 (the full head on each rank alone) and TP=world per rank, same global shape."""
    chosen = selections(args)
    device = runtime.device
    shapes = SMALL_BENCH_SHAPES if args.small else ANCHOR_SHAPES
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    reporter.line(
        f"== (c) TP bench: KD (student CE + forward KL, tied frozen teacher), per rank, TP=1 vs TP={runtime.world}; "
        f"ms = max over ranks of each rank's median"
    )
    reporter.line(
        f"{'shape':<21} {'backend':<7} {'TP':>3} {'ms':>8} {'floor':>6} {'peak MiB':>9} {'wkspc MiB':>9}  note"
    )
    rows: list[dict[str, Any]] = []
    reporter.data["tp_bench"] = {"rows": rows, "world": runtime.world}
    ranges = None
    for shape in shapes:
        ranges = column_ranges(shape.vocab, runtime.world)
        for backend in chosen["backends"]:
            per_tp: dict[int, float] = {}
            for tp in (1, runtime.world):
                columns = None if tp == 1 else ranges[runtime.rank]
                label = f"tp bench {shape.name} {backend} TP={tp}"

                def run(
                    s: BenchShape = shape, c: tuple[int, int] | None = columns, b: str = backend, t: int = tp
                ) -> Timing:
                    inputs = make_bench_inputs(s, device, dtype, c, args.seed)
                    try:
                        return measure(orda_step(inputs, "KD", b, tp=t > 1), device, barrier=True)
                    finally:
                        del inputs

                ok, timing = guarded(reporter, label, run)
                dist.barrier()
                values = [timing.ms, timing.peak_mib or 0.0, timing.workspace_mib or 0.0] if ok else [math.inf] * 3
                ms, peak, workspace = _max_over_ranks(values, device)
                floor = shape.floor_ms(4) / tp
                note = ""
                if tp > 1 and 1 in per_tp and math.isfinite(ms):
                    ratio = ms / per_tp[1]
                    note = f"TP{tp}/TP1 = {ratio:.3f} (target <= {TP_RATIO_TARGET})"
                if not math.isfinite(ms):
                    reporter.fail(f"{label}: failed on some rank")
                    note = "FAILED on some rank"
                else:
                    per_tp[tp] = ms
                reporter.line(
                    f"{shape.name:<21} {backend:<7} {tp:>3} {ms:>8.2f} {floor:>6.1f} "
                    f"{_fmt(peak if device.type == 'cuda' else None, '9.0f'):>9} "
                    f"{_fmt(workspace if device.type == 'cuda' else None, '9.0f'):>9}  {note}".rstrip()
                )
                rows.append({"shape": shape.name, "backend": backend, "tp": tp, "ms": ms, "floor_ms": floor,
                             "peak_above_inputs_mib": peak, "workspace_mib": workspace, "note": note})  # fmt: skip
                _recover_device()
        reporter.dump()


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernels are generated lazily, after this
    elif not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA device is visible (use --device cpu --small to debug here)")
    runtime = init_distributed(args) if args.tp else Runtime(0, 1, torch.device(args.device))
    parts = ["tp"] if args.tp else ["single"]
    parts += (["check"] if args.run_check else []) + (["bench"] if args.bench else [])
    reporter = Reporter(Path(args.out), "gpu_check_" + "_".join(parts), runtime.rank)
    reporter.data["env"] = environment(runtime.device)
    reporter.data["args"] = vars(args)
    reporter.line(f"orda_tp gpu_check: {json.dumps(_plain(reporter.data['env']))}")
    started = time.perf_counter()
    try:
        if args.run_check:
            if args.tp:
                run_tp_checks(args, reporter, runtime)
            else:
                run_checks(args, reporter, runtime.device)
        if args.bench:
            if args.tp:
                run_tp_bench(args, reporter, runtime)
            else:
                run_bench(args, reporter, runtime.device)
    except Exception:  # noqa: BLE001 - an unexpected error in the harness itself still ends in a summary
        reporter.line(traceback.format_exc(), every_rank=True)
        reporter.fail("harness error (see the log)")
    failures = len(reporter.failures)
    if args.tp:
        failures = int(_max_over_ranks([float(failures)], runtime.device)[0]) if dist.is_initialized() else failures
    reporter.data["failures"] = reporter.failures
    reporter.data["seconds"] = time.perf_counter() - started
    reporter.dump()
    for failure in reporter.failures[:30]:
        reporter.line(f"FAIL {failure}"[:400])
    if len(reporter.failures) > 30:
        reporter.line(f"... {len(reporter.failures) - 30} more failures in {reporter.json_path}")
    verdict = "PASS" if failures == 0 else f"FAIL ({failures} failures on the worst rank)"
    reporter.line(f"== {verdict} in {time.perf_counter() - started:.1f} s; results in {reporter.json_path}")
    if args.tp and dist.is_initialized():
        dist.destroy_process_group()
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
