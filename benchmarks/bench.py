"""Speed and memory of orda_tp's loss beside a naive torch loss and other libraries ("peers"), in one
command. Correctness is checked by ``checks/gpu_check.py``.

What is timed: forward and backward of the loss only, inputs already on the device: one loss call and
``torch.autograd.grad(loss, (hidden, weight))``. bf16 inputs (fp32 with ``--small``); labels random with
1 in 7 set to ignore_index (-100); hidden states N(0, 1) and head weights N(0, σ²/H), so logits have a
standard deviation near σ = ``--logit-std`` (default 2; issue 12 measured the peers at 1, where
cut-cross-entropy skips more of its gradient blocks).
  KD: student CE + forward KL(q‖p) at T = 1, kl_weight = 1, tied frozen teacher (``TiedTeacher`` of
      hidden states that need no grad, teacher_ce_weight = 0).
  CE: the student's cross-entropy alone.
Implementations: orda_tp (backend="triton", the default profile and profile="fast"; backend="torch" on
the CPU); naive torch (full fp32 logits); and, where importable, orda-kernel (autotune off), Liger-Kernel
(fused linear CE; its chunked JSD loss with beta = 0, i.e. forward KL, plus CE, the teacher's hidden
states through the same head) and cut-cross-entropy (CE). Each loss is compared with the naive one
(relative difference ≤ 1e-2 in bf16, 1e-4 in fp32: "sanity"), and each KD and CE row's gradients
``dh``, ``dW`` with exact ones computed in fp32 over chunks of rows (``reference_grads``; relative
error ‖g − g_ref‖ / ‖g_ref‖, the worse of the two: orda_tp's must stay within 1e-2 in bf16, 1e-4 in
fp32; the others' are reported, since a peer may trade exactness for speed).
Median of 10 timed calls after 3 warm-ups (CUDA events), spread = max − min; on the CPU 2 after 1.
peak = max allocated during one call above what was allocated before it; workspace = peak less the
returned gradients. Floor = GEMMs × 2·BT·H·V at 788 TFLOP/s (KD 4 GEMMs, CE and a precomputed
teacher 3); "GEMM-only" = those GEMMs themselves run back to back by cuBLAS in the same run (each
side's logits GEMM with an fp32 result, dh, dW), and every row's ratio to it is printed. The issue's
targets are printed beside orda_tp's rows.

Parts: the anchor shapes; ``--extras`` (on by default): the 15 KL variants against forward KL's time,
the separate, the precomputed-logits and the top-64 cache teachers (both tails), and the loss terms
(label smoothing, z-loss, soft-caps, token weights), at the first shape; ``--sweep`` (on by default): KD
against the vocabulary at BT = 8192, H = 4096, plotted to bench_vocab.png; ``--tp`` under torchrun:
TP = 1 against TP = world per rank. ``--time-limit S``: no row starts after S seconds; the rows left
are listed as not run. A row that fails or runs out of memory is recorded and the run goes on.

Outputs in ``--out`` (default $OUT, else ./bench_out): bench.log, bench.json (every row),
bench_tables.md (tables to paste) and bench_vocab.png; under ``--tp`` bench_tp.log, bench_tp.json and
bench_tp_tables.md. The exit status is 1 when a row failed (running out of memory is a result, not a
failure) or a loss failed its sanity check.

Peers are made importable from their wheels in .whl/: ``pip install --no-deps --target /tmp/site .whl/*.whl``.

Commands (with the peers' wheels installed as above and PYTHONPATH=/tmp/site):
  python3 benchmarks/bench.py --out $OUT                                        # one GPU
  torchrun --standalone --nproc-per-node 2 benchmarks/bench.py --tp --out $OUT   # two GPUs
  python3 benchmarks/bench.py --small --device cpu                               # the CPU: tiny shapes
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cache, partial
from importlib import metadata
from itertools import groupby
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

# Run from a checkout without installing: the repository root holds `orda_tp`, this script's harness
# (`benchmarks/harness.py`, shared with `checks/gpu_check.py`) and the tests' variant keywords.
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
    recover_device,
    run_script,
    sync_device,
)
from orda_tp import KL_VARIANTS, PrecomputedTeacher, SeparateTeacher, TiedTeacher, distillation_loss  # noqa: E402
from orda_tp.engine.logits import logits_mm  # noqa: E402
from tests.cases import VARIANT_KWARGS  # noqa: E402
from tests.topk_cases import topk_of  # noqa: E402

MATMUL_TFLOPS = 788.0  # bf16 8192³ on an H200, measured (shared/ANCHORS.md)
WARMUP, REPEATS = 3, 10  # on a GPU; the CPU takes CPU_WARMUP, CPU_REPEATS
CPU_WARMUP, CPU_REPEATS = 1, 2
TASKS = ("KD", "CE")
TASK_GEMMS = {"KD": 4, "CE": 3}
GEMM_ONLY = "GEMM-only (cuBLAS)"  # the row of a task's unavoidable GEMMs alone
SANITY_TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-4}  # relative difference from the naive loss
# orda_tp's gradients against the fp32 reference: ‖g − g_ref‖ / ‖g_ref‖ of dh and of dW (the worse one)
GRAD_TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-4}
REFERENCE_ROWS = 1024  # rows per chunk of the fp32 reference gradients
# The naive loss's peak per logit (bf16 inputs, fp32 logits), measured at the first shape: KD 28056 MiB
# and CE 12024 MiB for 8192 × 128256 logits. Naive rows estimated above NAIVE_LIMIT_GIB are not run.
NAIVE_BYTES_PER_LOGIT = {"KD": 28.0, "CE": 12.0}
NAIVE_LIMIT_GIB = 60.0
# Issue 4's targets: (shape index, task) -> (ms, workspace MiB or None).
Target = tuple[float, float | None]
TARGETS: dict[tuple[int, str], Target] = {(0, "KD"): (50.0, 512.0), (1, "KD"): (56.0, 1024.0), (0, "CE"): (38.0, None)}
VARIANT_RATIO_TARGET = 1.25
TP_RATIO_TARGET = 0.55


@dataclass(frozen=True)
class BenchShape:
    rows: int
    hidden: int
    vocab: int

    @property
    def name(self) -> str:
        return f"BT{self.rows}_H{self.hidden}_V{self.vocab}"

    def floor_ms(self, gemms: int) -> float:
        """``gemms`` logits-sized GEMMs (2·BT·H·V each) at MATMUL_TFLOPS."""
        return gemms * 2.0 * self.rows * self.hidden * self.vocab / (MATMUL_TFLOPS * 1e12) * 1e3


@dataclass(frozen=True)
class Scale:
    """The shapes of one run: the anchors on a GPU, tiny ones with ``--small``."""

    shapes: tuple[BenchShape, ...]
    sweep_rows: int
    sweep_hidden: int
    sweep_vocabs: tuple[int, ...]

    def sweep_shapes(self) -> list[BenchShape]:
        return [BenchShape(self.sweep_rows, self.sweep_hidden, vocab) for vocab in self.sweep_vocabs]


ANCHORS = Scale(
    shapes=(BenchShape(8192, 4096, 128256), BenchShape(8192, 2304, 256000)),
    sweep_rows=8192,
    sweep_hidden=4096,
    sweep_vocabs=(32768, 65536, 128256, 256000),
)
SMALL = Scale(
    shapes=(BenchShape(64, 32, 203), BenchShape(64, 32, 512)),
    sweep_rows=64,
    sweep_hidden=32,
    sweep_vocabs=(128, 203, 512, 1024),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, default_out="bench_out")
    parser.add_argument(
        "--extras",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="every KL variant and the separate/precomputed teachers at the first shape",
    )
    parser.add_argument(
        "--sweep", action=argparse.BooleanOptionalAction, default=True, help="KD against the vocabulary, and the plot"
    )
    parser.add_argument("--time-limit", type=float, default=480.0, help="seconds after which no row starts")
    parser.add_argument(
        "--logit-std", type=float, default=2.0, help="the logits' standard deviation (head weights N(0, σ²/H))"
    )
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------------ inputs


@dataclass
class BenchInputs:
    hidden: Tensor
    weight: Tensor  # this rank's head (the whole head unless TP)
    labels: Tensor
    teacher_hidden: Tensor


def make_bench_inputs(
    shape: BenchShape,
    device: torch.device,
    dtype: torch.dtype,
    columns: tuple[int, int] | None,
    seed: int,
    logit_std: float = 2.0,
) -> BenchInputs:
    """Random (never zero) inputs; logits of standard deviation ≈ ``logit_std``; 1 label in 7 ignored."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*size, generator=generator, device=device, dtype=torch.float32) * scale).to(dtype)

    weight = randn(shape.vocab, shape.hidden, scale=logit_std / shape.hidden**0.5)
    if columns is not None:
        weight = weight[columns[0] : columns[1]].clone()
    labels = torch.randint(0, shape.vocab, (shape.rows,), generator=generator, device=device)
    labels[3::IGNORE_EVERY] = IGNORE_INDEX
    return BenchInputs(
        hidden=randn(shape.rows, shape.hidden).requires_grad_(),
        weight=weight.requires_grad_(),
        labels=labels,
        teacher_hidden=randn(shape.rows, shape.hidden),
    )


def separate_teacher(inputs: BenchInputs) -> SeparateTeacher:
    """A frozen teacher with its own head of the student's width."""
    rows, hidden = inputs.hidden.shape
    device, dtype = inputs.hidden.device, inputs.hidden.dtype
    generator = torch.Generator(device=device).manual_seed(5)
    teacher_hidden = torch.randn(rows, hidden, generator=generator, device=device).to(dtype)
    head = torch.randn(inputs.weight.shape[0], hidden, generator=generator, device=device) * (2.0 / hidden**0.5)
    return SeparateTeacher(teacher_hidden, head.to(dtype))


def precomputed_teacher(inputs: BenchInputs) -> PrecomputedTeacher:
    """The tied teacher's logits, cached in the input dtype."""
    with torch.no_grad():
        return PrecomputedTeacher(logits=inputs.teacher_hidden @ inputs.weight.detach().T)


def topk_teacher(inputs: BenchInputs, tail: str, k: int = 64) -> PrecomputedTeacher:
    """The tied teacher as a top-``k`` cache: each row's ``k`` most likely ids and their fp32
    log-probabilities (the rest of the mass as ``tail`` says)."""
    with torch.no_grad():
        ids, logprobs = topk_of(inputs.teacher_hidden @ inputs.weight.detach().T, k, dtype=torch.float32)
    return PrecomputedTeacher(topk_ids=ids, topk_logprobs=logprobs, tail=tail)


# ------------------------------------------------------------------------------------------------ steps


Step = Callable[[], tuple[Tensor, tuple[Tensor, ...]]]


def loss_step(inputs: BenchInputs, loss: Callable[[], Tensor]) -> Step:
    """fwd+bwd: ``loss()`` and its gradients with respect to the student's hidden states and head."""
    params = (inputs.hidden, inputs.weight)

    def step() -> tuple[Tensor, tuple[Tensor, ...]]:
        value = loss()
        return value.detach(), torch.autograd.grad(value, params)

    return step


def gemm_step(inputs: BenchInputs) -> Step:
    """One logits GEMM, for scale."""
    return lambda: (torch.mm(inputs.hidden.detach(), inputs.weight.detach().T), ())


def gemm_only_step(inputs: BenchInputs, task: str) -> Step:
    """The loss's unavoidable full-size GEMMs back to back in cuBLAS: each side's logits GEMM with an
    fp32 result (two for KD, the tied teacher's too; one for CE), then ``dh = G·W`` and
    ``dW = Gᵀ·h`` for a logit gradient ``G`` in the inputs' dtype (made once, outside the timing)."""
    hidden, weight, teacher = inputs.hidden.detach(), inputs.weight.detach(), inputs.teacher_hidden
    grad_logits = torch.randn(hidden.shape[0], weight.shape[0], device=hidden.device).to(hidden.dtype)
    sides = [hidden, teacher] if task == "KD" else [hidden]

    def step() -> tuple[Tensor, tuple[Tensor, ...]]:
        logits = [logits_mm(side, weight, torch.float32) for side in sides]
        return logits[0], (grad_logits @ weight, grad_logits.T @ hidden)

    return step


def orda_step(
    inputs: BenchInputs,
    task: str,
    backend: str,
    profile: str = "balanced",
    variant: str = "forward",
    teacher: TiedTeacher | SeparateTeacher | PrecomputedTeacher | None = None,
    tp: bool = False,
    terms: dict[str, object] | None = None,
) -> Step:
    """orda_tp: student CE (+ the KL variant at T=1 unless task == "CE"); the tied teacher by default;
    ``terms``: the loss terms' keywords (label smoothing, z-loss, soft-caps; ``token_weights="rand"``
    for uniform random weights of the inputs' rows)."""
    terms = dict(terms or {})
    if terms.get("token_weights") == "rand":
        generator = torch.Generator(device=inputs.labels.device).manual_seed(11)
        terms["token_weights"] = torch.rand(inputs.labels.shape, generator=generator, device=inputs.labels.device)
    kwargs: dict[str, Any] = dict(
        student_ce_weight=1.0,
        teacher_ce_weight=0.0,
        kl_weight=0.0 if task == "CE" else 1.0,
        kl_temperature=1.0,
        kl_divergence=variant,
        profile=profile,
        backend=backend,
        **VARIANT_KWARGS[variant],
        **terms,
    )
    if tp:
        kwargs["tp_group"] = dist.group.WORLD
    if teacher is None:
        teacher = TiedTeacher(inputs.teacher_hidden)
    return loss_step(
        inputs, lambda: distillation_loss(inputs.hidden, inputs.weight, inputs.labels, teacher, **kwargs).loss
    )


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


def naive_step(inputs: BenchInputs, task: str) -> Step:
    return loss_step(
        inputs, lambda: naive_loss(inputs.hidden, inputs.weight, inputs.labels, inputs.teacher_hidden, task != "CE")
    )


def reference_grads(inputs: BenchInputs, task: str) -> tuple[Tensor, Tensor]:
    """The task's exact gradients ``(dh, dW)`` in fp32, from fp32 logits over chunks of rows (fp32
    GEMMs at torch's default precision, no TF32): ``∂/∂s = (softmax(s) − onehot(y)) + (softmax(s) −
    softmax(t))`` for KD (CE + forward KL at T = 1; the CE term alone for CE), ÷ the non-ignored rows,
    0 on ignored rows."""
    hidden, weight, labels = inputs.hidden.detach(), inputs.weight.detach().float(), inputs.labels
    valid = labels != IGNORE_INDEX
    count = valid.sum().clamp(min=1)
    grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=hidden.device)
    for begin in range(0, hidden.shape[0], REFERENCE_ROWS):
        rows = slice(begin, begin + REFERENCE_ROWS)
        rows_hidden = hidden[rows].float()
        grad = (rows_hidden @ weight.T).softmax(-1)
        if task == "KD":
            grad = 2 * grad - (inputs.teacher_hidden[rows].float() @ weight.T).softmax(-1)
        kept = valid[rows]
        grad[kept.nonzero()[:, 0], labels[rows][kept]] -= 1.0
        grad *= (kept / count)[:, None]
        grad_hidden[rows] = grad @ weight
        grad_weight += grad.T @ rows_hidden
    return grad_hidden, grad_weight


def grad_error(grads: tuple[Tensor, ...], reference: tuple[Tensor, Tensor]) -> float:
    """The worse of ‖g − g_ref‖ / ‖g_ref‖ over ``dh`` and ``dW``, in fp32."""
    return max(float((g.float() - r).norm() / r.norm()) for g, r in zip(grads, reference))


# ------------------------------------------------------------------------------------------------ implementations


@dataclass(frozen=True)
class Impl:
    """One implementation: ``step(inputs, task)`` makes its fwd+bwd for a task it supports."""

    name: str
    step: Callable[[BenchInputs, str], Step]
    tasks: tuple[str, ...] = TASKS
    ours: bool = False  # orda_tp: the issue's targets apply
    in_sweep: bool = False


def orda_options(device: torch.device) -> list[tuple[str, dict[str, str]]]:
    """orda_tp's configurations under test: (name, orda_step keywords)."""
    backend = "triton" if device.type == "cuda" else "torch"
    return [
        (f"orda_tp {backend}", {"backend": backend}),
        (f"orda_tp {backend} fast", {"backend": backend, "profile": "fast"}),
    ]


def orda_impls(device: torch.device) -> list[Impl]:
    """orda_tp's configurations; the default profile also runs in the vocabulary sweep."""
    return [
        Impl(name, partial(orda_step, **options), ours=True, in_sweep=index == 0)
        for index, (name, options) in enumerate(orda_options(device))
    ]


NAIVE = Impl("naive", naive_step, in_sweep=True)


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "?"


def orda_kernel_impl(device: torch.device) -> Impl:
    """orda-kernel: the same API as orda_tp; autotuning off (its own configuration search)."""
    import orda_kernel

    config = orda_kernel.KernelConfig(autotune=False)
    backend = "triton" if device.type == "cuda" else "torch"

    def step(inputs: BenchInputs, task: str) -> Step:
        teacher = orda_kernel.TiedTeacher(inputs.teacher_hidden)
        return loss_step(
            inputs,
            lambda: orda_kernel.distillation_loss(
                inputs.hidden, inputs.weight, inputs.labels, teacher, student_ce_weight=1.0, teacher_ce_weight=0.0,
                kl_weight=0.0 if task == "CE" else 1.0, kl_temperature=1.0, ignore_index=IGNORE_INDEX,
                backend=backend, config=config,
            ).loss,
        )  # fmt: skip

    return Impl(f"orda-kernel {_version('orda-kernel')}", step, in_sweep=True)


def liger_impl(device: torch.device) -> Impl:
    """Liger-Kernel: fused linear CE; KD as its chunked JSD loss at beta=0 (forward KL(q‖p)) plus CE,
    the teacher's hidden states through the same head."""
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    ce = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)
    kd = LigerFusedLinearJSDLoss(
        weight_hard_loss=1.0, weight_soft_loss=1.0, beta=0.0, ignore_index=IGNORE_INDEX, temperature=1.0
    )

    def step(inputs: BenchInputs, task: str) -> Step:
        if task == "CE":
            return loss_step(inputs, lambda: ce(inputs.weight, inputs.hidden, inputs.labels))
        return loss_step(
            inputs, lambda: kd(inputs.hidden, inputs.weight, inputs.teacher_hidden, inputs.weight, inputs.labels)
        )

    return Impl(f"Liger-Kernel {_version('liger-kernel')}", step, in_sweep=True)


def cce_impl(device: torch.device) -> Impl:
    """cut-cross-entropy: CE only (on a GPU: its kernels do not run in Triton's interpreter). It
    runs its default kernel configurations; ``CCE_AUTOTUNE=1`` in the environment turns its
    autotuner on (recorded in the run's environment line)."""
    from cut_cross_entropy import linear_cross_entropy

    if device.type != "cuda":
        raise RuntimeError("its kernels need a GPU")

    def step(inputs: BenchInputs, task: str) -> Step:
        return loss_step(
            inputs, lambda: linear_cross_entropy(inputs.hidden, inputs.weight, inputs.labels, ignore_index=IGNORE_INDEX)
        )

    return Impl(f"cut-cross-entropy {_version('cut-cross-entropy')}", step, tasks=("CE",))


PEERS: tuple[tuple[str, Callable[[torch.device], Impl]], ...] = (
    ("orda-kernel", orda_kernel_impl),
    ("Liger-Kernel", liger_impl),
    ("cut-cross-entropy", cce_impl),
)


def load_peers(reporter: Reporter, device: torch.device) -> list[Impl]:
    """The peers that import; each one that does not is printed with the reason."""
    impls: list[Impl] = []
    status: dict[str, str] = {}
    for name, load in PEERS:
        try:
            impl = load(device)
        except Exception as error:  # noqa: BLE001 - a peer that fails to import is skipped, not fatal
            status[name] = f"skipped: {type(error).__name__}: {error}"[:300]
        else:
            impls.append(impl)
            status[name] = impl.name
        reporter.line(f"   peer {name}: {status[name]}")
    reporter.data["bench"]["peers"] = status
    return impls


# ------------------------------------------------------------------------------------------------ measuring


@dataclass
class Timing:
    ms: float
    spread_ms: float  # max − min of the timed repeats
    peak_mib: float | None  # peak above the inputs
    workspace_mib: float | None  # peak above the inputs and the returned gradients
    loss: float


def measure(step: Step, device: torch.device, barrier: bool = False) -> Timing:
    """Warm-ups, one run for memory, then the median of the timed runs (WARMUP and REPEATS on a GPU;
    CPU_WARMUP and CPU_REPEATS on the CPU, where the numbers only show that the code runs)."""
    warmup, repeats = (WARMUP, REPEATS) if device.type == "cuda" else (CPU_WARMUP, CPU_REPEATS)
    for _ in range(warmup):
        result = step()
        del result
    sync_device(device)
    gc.collect()
    peak = workspace = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    loss, grads = step()
    sync_device(device)
    if device.type == "cuda":
        peak_bytes = torch.cuda.max_memory_allocated(device) - base
        grad_bytes = sum(g.numel() * g.element_size() for g in grads if g is not None)
        peak, workspace = peak_bytes / 2**20, (peak_bytes - grad_bytes) / 2**20
    loss_value = float(loss) if loss.numel() == 1 else math.nan
    del loss, grads
    if barrier:
        dist.barrier()
    sync_device(device)
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


@dataclass
class Budget:
    """``--time-limit``: no row starts once it is spent; the rows left are remembered."""

    seconds: float
    started: float = field(default_factory=time.perf_counter)
    not_run: list[str] = field(default_factory=list)

    def spent(self, runtime: Runtime) -> bool:
        late = time.perf_counter() - self.started > self.seconds
        if dist.is_initialized():  # every rank stops at the same row: rank 0's clock decides
            late = bool(max_over_ranks([float(runtime.rank == 0 and late)], runtime.device)[0])
        return late


@dataclass
class Bench:
    """The run's state: where rows are printed and kept, the device, the dtype, the time budget."""

    reporter: Reporter
    runtime: Runtime
    dtype: torch.dtype
    budget: Budget
    seed: int
    logit_std: float = 2.0
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        return self.runtime.device


@dataclass(frozen=True)
class RowSpec:
    """One row to measure: ``step(inputs)`` makes the fwd+bwd; ``skip`` says why it is not run."""

    section: str  # "main", "extras" or "sweep"
    shape: BenchShape
    case: str  # "KD", "CE", "logits GEMM", "KD <variant>", "KD separate", ...
    impl: str
    gemms: int
    step: Callable[[BenchInputs], Step]
    target: Target | None = None
    labels: dict[str, str] = field(default_factory=dict)
    skip: str | None = None
    ours: bool = False  # orda_tp's row: its gradients must match the reference
    checks_grads: bool = False  # its gradients are compared with the fp32 reference (KD and CE rows of a shape)


BENCH_HEADER = (
    f"{'shape':<21} {'case':<19} {'impl':<24} {'ms':>8} {'spread':>7} {'floor':>6} {'x floor':>7} "
    f"{'peak MiB':>9} {'wkspc MiB':>9}  target / note"
)


def _head(spec: RowSpec) -> str:
    return f"{spec.shape.name:<21} {spec.case:<19} {spec.impl:<24}"


def spec_row(spec: RowSpec) -> dict[str, Any]:
    """The JSON record of a row, before it is measured."""
    shape = spec.shape
    return {
        "section": spec.section,
        "shape": shape.name,
        "rows": shape.rows,
        "hidden": shape.hidden,
        "vocab": shape.vocab,
        "case": spec.case,
        "impl": spec.impl,
        "gemms": spec.gemms,
        "floor_ms": shape.floor_ms(spec.gemms),
        "target": spec.target,
        "ours": spec.ours,
        **spec.labels,
    }


def _target_note(timing: Timing, target: Target | None) -> tuple[str, bool | None]:
    """The issue's target as text and whether the row meets it (None without a target)."""
    if target is None:
        return "", None
    ms_target, mib_target = target
    text = f"<={ms_target:g} ms" + (f", wkspc <={mib_target:g} MiB" if mib_target else "")
    met = timing.ms <= ms_target and (mib_target is None or (timing.workspace_mib or 0.0) <= mib_target)
    return f"{text}: {'meets' if met else 'misses'}", met


def run_spec(
    bench: Bench, spec: RowSpec, inputs: BenchInputs | None, reference: Callable[[str], tuple[Tensor, Tensor]]
) -> dict[str, Any]:
    """Measure one row and print it; without inputs (the time budget was spent first) it is not run.
    A row that ``checks_grads`` then runs once more, its gradients against ``reference(case)``."""
    row = spec_row(spec)
    label = f"{spec.shape.name} {spec.case} {spec.impl}"
    if spec.skip is not None:
        row.update(status="skipped", message=spec.skip)
    elif inputs is None or bench.budget.spent(bench.runtime):
        row.update(status="not run", message="--time-limit reached")
        bench.budget.not_run.append(label)
    else:
        ok, timing = guarded(bench.reporter, label, lambda: measure(spec.step(inputs), bench.device))
        recover_device()
        if ok:
            note, met = _target_note(timing, spec.target)
            x_floor = timing.ms / row["floor_ms"] if bench.device.type == "cuda" else None  # the floor is a GPU's
            row.update(status="ok", ms=timing.ms, spread_ms=timing.spread_ms, x_floor=x_floor)
            row.update(peak_mib=timing.peak_mib, workspace_mib=timing.workspace_mib, loss=timing.loss)
            row.update(target_met=met, note=note)
            if spec.checks_grads:
                checked, error = guarded(
                    bench.reporter, f"{label} gradients",
                    lambda: grad_error(spec.step(inputs)()[1], reference(spec.case)),
                )  # fmt: skip
                row.update(grad_err=error if checked else math.nan)
                recover_device()
        elif timing.startswith("OutOfMemoryError"):
            row.update(status="OOM", message=timing)
        else:
            row.update(status="error", message=timing)
            bench.reporter.fail(f"bench {label}: {timing}")
    print_row(bench.reporter, spec, row)
    bench.rows.append(row)
    return row


def print_row(reporter: Reporter, spec: RowSpec, row: dict[str, Any]) -> None:
    if row["status"] != "ok":
        reporter.line(f"{_head(spec)} {row['status'].upper():>8}  {row['message']}")
        return
    reporter.line(
        f"{_head(spec)} {row['ms']:>8.2f} {row['spread_ms']:>7.2f} {row['floor_ms']:>6.1f} "
        f"{fmt(row['x_floor'], '7.2f'):>7} {fmt(row['peak_mib'], '9.0f'):>9} {fmt(row['workspace_mib'], '9.0f'):>9}  "
        f"{row['note']}".rstrip()
    )


def run_specs(bench: Bench, specs: Iterable[RowSpec]) -> None:
    """Consecutive rows of one shape share its inputs; each shape's losses are checked against naive."""
    for shape, group in groupby(specs, key=lambda spec: spec.shape):
        inputs = None
        if not bench.budget.spent(bench.runtime):
            ok, inputs = guarded(
                bench.reporter, f"inputs {shape.name}",
                lambda s=shape: make_bench_inputs(s, bench.device, bench.dtype, None, bench.seed, bench.logit_std),
            )  # fmt: skip
            if not ok:
                bench.reporter.fail(f"bench inputs {shape.name}: {inputs}")
                continue
        reference = cache(partial(reference_grads, inputs))  # per task, on first use
        rows = [run_spec(bench, spec, inputs, reference) for spec in group]
        del reference
        check_sanity(bench, rows)
        del inputs
        recover_device()
        bench.reporter.dump()


def check_sanity(bench: Bench, rows: list[dict[str, Any]]) -> None:
    """Each KD and CE loss against the naive one of the same shape (whose GEMM rounds logits to bf16),
    and the gradients against the fp32 reference: orda_tp's beyond GRAD_TOLERANCE fail the run, the
    others' are reported (a peer may trade exactness for speed)."""
    tolerance, grad_tolerance = SANITY_TOLERANCE[bench.dtype], GRAD_TOLERANCE[bench.dtype]
    naive = {r["case"]: r["loss"] for r in rows if r["impl"] == NAIVE.name and r["status"] == "ok"}
    for row in rows:
        if "grad_err" in row:
            error = row["grad_err"]
            row["grad_sanity"] = "ok" if error <= grad_tolerance else "FAIL" if row["ours"] else "over"
            bench.reporter.line(
                f"   gradients {row['shape']} {row['case']}: {row['impl']} rel error {error:.1e} against the fp32 "
                f"reference (limit {grad_tolerance:g} for orda_tp) {row['grad_sanity']}"
            )
            if row["grad_sanity"] == "FAIL":
                bench.reporter.fail(f"bench gradients {row['shape']} {row['case']} {row['impl']}: error {error:.2e}")
        if row["impl"] in (NAIVE.name, GEMM_ONLY) or row["status"] != "ok" or row["case"] not in naive:
            continue
        expected = naive[row["case"]]
        rel = abs(row["loss"] - expected) / max(abs(expected), 1e-30)
        ok = math.isfinite(rel) and rel <= tolerance
        row.update(sanity_rel=rel, sanity="ok" if ok else "FAIL")
        bench.reporter.line(
            f"   sanity {row['shape']} {row['case']}: {row['impl']} loss {row['loss']:.6f} vs naive {expected:.6f} "
            f"(rel {rel:.1e}, limit {tolerance:g}) {row['sanity']}"
        )
        if not ok:
            bench.reporter.fail(f"bench sanity {row['shape']} {row['case']} {row['impl']}: rel diff {rel:.2e}")


# ------------------------------------------------------------------------------------------------ the rows


def naive_skip(shape: BenchShape, task: str, device: torch.device) -> str | None:
    """Why the naive loss is not run at this shape (its estimated peak is too large), or None."""
    gib = NAIVE_BYTES_PER_LOGIT[task] * shape.rows * shape.vocab / 2**30
    if device.type != "cuda" or gib <= NAIVE_LIMIT_GIB:
        return None
    return f"estimated {gib:.0f} GiB > {NAIVE_LIMIT_GIB:g} GiB"


def task_specs(
    section: str, shape: BenchShape, task: str, impls: list[Impl], device: torch.device, target: Target | None = None
) -> list[RowSpec]:
    """Every implementation that supports ``task`` at ``shape``; the target goes to orda_tp's rows."""
    return [
        RowSpec(
            section=section,
            shape=shape,
            case=task,
            impl=impl.name,
            gemms=TASK_GEMMS[task],
            step=partial(impl.step, task=task),
            target=target if impl.ours else None,
            skip=naive_skip(shape, task, device) if impl is NAIVE else None,
            ours=impl.ours,
            checks_grads=section == "main",
        )
        for impl in impls
        if task in impl.tasks
    ]


def main_specs(scale: Scale, impls: list[Impl], device: torch.device, small: bool) -> list[RowSpec]:
    """Per anchor shape: one logits GEMM, then KD and CE for every implementation."""
    specs: list[RowSpec] = []
    for index, shape in enumerate(scale.shapes):
        specs.append(RowSpec("main", shape, "logits GEMM", "torch.mm", 1, gemm_step))
        for task in TASKS:
            target = None if small else TARGETS.get((index, task))
            gemm_only = partial(gemm_only_step, task=task)
            specs.append(RowSpec("main", shape, task, GEMM_ONLY, TASK_GEMMS[task], gemm_only))
            specs += task_specs("main", shape, task, impls, device, target)
    return specs


def report_gemm_ratios(bench: Bench) -> None:
    """Each implementation's time over the GEMM-only time of its shape and task (same run)."""
    main = [r for r in bench.rows if r["section"] == "main" and r["status"] == "ok"]
    gemm_only = {(r["shape"], r["case"]): r["ms"] for r in main if r["impl"] == GEMM_ONLY}
    for row in main:
        floor = gemm_only.get((row["shape"], row["case"]))
        if floor is None or row["impl"] == GEMM_ONLY:
            continue
        row["x_gemm_only"] = row["ms"] / floor
        bench.reporter.line(
            f"   {row['shape']} {row['case']} {row['impl']}: {row['ms']:.2f} ms = {row['x_gemm_only']:.3f} x GEMM-only "
            f"({floor:.2f} ms)"
        )


#: The student's loss terms timed beside KD (``--extras``), each against KD without them.
LOSS_TERMS: dict[str, dict[str, object]] = {
    "label smoothing": {"label_smoothing": 0.1},
    "z-loss": {"z_loss_weight": 1e-4},
    "soft-caps": {"logit_softcap": 30.0, "teacher_logit_softcap": 30.0},
    "token weights": {"token_weights": "rand"},  # a (BT,) tensor in [0, 1), made for the inputs
    "all": {
        "label_smoothing": 0.1, "z_loss_weight": 1e-4, "logit_softcap": 30.0, "teacher_logit_softcap": 30.0,
        "token_weights": "rand",
    },
}  # fmt: skip


def extras_specs(shape: BenchShape, device: torch.device) -> list[RowSpec]:
    """KD with every KL variant, with a separate and a precomputed-logits teacher, and with the
    student's loss terms (orda_tp's default)."""
    name, options = orda_options(device)[0]

    def row(case: str, gemms: int, step: Callable[[BenchInputs], Step], **labels: str) -> RowSpec:
        return RowSpec(section="extras", shape=shape, case=case, impl=name, gemms=gemms, step=step, labels=labels)

    specs = [
        row(
            f"KD {variant}",
            TASK_GEMMS["KD"],
            partial(orda_step, task="KD", variant=variant, **options),
            variant=variant,
        )
        for variant in KL_VARIANTS
    ]
    teachers = (
        ("separate", separate_teacher, 4),
        ("precomputed", precomputed_teacher, 3),
        ("top-64 uniform", partial(topk_teacher, tail="uniform"), 3),
        ("top-64 renormalize", partial(topk_teacher, tail="renormalize"), 3),
    )
    for teacher, make, gemms in teachers:
        specs.append(
            row(
                f"KD {teacher}",
                gemms,
                lambda inputs, m=make: orda_step(inputs, "KD", teacher=m(inputs), **options),
                teacher=teacher,
            )
        )
    for term, keywords in LOSS_TERMS.items():
        specs.append(
            row(f"KD + {term}", TASK_GEMMS["KD"], partial(orda_step, task="KD", terms=keywords, **options), term=term)
        )
    return specs


def sweep_specs(scale: Scale, impls: list[Impl], device: torch.device) -> list[RowSpec]:
    """KD at the sweep's vocabularies that the anchor shapes do not already cover."""
    swept = [impl for impl in impls if impl.in_sweep]
    return [
        spec
        for shape in scale.sweep_shapes()
        if shape not in scale.shapes
        for spec in task_specs("sweep", shape, "KD", swept, device)
    ]


def sweep_rows(bench: Bench, scale: Scale, impls: list[Impl]) -> list[dict[str, Any]]:
    """The sweep's points: KD rows at the sweep's (BT, H), from the sweep and the anchor shapes."""
    names = {impl.name for impl in impls if impl.in_sweep}
    return [
        row
        for row in bench.rows
        if row["section"] in ("main", "sweep")
        and row["case"] == "KD"
        and row["impl"] in names
        and (row["rows"], row["hidden"]) == (scale.sweep_rows, scale.sweep_hidden)
        and row["vocab"] in scale.sweep_vocabs
    ]


# ------------------------------------------------------------------------------------------------ one device


def run_bench(args: argparse.Namespace, bench: Bench, scale: Scale) -> None:
    """The anchor shapes for every implementation, then the extras and the sweep; then the plot and
    the tables."""
    reporter, device = bench.reporter, bench.device
    rate = matmul_rate(device)
    reporter.data["bench"] = {
        "matmul_tflops": rate,
        "dtype": str(bench.dtype),
        "logit_std": bench.logit_std,
        "rows": bench.rows,
    }
    reps = f"{REPEATS} after {WARMUP} warm-ups" if device.type == "cuda" else f"{CPU_REPEATS} after {CPU_WARMUP}"
    reporter.line(
        f"== bench: fwd+bwd of the loss, {str(bench.dtype).replace('torch.', '')}, KD = student CE + forward KL "
        f"(T=1, tied frozen teacher), CE = student CE; 1 label in {IGNORE_EVERY} ignored; median of {reps}; "
        f"floor = GEMMs × 2·BT·H·V at {MATMUL_TFLOPS:g} TFLOP/s (measured here: {fmt(rate, '.0f')} TFLOP/s)"
    )
    reporter.line("   peak = max allocated above the inputs; wkspc = the same less the returned gradients")
    impls = orda_impls(device) + [NAIVE] + load_peers(reporter, device)
    specs = main_specs(scale, impls, device, args.small)
    if args.extras:
        specs += extras_specs(scale.shapes[0], device)
    if args.sweep:
        specs += sweep_specs(scale, impls, device)
    reporter.line(BENCH_HEADER)
    run_specs(bench, specs)
    report_gemm_ratios(bench)
    if args.extras:
        report_variant_ratios(bench)
    report_not_run(bench)
    sweep = sweep_rows(bench, scale, impls) if args.sweep else []
    if sweep:
        plot_sweep(bench, scale, sweep, bench.reporter.out_dir / "bench_vocab.png")
    write_tables(bench, bench.reporter.out_dir / "bench_tables.md", sweep)


def report_variant_ratios(bench: Bench) -> None:
    """Each variant's time over forward KL's, against VARIANT_RATIO_TARGET."""
    timed = {r["variant"]: r for r in bench.rows if "variant" in r and r["status"] == "ok"}
    if "forward" not in timed:
        return
    for row in timed.values():
        row["ratio_to_forward"] = row["ms"] / timed["forward"]["ms"]
    ratios = {variant: row["ratio_to_forward"] for variant, row in timed.items()}
    slow = {v: round(r, 3) for v, r in ratios.items() if r > VARIANT_RATIO_TARGET}
    bench.reporter.line(f"   variants over {VARIANT_RATIO_TARGET}x forward KL's time: {slow or 'none'}")
    bench.reporter.data["bench"]["variant_ratios"] = ratios
    terms = [r for r in bench.rows if "term" in r and r["status"] == "ok"]
    for row in terms:
        row["ratio_to_forward"] = row["ms"] / timed["forward"]["ms"]
        bench.reporter.line(f"   KD + {row['term']}: {row['ratio_to_forward']:.3f}x KD without it")


def report_not_run(bench: Bench) -> None:
    """The rows that --time-limit left out, printed and in the JSON record."""
    not_run = bench.budget.not_run
    bench.reporter.data["not_run"] = not_run
    if not_run:
        bench.reporter.line(f"-- NOT RUN ({len(not_run)} rows, --time-limit {bench.budget.seconds:g} s reached):")
        for label in not_run:
            bench.reporter.line(f"   {label}")


def plot_sweep(bench: Bench, scale: Scale, rows: list[dict[str, Any]], path: Path) -> None:
    """bench_vocab.png: time and workspace (log scale) against V, a line per implementation, the KD floor."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        bench.reporter.line(f"   plot skipped: matplotlib is not importable ({error})")
        return
    figure, (times, memory) = plt.subplots(1, 2, figsize=(12, 4.5))
    for impl, group in groupby(sorted(rows, key=lambda r: (r["impl"], r["vocab"])), key=lambda r: r["impl"]):
        group = list(group)
        points = [r for r in group if r["status"] == "ok"]
        missing = ", ".join(f"{r['status']} at V={r['vocab']}" for r in group if r["status"] != "ok")
        label = f"{impl} ({missing})" if missing else impl
        vocabs = [p["vocab"] for p in points]
        times.plot(vocabs, [p["ms"] for p in points], marker="o", label=label)
        if points and points[0]["workspace_mib"] is not None:
            memory.plot(vocabs, [max(p["workspace_mib"], 1e-3) for p in points], marker="o", label=label)
    floors = [shape.floor_ms(TASK_GEMMS["KD"]) for shape in scale.sweep_shapes()]
    times.plot(scale.sweep_vocabs, floors, "k--", label=f"KD floor (4 GEMMs at {MATMUL_TFLOPS:g} TFLOP/s)")
    title = f"KD fwd+bwd, BT={scale.sweep_rows}, H={scale.sweep_hidden}, {str(bench.dtype).replace('torch.', '')}"
    device_name = bench.reporter.data["env"].get("gpu", str(bench.device))
    times.set(xlabel="vocabulary V", ylabel="ms", xscale="log", title=f"{title}, {device_name}")
    memory.set(xlabel="vocabulary V", ylabel="workspace MiB (peak less gradients)", xscale="log", yscale="log")
    memory.set_xlim(times.get_xlim())
    if not memory.lines:
        memory.text(0.5, 0.5, f"not measured on {bench.device.type}", ha="center", transform=memory.transAxes)
    for axes in (times, memory):
        axes.set_xticks(scale.sweep_vocabs, [str(v) for v in scale.sweep_vocabs], minor=False)
        axes.minorticks_off()
        axes.grid(True, alpha=0.3)
        if axes.lines:
            axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    bench.reporter.line(f"   plot: {path}")


# ------------------------------------------------------------------------------------------------ tables


def _cell(value: float | None, spec: str) -> str:
    return fmt(value, spec) if value is not None and math.isfinite(value) else "-"


def _ms_cell(row: dict[str, Any]) -> str:
    """The time, or what happened instead."""
    if row["status"] == "ok":
        return f"{row['ms']:.1f}"
    return {"skipped": f"skipped ({row.get('message', '')})", "not run": "not run"}.get(row["status"], row["status"])


def _sanity_cell(row: dict[str, Any]) -> str:
    """The loss against naive, ``ok (rel)``; then the gradients' error against the fp32 reference."""
    loss = f"{row['sanity']} ({row['sanity_rel']:.0e})" if "sanity" in row else "-"
    return loss if "grad_err" not in row else f"{loss}; grads {row['grad_err']:.1e}"


def _table(header: list[str], lines: Iterable[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(cells) + " |" for cells in lines]


def main_tables(bench: Bench) -> list[str]:
    """Per anchor shape: task, implementation, ms, floor, × floor, memory, target, sanity."""
    out: list[str] = []
    main = [r for r in bench.rows if r["section"] == "main"]
    for shape, rows in groupby(main, key=lambda r: r["shape"]):
        out += ["", f"### {shape}", ""]
        out += _table(
            ["task", "implementation", "ms", "floor ms", "× floor", "× GEMM-only", "peak MiB", "workspace MiB",
             "target", "sanity"],
            (
                [r["case"], r["impl"], _ms_cell(r), f"{r['floor_ms']:.1f}", _cell(r.get("x_floor"), ".2f"),
                 _cell(r.get("x_gemm_only"), ".3f"), _cell(r.get("peak_mib"), ".0f"),
                 _cell(r.get("workspace_mib"), ".0f"), r.get("note") or "-", _sanity_cell(r)]
                for r in rows
            ),
        )  # fmt: skip
    return out


def extras_tables(bench: Bench) -> list[str]:
    """Every variant against forward KL; the teacher modes (the tied one from the first shape's KD row)."""
    variants = [r for r in bench.rows if "variant" in r]
    teachers = [r for r in bench.rows if "teacher" in r]
    if not variants or not teachers:
        return []
    impl, shape = variants[0]["impl"], variants[0]["shape"]
    out = ["", f"### Every KL variant (KD, {impl}, {shape})", ""]
    out += _table(
        ["variant", "ms", "÷ forward", "peak MiB", "workspace MiB"],
        (
            [r["variant"], _ms_cell(r), _cell(r.get("ratio_to_forward"), ".2f"), _cell(r.get("peak_mib"), ".0f"),
             _cell(r.get("workspace_mib"), ".0f")]
            for r in variants
        ),
    )  # fmt: skip
    terms = [r for r in bench.rows if "term" in r]
    out += ["", f"### Loss terms (KD, forward KL, {impl}, {shape})", ""]
    out += _table(
        ["term", "ms", "÷ KD without it", "peak MiB"],
        ([r["term"], _ms_cell(r), _cell(r.get("ratio_to_forward"), ".3f"), _cell(r.get("peak_mib"), ".0f")]
         for r in terms),
    )  # fmt: skip
    tied = [
        {**r, "teacher": "tied"}
        for r in bench.rows
        if r["section"] == "main" and (r["shape"], r["case"], r["impl"]) == (shape, "KD", impl)
    ]
    out += ["", f"### Teacher modes (KD, forward KL, frozen teacher, {impl}, {shape})", ""]
    out += _table(
        ["teacher", "GEMMs at the floor", "floor ms", "ms", "× floor", "peak MiB", "workspace MiB"],
        (
            [r["teacher"], str(r["gemms"]), f"{r['floor_ms']:.1f}", _ms_cell(r), _cell(r.get("x_floor"), ".2f"),
             _cell(r.get("peak_mib"), ".0f"), _cell(r.get("workspace_mib"), ".0f")]
            for r in tied + teachers
        ),
    )  # fmt: skip
    return out


def write_markdown(bench: Bench, path: Path, lines: list[str]) -> None:
    """``lines``, then the rows that --time-limit left out, to ``path``."""
    if bench.budget.not_run:
        lines = lines + ["", f"Not run (--time-limit {bench.budget.seconds:g} s): " + "; ".join(bench.budget.not_run)]
    path.write_text("\n".join(lines) + "\n")
    bench.reporter.line(f"   tables: {path}")


def write_tables(bench: Bench, path: Path, sweep: list[dict[str, Any]]) -> None:
    """bench_tables.md: the tables, ready to paste."""
    env = bench.reporter.data["env"]
    lines = [
        "# orda_tp benchmark",
        "",
        f"{env.get('gpu', env['device'])}; torch {env['torch']}, triton {env['triton']}, orda_tp {env['orda_tp']} "
        f"(commit {env.get('git') or '?'}); {str(bench.dtype).replace('torch.', '')}; logits of std "
        f"≈ {bench.logit_std:g}; measured matmul "
        f"{fmt(bench.reporter.data['bench'].get('matmul_tflops'), '.0f')} TFLOP/s; floor at {MATMUL_TFLOPS:g} TFLOP/s.",
    ]
    lines += main_tables(bench) + extras_tables(bench)
    if sweep:
        lines += ["", "### Vocabulary sweep (KD)", ""]
        lines += _table(
            ["V", "implementation", "ms", "floor ms", "× floor", "workspace MiB"],
            (
                [str(r["vocab"]), r["impl"], _ms_cell(r), f"{r['floor_ms']:.1f}", _cell(r.get("x_floor"), ".2f"),
                 _cell(r.get("workspace_mib"), ".0f")]
                for r in sorted(sweep, key=lambda r: (r["vocab"], r["impl"]))
            ),
        )  # fmt: skip
    write_markdown(bench, path, lines)


# ------------------------------------------------------------------------------------------------ TP


def run_tp_bench(bench: Bench, scale: Scale) -> None:
    """TP=1 (the full head on each rank alone) and TP=world per rank, same global shape."""
    reporter, runtime, device = bench.reporter, bench.runtime, bench.device
    reporter.line(
        f"== TP bench: KD (student CE + forward KL, tied frozen teacher), per rank, TP=1 vs TP={runtime.world}; "
        f"ms = max over ranks of each rank's median"
    )
    reporter.line(f"{'shape':<21} {'impl':<24} {'TP':>3} {'ms':>8} {'floor':>6} {'peak MiB':>9} {'wkspc MiB':>9}  note")
    reporter.data["tp_bench"] = {"rows": bench.rows, "world": runtime.world}
    for shape in scale.shapes:
        for name, options in orda_options(device):
            per_tp: dict[int, float] = {}
            for tp in (1, runtime.world):
                tp_row(bench, shape, name, options, tp, per_tp)
        reporter.dump()
    report_not_run(bench)
    write_tp_tables(bench, bench.reporter.out_dir / "bench_tp_tables.md")


def tp_row(
    bench: Bench, shape: BenchShape, name: str, options: dict[str, str], tp: int, per_tp: dict[int, float]
) -> None:
    """One TP row: every rank measures its shard (the whole head when tp == 1); the slowest rank counts."""
    reporter, runtime, device = bench.reporter, bench.runtime, bench.device
    label = f"tp bench {shape.name} {name} TP={tp}"
    if bench.budget.spent(runtime):
        bench.budget.not_run.append(label)
        return
    columns = None if tp == 1 else column_ranges(shape.vocab, runtime.world)[runtime.rank]

    def run() -> Timing:
        inputs = make_bench_inputs(shape, device, bench.dtype, columns, bench.seed, bench.logit_std)
        try:
            return measure(orda_step(inputs, "KD", tp=tp > 1, **options), device, barrier=True)
        finally:
            del inputs

    ok, timing = guarded(reporter, label, run)
    dist.barrier()
    values = [timing.ms, timing.peak_mib or 0.0, timing.workspace_mib or 0.0] if ok else [math.inf] * 3
    ms, peak, workspace = max_over_ranks(values, device)
    floor = shape.floor_ms(TASK_GEMMS["KD"]) / tp
    ratio = ms / per_tp[1] if tp > 1 and 1 in per_tp and math.isfinite(ms) else None
    note = "" if ratio is None else f"TP{tp}/TP1 = {ratio:.3f} (target <= {TP_RATIO_TARGET})"
    if not math.isfinite(ms):
        reporter.fail(f"{label}: failed on some rank")
        note = "FAILED on some rank"
    else:
        per_tp[tp] = ms
    on_gpu = device.type == "cuda"
    reporter.line(
        f"{shape.name:<21} {name:<24} {tp:>3} {ms:>8.2f} {floor:>6.1f} {fmt(peak if on_gpu else None, '9.0f'):>9} "
        f"{fmt(workspace if on_gpu else None, '9.0f'):>9}  {note}".rstrip()
    )
    bench.rows.append(
        {"shape": shape.name, "impl": name, "tp": tp, "ms": ms, "floor_ms": floor, "tp_ratio": ratio,
         "peak_mib": peak if on_gpu else None, "workspace_mib": workspace if on_gpu else None, "note": note}
    )  # fmt: skip
    recover_device()


def write_tp_tables(bench: Bench, path: Path) -> None:
    """bench_tp_tables.md (rank 0): per shape and implementation, TP=1 and TP=world per rank."""
    if bench.runtime.rank != 0:
        return
    lines = [f"# orda_tp TP benchmark (KD, per rank; target TP2 ÷ TP1 <= {TP_RATIO_TARGET})", ""]
    lines += _table(
        ["shape", "implementation", "TP", "ms per rank", "floor per rank", "TP2 ÷ TP1", "peak MiB", "workspace MiB"],
        (
            [r["shape"], r["impl"], str(r["tp"]), _cell(r["ms"], ".1f"), f"{r['floor_ms']:.1f}",
             _cell(r["tp_ratio"], ".3f"), _cell(r["peak_mib"], ".0f"), _cell(r["workspace_mib"], ".0f")]
            for r in bench.rows
        ),
    )  # fmt: skip
    write_markdown(bench, path, lines)


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scale = SMALL if args.small else ANCHORS

    def body(reporter: Reporter, runtime: Runtime) -> None:
        dtype = torch.float32 if runtime.device.type == "cpu" else torch.bfloat16
        bench = Bench(reporter, runtime, dtype, Budget(args.time_limit), args.seed, args.logit_std)
        if args.tp:
            run_tp_bench(bench, scale)
        else:
            run_bench(args, bench, scale)

    return run_script(args, "bench_tp" if args.tp else "bench", body)


if __name__ == "__main__":
    sys.exit(main())
