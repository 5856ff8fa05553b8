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
Implementations: orda_tp (backend="triton", the default profile and profile="fast", and in the main and
rows sections also the default under ``KernelConfig(workspace_mib=1024)`` and ``2048``, "wkspc 1024"
and "wkspc 2048"; backend="torch" on the CPU); naive torch (full fp32 logits); and, where importable,
orda-kernel (autotune off), Liger-Kernel (fused linear CE; its chunked JSD loss with beta = 0, i.e.
forward KL, plus CE, the teacher's hidden states through the same head) and cut-cross-entropy (CE).
Each loss is compared with the naive one (relative difference ≤ 1e-2 in bf16, 1e-4 in fp32:
"sanity"), and each KD and CE row's gradients ``dh``, ``dW`` in the main and rows sections with exact
ones computed in fp32 over chunks of rows (``grad_precision.reference_grads``; relative error
‖g − g_ref‖ / ‖g_ref‖, the worse of the two: orda_tp's must stay within 1e-2 in bf16, 1e-4 in fp32;
the others' are reported, since a peer may trade exactness for speed).
Median of 10 timed calls after 3 warm-ups (CUDA events), spread = max − min; on the CPU 2 after 1.
peak = max allocated during one call above what was allocated before it; workspace = peak less the
returned gradients. Floor = GEMMs × 2·BT·H·V at 788 TFLOP/s (KD 4 GEMMs, CE and a precomputed
teacher 3); "GEMM-only" = those GEMMs themselves run back to back by cuBLAS in the same run (each
side's logits GEMM with an fp32 result, dh, dW), and every row's ratio to the GEMM-only row of its
section, shape and case is printed. Issue 24's targets (× GEMM-only) are printed beside orda_tp's profiles' ratios.

Parts: the anchor shapes ("main"); "teachers": KD with a separate frozen teacher of another width
(BT = 8192, student H_s = 2048, teacher H_t = 4096, V = 128256: ``SeparateTeacher`` of hidden states
(BT, H_t) and a head (V, H_t)) for orda_tp's profiles, orda-kernel and Liger-Kernel, beside its own
GEMM-only row (floor: 5 GEMMs at H_s, the teacher's logits GEMM counting 2); ``--extras`` (on by
default): the 15 KL variants against forward KL's time, the separate (of the student's width), the
precomputed-logits and the top-64 cache teachers (both tails), and the loss terms (label smoothing,
z-loss, soft-caps, token weights), at the first shape; ``--sweep`` (on by default): KD against the
vocabulary at BT = 8192, H = 4096, plotted to bench_vocab.png; ``--rows-sweep`` (on by default, section
"rows"): KD at BT = 2048, 8192, 32768 and CE at BT = 8192, 32768 (H = 4096, V = 128256; BT = 8192 are
the first shape's rows), each with its GEMM-only row, plotted as µs per token to bench_rows.png;
``--precision`` (on by default): the gradients' errors on three data sets and three cases at BT = 4096,
H = 4096, V = 128256 (benchmarks/grad_precision.py says what); ``--tp`` under torchrun: TP = 1 against
TP = world per rank. ``--small``: tiny shapes throughout (``SMALL``). They run in the order main,
teachers, rows, precision, extras, vocabulary sweep. ``--time-limit S``: no row (and no precision
case) starts after S seconds; the rows left are listed as not run. A row that fails or runs out of
memory is recorded and the run goes on.

Outputs in ``--out`` (default $OUT, else ./bench_out): bench.log, bench.json (every row; the precision
part under "precision"), bench_tables.md (tables to paste), bench_vocab.png and bench_rows.png; under
``--tp`` bench_tp.log, bench_tp.json and bench_tp_tables.md. The exit status is 1 when a row failed
(running out of memory is a result, not a failure) or a loss failed its sanity check.

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
from collections.abc import Callable, Iterable, Sequence
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
# (`benchmarks/harness.py`, shared with `checks/gpu_check.py`), its gradient-precision part
# (`benchmarks/grad_precision.py`) and the tests' variant keywords.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The harness comes in before orda_tp (grad_precision imports it first): it sets the NCCL and Triton environment.
from benchmarks.grad_precision import TASK_WEIGHTS, Contender, Problem, grad_errors, run_precision  # noqa: E402
from benchmarks.grad_precision import reference_grads as exact_grads  # noqa: E402
from benchmarks.harness import (  # noqa: E402
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
from benchmarks.harness import pyplot as harness_pyplot  # noqa: E402
from orda_tp import (  # noqa: E402
    KL_VARIANTS,
    KernelConfig,
    PrecomputedTeacher,
    SeparateTeacher,
    TiedTeacher,
    distillation_loss,
)
from orda_tp.engine.logits import logits_mm  # noqa: E402
from tests.support.cases import VARIANT_KWARGS  # noqa: E402
from tests.support.topk_cases import topk_of  # noqa: E402

MATMUL_TFLOPS = 788.0  # bf16 8192³ on an H200, measured (shared/ANCHORS.md)
WARMUP, REPEATS = 3, 10  # on a GPU; the CPU takes CPU_WARMUP, CPU_REPEATS
CPU_WARMUP, CPU_REPEATS = 1, 2
TASKS = ("KD", "CE")  # the timed tasks; TASK_WEIGHTS (grad_precision.py) also has "KL", forward KL alone
TASK_GEMMS = {"KD": 4, "CE": 3}
GEMM_ONLY = "GEMM-only (cuBLAS)"  # the row of a task's unavoidable GEMMs alone
SANITY_TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-4}  # relative difference from the naive loss
# orda_tp's gradients against the fp32 reference: ‖g − g_ref‖ / ‖g_ref‖ of dh and of dW (the worse one)
GRAD_TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-4}
# The naive loss's peak per logit (bf16 inputs, fp32 logits), measured at the first shape: KD 28056 MiB
# and CE 12024 MiB for 8192 × 128256 logits. Naive rows estimated above NAIVE_LIMIT_GIB are not run.
NAIVE_BYTES_PER_LOGIT = {"KD": 28.0, "CE": 12.0}
NAIVE_LIMIT_GIB = 60.0
# Issue 24's targets for the default layout: (shape index, task) -> the largest time over the
# GEMM-only row of the same shape and task, in the same run.
Target = float
TARGETS: dict[tuple[int, str], Target] = {(0, "KD"): 1.17, (1, "KD"): 1.28}
VARIANT_RATIO_TARGET = 1.25
# Explicit workspace caps (KernelConfig.workspace_mib) timed beside orda_tp's profiles, in the main and
# rows sections.
WORKSPACE_MIBS = (1024, 2048)
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
    kd_row_counts: tuple[int, ...]  # the BT sweep of KD, at the first shape's H and V (its BT among them)
    ce_row_counts: tuple[int, ...]  # and of CE
    separate: BenchShape  # the student of the separate teacher of another width
    separate_width: int  # that teacher's width H_t (a multiple of the student's)
    precision: BenchShape  # the gradient-precision part's shape

    def sweep_shapes(self) -> list[BenchShape]:
        return [BenchShape(self.sweep_rows, self.sweep_hidden, vocab) for vocab in self.sweep_vocabs]

    def row_counts(self, task: str) -> tuple[int, ...]:
        return self.kd_row_counts if task == "KD" else self.ce_row_counts


ANCHORS = Scale(
    shapes=(BenchShape(8192, 4096, 128256), BenchShape(8192, 2304, 256000)),
    sweep_rows=8192,
    sweep_hidden=4096,
    sweep_vocabs=(32768, 65536, 128256, 256000),
    kd_row_counts=(2048, 8192, 32768),
    ce_row_counts=(8192, 32768),
    separate=BenchShape(8192, 2048, 128256),
    separate_width=4096,
    precision=BenchShape(4096, 4096, 128256),
)
SMALL = Scale(
    shapes=(BenchShape(64, 32, 203), BenchShape(64, 32, 512)),
    sweep_rows=64,
    sweep_hidden=32,
    sweep_vocabs=(128, 203, 512, 1024),
    kd_row_counts=(32, 64, 256),
    ce_row_counts=(64, 256),
    separate=BenchShape(64, 16, 203),
    separate_width=32,
    precision=BenchShape(64, 32, 203),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, default_out="bench_out")
    parts = {
        "--extras": "every KL variant and the separate/precomputed teachers at the first shape",
        "--sweep": "KD against the vocabulary, and the plot",
        "--rows-sweep": "KD and CE against the rows BT, and the plot",
        "--precision": "gradient errors on three data sets and three cases (benchmarks/grad_precision.py)",
    }
    for flag, text in parts.items():
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=True, help=text)
    parser.add_argument("--time-limit", type=float, default=480.0, help="seconds after which no row starts")
    parser.add_argument(
        "--extras-cases", default=None, help="comma list: only the --extras rows whose case names one of these"
    )
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


def separate_teacher(inputs: BenchInputs, width: int | None = None, seed: int = 5) -> SeparateTeacher:
    """A frozen teacher with its own hidden states and head, of width ``width`` (the student's by
    default), drawn from ``seed`` (another seed, another teacher); its logits of standard deviation ≈ 2."""
    rows, hidden = inputs.hidden.shape
    width = width or hidden
    device, dtype = inputs.hidden.device, inputs.hidden.dtype
    generator = torch.Generator(device=device).manual_seed(seed)
    teacher_hidden = torch.randn(rows, width, generator=generator, device=device).to(dtype)
    head = torch.randn(inputs.weight.shape[0], width, generator=generator, device=device) * (2.0 / width**0.5)
    return SeparateTeacher(teacher_hidden, head.to(dtype))


def precomputed_teacher(inputs: BenchInputs) -> PrecomputedTeacher:
    """The tied teacher's logits, cached in the input dtype."""
    with torch.no_grad():
        return PrecomputedTeacher(logits=inputs.teacher_hidden @ inputs.weight.detach().T)


def hidden_cache_teacher(inputs: BenchInputs) -> PrecomputedTeacher:
    """The tied teacher as a hidden-state cache: its hidden states in the input dtype, read with a
    head of its own (a copy of the student's), as ``HiddenCacheReader.teacher`` hands it over."""
    with torch.no_grad():
        return PrecomputedTeacher(
            teacher_hidden=inputs.teacher_hidden.clone(), teacher_weight=inputs.weight.detach().clone()
        )


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


def gemm_only_step(
    inputs: BenchInputs, task: str, teacher: SeparateTeacher | Sequence[SeparateTeacher] | None = None
) -> Step:
    """The loss's unavoidable full-size GEMMs back to back in cuBLAS: each side's logits GEMM with an
    fp32 result (for KD: the tied teacher's too, or ``teacher``'s through its own head at its own
    width, or each one's of several teachers, over the rows each one holds; one for CE), then
    ``dh = G·W`` and ``dW = Gᵀ·h`` for a logit gradient ``G`` in the inputs' dtype (made once, outside
    the timing)."""
    hidden, weight = inputs.hidden.detach(), inputs.weight.detach()
    grad_logits = torch.randn(hidden.shape[0], weight.shape[0], device=hidden.device).to(hidden.dtype)
    sides = [(hidden, weight)]
    if task == "KD":
        teachers = [teacher] if isinstance(teacher, SeparateTeacher) else list(teacher or ())
        sides += [(given.hidden, given.weight) for given in teachers] or [(inputs.teacher_hidden, weight)]

    def step() -> tuple[Tensor, tuple[Tensor, ...]]:
        logits = [logits_mm(side, head, torch.float32) for side, head in sides]
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
    config: KernelConfig | None = None,
) -> Step:
    """orda_tp at the task's weights (TASK_WEIGHTS: KD = student CE + the KL variant at T=1, CE alone,
    KL alone); the tied teacher by default; ``terms``: the loss terms' keywords (label smoothing, z-loss,
    soft-caps; ``token_weights="rand"`` for uniform random weights of the inputs' rows); ``config``:
    a KernelConfig instead of the profile's."""
    terms = dict(terms or {})
    if terms.get("token_weights") == "rand":
        generator = torch.Generator(device=inputs.labels.device).manual_seed(11)
        terms["token_weights"] = torch.rand(inputs.labels.shape, generator=generator, device=inputs.labels.device)
    ce_weight, kl_weight = TASK_WEIGHTS[task]
    kwargs: dict[str, Any] = dict(
        student_ce_weight=ce_weight,
        teacher_ce_weight=0.0,
        kl_weight=kl_weight,
        kl_temperature=1.0,
        kl_divergence=variant,
        profile=profile,
        backend=backend,
        config=config,
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
    """The task's exact gradients ``(dh, dW)`` in fp32, over chunks of rows (``grad_precision.reference_grads``)."""
    return exact_grads(inputs.hidden, inputs.weight, inputs.labels, inputs.teacher_hidden, task)


# ------------------------------------------------------------------------------------------------ implementations


@dataclass(frozen=True)
class Impl:
    """One implementation: ``step(inputs, task)`` makes its fwd+bwd for a task it supports; every one
    but naive also takes ``teacher=`` a SeparateTeacher for KD, instead of the tied teacher."""

    name: str
    step: Callable[..., Step]
    tasks: tuple[str, ...] = tuple(TASK_WEIGHTS)
    ours: bool = False  # orda_tp: its gradients must match the reference
    targets: bool = False  # the issue's targets apply (orda_tp's profiles)
    in_sweep: bool = False


def orda_options(device: torch.device, workspace: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """orda_tp's configurations under test: (name, orda_step keywords); with ``workspace``, also the
    default profile's under each explicit workspace cap of WORKSPACE_MIBS."""
    backend = "triton" if device.type == "cuda" else "torch"
    options: list[tuple[str, dict[str, Any]]] = [
        (f"orda_tp {backend}", {"backend": backend}),
        (f"orda_tp {backend} fast", {"backend": backend, "profile": "fast"}),
    ]
    if workspace:
        options += [
            (f"orda_tp {backend} wkspc {mib}", {"backend": backend, "config": KernelConfig(workspace_mib=mib)})
            for mib in WORKSPACE_MIBS
        ]
    return options


def orda_impls(device: torch.device, workspace: bool = False) -> list[Impl]:
    """orda_tp's configurations (``orda_options``); the default profile also runs in the vocabulary
    sweep; the issue's targets apply to the profiles, not to an explicit workspace cap."""
    return [
        Impl(name, partial(orda_step, **options), ours=True, targets="config" not in options, in_sweep=index == 0)
        for index, (name, options) in enumerate(orda_options(device, workspace))
    ]


NAIVE = Impl("naive", naive_step, tasks=TASKS, in_sweep=True)


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

    def step(inputs: BenchInputs, task: str, teacher: SeparateTeacher | None = None) -> Step:
        if teacher is None:
            source = orda_kernel.TiedTeacher(inputs.teacher_hidden)
        else:
            source = orda_kernel.SeparateTeacher(teacher.hidden, teacher.weight)
        ce_weight, kl_weight = TASK_WEIGHTS[task]
        return loss_step(
            inputs,
            lambda: orda_kernel.distillation_loss(
                inputs.hidden, inputs.weight, inputs.labels, source, student_ce_weight=ce_weight,
                teacher_ce_weight=0.0, kl_weight=kl_weight, kl_temperature=1.0, ignore_index=IGNORE_INDEX,
                backend=backend, config=config,
            ).loss,
        )  # fmt: skip

    return Impl(f"orda-kernel {_version('orda-kernel')}", step, in_sweep=True)


def liger_impl(device: torch.device) -> Impl:
    """Liger-Kernel: fused linear CE; KD as its chunked JSD loss at beta=0 (forward KL(q‖p)) plus CE
    (weight_hard_loss = 1; KL alone: 0), the teacher's hidden states through the same head, or a
    separate teacher's through its own (of any width)."""
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    ce = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)
    jsd = {
        task: LigerFusedLinearJSDLoss(
            weight_hard_loss=ce_weight, weight_soft_loss=kl_weight, beta=0.0, ignore_index=IGNORE_INDEX, temperature=1.0
        )
        for task, (ce_weight, kl_weight) in TASK_WEIGHTS.items()
        if kl_weight
    }

    def step(inputs: BenchInputs, task: str, teacher: SeparateTeacher | None = None) -> Step:
        if task == "CE":
            return loss_step(inputs, lambda: ce(inputs.weight, inputs.hidden, inputs.labels))
        side = (inputs.teacher_hidden, inputs.weight) if teacher is None else (teacher.hidden, teacher.weight)
        return loss_step(inputs, lambda: jsd[task](inputs.hidden, inputs.weight, *side, inputs.labels))

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

    section: str  # "main", "teachers", "rows" (the BT sweep), "extras" or "sweep" (the vocabulary sweep)
    shape: BenchShape
    case: str  # "KD", "CE", "logits GEMM", "KD <variant>", "KD separate", "KD separate H_t=<width>", ...
    impl: str
    gemms: int
    step: Callable[[BenchInputs], Step]
    target: Target | None = None
    labels: dict[str, str] = field(default_factory=dict)
    skip: str | None = None
    ours: bool = False  # orda_tp's row: its gradients must match the reference
    checks_grads: bool = False  # its gradients are compared with the fp32 reference (main and rows: KD and CE)


BENCH_HEADER = (
    f"{'shape':<21} {'case':<19} {'impl':<24} {'ms':>8} {'spread':>7} {'floor':>6} {'x floor':>7} "
    f"{'peak MiB':>9} {'wkspc MiB':>9}"
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


def _target_note(x_gemm_only: float, target: Target | None) -> tuple[str, bool | None]:
    """The issue's target as text and whether the row meets it (None without a target)."""
    if target is None:
        return "", None
    met = x_gemm_only <= target
    return f"<={target:g} x GEMM-only: {'meets' if met else 'misses'}", met


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
            x_floor = timing.ms / row["floor_ms"] if bench.device.type == "cuda" else None  # the floor is a GPU's
            row.update(status="ok", ms=timing.ms, spread_ms=timing.spread_ms, x_floor=x_floor)
            row.update(peak_mib=timing.peak_mib, workspace_mib=timing.workspace_mib, loss=timing.loss)
            if spec.checks_grads:
                checked, error = guarded(
                    bench.reporter, f"{label} gradients",
                    lambda: max(grad_errors(spec.step(inputs)()[1], reference(spec.case))),
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
        f"{fmt(row['x_floor'], '7.2f'):>7} {fmt(row['peak_mib'], '9.0f'):>9} {fmt(row['workspace_mib'], '9.0f'):>9}"
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
    """Every implementation that supports ``task`` at ``shape``; the target goes to orda_tp's profiles'
    rows."""
    return [
        RowSpec(
            section=section,
            shape=shape,
            case=task,
            impl=impl.name,
            gemms=TASK_GEMMS[task],
            step=partial(impl.step, task=task),
            target=target if impl.targets else None,
            skip=naive_skip(shape, task, device) if impl is NAIVE else None,
            ours=impl.ours,
            checks_grads=section in ("main", "rows"),
        )
        for impl in impls
        if task in impl.tasks
    ]


def gemm_and_task_specs(
    section: str, shape: BenchShape, task: str, impls: list[Impl], device: torch.device, target: Target | None = None
) -> list[RowSpec]:
    """The task's GEMM-only row at ``shape``, then every implementation's (``task_specs``)."""
    gemm_only = RowSpec(section, shape, task, GEMM_ONLY, TASK_GEMMS[task], partial(gemm_only_step, task=task))
    return [gemm_only, *task_specs(section, shape, task, impls, device, target)]


def main_specs(scale: Scale, impls: list[Impl], device: torch.device, small: bool) -> list[RowSpec]:
    """Per anchor shape: one logits GEMM, then KD and CE: GEMM-only and every implementation."""
    specs: list[RowSpec] = []
    for index, shape in enumerate(scale.shapes):
        specs.append(RowSpec("main", shape, "logits GEMM", "torch.mm", 1, gemm_step))
        for task in TASKS:
            target = None if small else TARGETS.get((index, task))
            specs += gemm_and_task_specs("main", shape, task, impls, device, target)
    return specs


def teacher_specs(scale: Scale, impls: list[Impl]) -> list[RowSpec]:
    """KD with a separate frozen teacher of another width (``Scale.separate``, the teacher at
    ``Scale.separate_width``): its GEMM-only row (the student's logits GEMM and the teacher's at their
    widths, then dh and dW at the student's), then each implementation of ``impls`` that does KD.
    The floor counts the teacher's logits GEMM as H_t / H_s GEMMs of the student's width."""
    shape, width = scale.separate, scale.separate_width
    case, gemms = f"KD separate H_t={width}", 3 + width // shape.hidden
    labels = {"teacher_width": str(width)}

    def step(make: Callable[..., Step], inputs: BenchInputs) -> Step:
        return make(inputs, "KD", teacher=separate_teacher(inputs, width))

    def row(impl: str, make: Callable[..., Step], ours: bool = False) -> RowSpec:
        return RowSpec("teachers", shape, case, impl, gemms, partial(step, make), labels=labels, ours=ours)

    return [row(GEMM_ONLY, gemm_only_step)] + [
        row(impl.name, impl.step, impl.ours) for impl in impls if "KD" in impl.tasks
    ]


def rows_sweep_specs(scale: Scale, impls: list[Impl], device: torch.device) -> list[RowSpec]:
    """KD and CE at the BT sweep's row counts (the first shape's H and V) that the anchor shapes do
    not already cover, the tasks of one row count together: GEMM-only, then every implementation."""
    first = scale.shapes[0]
    specs: list[RowSpec] = []
    for rows in sorted(set(scale.kd_row_counts + scale.ce_row_counts)):
        shape = BenchShape(rows, first.hidden, first.vocab)
        if shape not in scale.shapes:
            for task in TASKS:
                if rows in scale.row_counts(task):
                    specs += gemm_and_task_specs("rows", shape, task, impls, device)
    return specs


def rows_sweep_points(bench: Bench, scale: Scale) -> list[dict[str, Any]]:
    """The BT sweep's points: KD and CE rows at the first shape's H and V, from the rows section and
    the first anchor shape (GEMM-only rows too)."""
    first = scale.shapes[0]
    return [
        row
        for row in bench.rows
        if row["section"] in ("main", "rows")
        and row["case"] in TASKS
        and (row["hidden"], row["vocab"]) == (first.hidden, first.vocab)
        and row["rows"] in scale.row_counts(row["case"])
    ]


def report_gemm_ratios(bench: Bench) -> None:
    """Each row's time over the GEMM-only time of its section, shape and case (same run)."""
    timed = [r for r in bench.rows if r["status"] == "ok"]
    gemm_only = {(r["section"], r["shape"], r["case"]): r["ms"] for r in timed if r["impl"] == GEMM_ONLY}
    for row in timed:
        floor = gemm_only.get((row["section"], row["shape"], row["case"]))
        if floor is None or row["impl"] == GEMM_ONLY:
            continue
        row["x_gemm_only"] = row["ms"] / floor
        note, met = _target_note(row["x_gemm_only"], row["target"])
        row.update(target_met=met, note=note)
        bench.reporter.line(
            f"   {row['shape']} {row['case']} {row['impl']}: {row['ms']:.2f} ms = {row['x_gemm_only']:.3f} x GEMM-only "
            f"({floor:.2f} ms) {note}".rstrip()
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
        ("hidden cache", hidden_cache_teacher, 4),
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
    """The anchor shapes, the separate teacher of another width and the BT sweep for every
    implementation, the gradient precision, then the extras and the vocabulary sweep (the last to be
    left out when the time budget runs short); then the plots and the tables."""
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
    peers = load_peers(reporter, device)
    impls = orda_impls(device, workspace=True) + [NAIVE] + peers
    profiles = orda_impls(device) + peers  # no workspace caps, no naive: the teachers and the precision
    specs = main_specs(scale, impls, device, args.small) + teacher_specs(scale, profiles)
    if args.rows_sweep:
        specs += rows_sweep_specs(scale, impls, device)
    reporter.line(BENCH_HEADER)
    run_specs(bench, specs)
    precision = precision_part(bench, scale, profiles) if args.precision else None
    later = extras_specs(scale.shapes[0], device) if args.extras else []
    if args.extras_cases:  # e.g. "hidden cache,top-64": the rows a change is about, beside the main rows
        wanted = args.extras_cases.split(",")
        later = [spec for spec in later if any(name in spec.case for name in wanted)]
    if args.sweep:
        later += sweep_specs(scale, impls, device)
    if later:
        reporter.line(BENCH_HEADER)
        run_specs(bench, later)
    report_gemm_ratios(bench)
    if args.extras:
        report_variant_ratios(bench)
    report_not_run(bench)
    out_dir = bench.reporter.out_dir
    sweep = sweep_rows(bench, scale, impls) if args.sweep else []
    if sweep:
        plot_sweep(bench, scale, sweep, out_dir / "bench_vocab.png")
    rows_sweep = rows_sweep_points(bench, scale) if args.rows_sweep else []
    if rows_sweep:
        plot_rows_sweep(bench, scale, rows_sweep, out_dir / "bench_rows.png")
    write_tables(bench, out_dir / "bench_tables.md", sweep, rows_sweep, precision)


def precision_part(bench: Bench, scale: Scale, impls: list[Impl]) -> dict[str, Any]:
    """``grad_precision.run_precision`` at ``Scale.precision`` for ``impls``, under the time budget;
    its record goes into bench.json and its rows not run into the budget's list."""
    shape = scale.precision

    def grads(impl: Impl, problem: Problem) -> tuple[Tensor, ...]:
        inputs = BenchInputs(problem.hidden, problem.weight, problem.labels, problem.teacher_hidden)
        return impl.step(inputs, problem.task)()[1]

    contenders = [Contender(impl.name, partial(grads, impl), impl.tasks) for impl in impls]
    precision = run_precision(
        bench.reporter, bench.device, (shape.rows, shape.hidden, shape.vocab), contenders, bench.seed,
        lambda: bench.budget.spent(bench.runtime),
    )  # fmt: skip
    bench.reporter.data["bench"]["precision"] = precision
    bench.budget.not_run += [
        f"precision {r['data_set']} {r['case']} {r['impl']}" for r in precision["rows"] if r["status"] == "not run"
    ]
    return precision


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


def pyplot(reporter: Reporter) -> Any:
    """matplotlib's pyplot on the Agg backend, or None (printed) where matplotlib is not importable."""
    return harness_pyplot(lambda text: reporter.line(f"   {text}"))


def _line_label(impl: str, rows: list[dict[str, Any]], key: str, name: str) -> str:
    """``impl``, with the points that were not measured (``name=row[key]``) in parentheses."""
    missing = ", ".join(f"{r['status']} at {name}={r[key]}" for r in rows if r["status"] != "ok")
    return f"{impl} ({missing})" if missing else impl


def plot_sweep(bench: Bench, scale: Scale, rows: list[dict[str, Any]], path: Path) -> None:
    """bench_vocab.png: time and workspace (log scale) against V, a line per implementation, the KD floor."""
    plt = pyplot(bench.reporter)
    if plt is None:
        return
    figure, (times, memory) = plt.subplots(1, 2, figsize=(12, 4.5))
    for impl, group in groupby(sorted(rows, key=lambda r: (r["impl"], r["vocab"])), key=lambda r: r["impl"]):
        line = list(group)
        points = [r for r in line if r["status"] == "ok"]
        label = _line_label(impl, line, "vocab", "V")
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


def plot_rows_sweep(bench: Bench, scale: Scale, rows: list[dict[str, Any]], path: Path) -> None:
    """bench_rows.png: time per token (µs) against BT (log scale), KD and CE side by side, a line per
    implementation (GEMM-only dotted), each task's floor per token dashed."""
    plt = pyplot(bench.reporter)
    if plt is None:
        return
    first = scale.shapes[0]
    device_name = bench.reporter.data["env"].get("gpu", str(bench.device))
    figure, panels = plt.subplots(1, len(TASKS), figsize=(12, 4.5))
    for axes, task in zip(panels, TASKS):
        task_rows = sorted((r for r in rows if r["case"] == task), key=lambda r: (r["impl"], r["rows"]))
        for impl, group in groupby(task_rows, key=lambda r: r["impl"]):
            line = list(group)
            points = [r for r in line if r["status"] == "ok"]
            per_token = [_us_per_token(p) for p in points]
            style = "k:" if impl == GEMM_ONLY else "-"
            axes.plot(
                [p["rows"] for p in points], per_token, style, marker="o", label=_line_label(impl, line, "rows", "BT")
            )
        floor = 1e3 * first.floor_ms(TASK_GEMMS[task]) / first.rows
        axes.axhline(
            floor, color="k", linestyle="--", label=f"floor ({TASK_GEMMS[task]} GEMMs at {MATMUL_TFLOPS:g} TFLOP/s)"
        )
        counts = list(scale.row_counts(task))
        axes.set(xlabel="rows BT", ylabel="µs per token", xscale="log")
        dtype = str(bench.dtype).replace("torch.", "")
        axes.set_title(f"{task} fwd+bwd, H={first.hidden}, V={first.vocab}, {dtype}, {device_name}", fontsize=9)
        axes.set_xticks(counts, [str(c) for c in counts], minor=False)
        axes.minorticks_off()
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=7)
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


def teacher_tables(bench: Bench) -> list[str]:
    """The separate teacher of another width: each implementation against its GEMM-only row."""
    rows = [r for r in bench.rows if r["section"] == "teachers"]
    if not rows:
        return []
    first = rows[0]
    out = ["", f"### Separate teacher of another width (KD, {first['shape']}, H_t = {first['teacher_width']})", ""]
    return out + _table(
        ["implementation", "ms", "floor ms", "× floor", "× GEMM-only", "peak MiB", "workspace MiB"],
        (
            [r["impl"], _ms_cell(r), f"{r['floor_ms']:.1f}", _cell(r.get("x_floor"), ".2f"),
             _cell(r.get("x_gemm_only"), ".3f"), _cell(r.get("peak_mib"), ".0f"), _cell(r.get("workspace_mib"), ".0f")]
            for r in rows
        ),
    )  # fmt: skip


def _us_per_token(row: dict[str, Any]) -> float | None:
    return 1e3 * row["ms"] / row["rows"] if row["status"] == "ok" else None


def rows_sweep_tables(rows: list[dict[str, Any]]) -> list[str]:
    """The BT sweep: per task and row count, each implementation's time per token."""
    if not rows:
        return []
    out = ["", f"### BT sweep (H={rows[0]['hidden']}, V={rows[0]['vocab']})", ""]
    return out + _table(
        ["task", "BT", "implementation", "ms", "µs / token", "× GEMM-only", "peak MiB", "workspace MiB", "sanity"],
        (
            [r["case"], str(r["rows"]), r["impl"], _ms_cell(r), _cell(_us_per_token(r), ".2f"),
             _cell(r.get("x_gemm_only"), ".3f"), _cell(r.get("peak_mib"), ".0f"), _cell(r.get("workspace_mib"), ".0f"),
             _sanity_cell(r)]
            for r in sorted(rows, key=lambda r: (TASKS.index(r["case"]), r["rows"]))
        ),
    )  # fmt: skip


def precision_tables(precision: dict[str, Any] | None) -> list[str]:
    """The gradient errors per data set, case and implementation, and the data sets' statistics."""
    if precision is None:
        return []
    shape = precision["shape"]
    out = ["", f"### Gradient precision (BT={shape['rows']}, H={shape['hidden']}, V={shape['vocab']}, bf16)", ""]
    out += _table(
        ["data set", "logit std", "label − mean of others", "label − logsumexp of others", "max probability"],
        (
            [name, f"{s['logit_std']:.2f}", f"{s['label_minus_others_mean']:.2f}",
             f"{s['label_minus_others_logsumexp']:.2f}", f"{s['max_prob']:.3f}"]
            for name, s in precision["data_sets"].items()
        ),
    )  # fmt: skip
    out.append("")
    return out + _table(
        ["data set", "case", "implementation", "dh error", "dW error", "reproducible"],
        (
            [r["data_set"], r["case"], r["impl"]]
            + (
                [_cell(r["dh_err"], ".1e"), _cell(r["dW_err"], ".1e"), "yes" if r["reproducible"] else "no"]
                if r["status"] == "ok"
                else [r["status"], "-", "-"]
            )
            for r in precision["rows"]
        ),
    )


def write_markdown(bench: Bench, path: Path, lines: list[str]) -> None:
    """``lines``, then the rows that --time-limit left out, to ``path``."""
    if bench.budget.not_run:
        lines = lines + ["", f"Not run (--time-limit {bench.budget.seconds:g} s): " + "; ".join(bench.budget.not_run)]
    path.write_text("\n".join(lines) + "\n")
    bench.reporter.line(f"   tables: {path}")


def write_tables(
    bench: Bench,
    path: Path,
    sweep: list[dict[str, Any]],
    rows_sweep: list[dict[str, Any]],
    precision: dict[str, Any] | None,
) -> None:
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
    lines += main_tables(bench) + teacher_tables(bench) + extras_tables(bench)
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
    lines += rows_sweep_tables(rows_sweep) + precision_tables(precision)
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
    bench: Bench, shape: BenchShape, name: str, options: dict[str, Any], tp: int, per_tp: dict[int, float]
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
