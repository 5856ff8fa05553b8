"""Tensor-parallel distillation job: a tiny causal LM teacher taught to a smaller student through ``orda_tp``,
with both LM heads split along the vocabulary over the ranks of a torchrun job.

This is the recommended integration path: each model's LM head is an ``orda_tp.DistillationHead`` (an
``nn.Linear(H, V, bias=False)`` whose forward with ``labels=`` is the loss), sharded along the vocabulary by
``parallelize_module(model, tp_mesh, {"lm_head": orda_tp.VocabParallel()})``. The loss never forms the
``(BT, V)`` logits, and every rank gets the single-device loss.

1. A synthetic language (a sparse Markov chain, ``launch/data.py``) supplies token batches; every rank
   draws the same batches.
2. Each model is a body (``launch/tiny_lm.py``, replicated: same init seed on every rank) and a
   ``DistillationHead``. The vocabulary is padded to a multiple of ``--pad-vocab-multiple`` × world size
   (1000 → 1024 by default, as Megatron pads it) and each rank holds ``V_padded / world`` rows of each head
   (a ``Shard(0)`` DTensor). The padding rows get no probability mass (``vocab_size=``).
3. The teacher trains briefly with plain cross-entropy (its head with ``kl_weight=0``), then is frozen; the
   student trains on ``ce_weight · CE + kl_weight · T² · KL(teacher ‖ student)`` (or the variant named by
   ``--kl-divergence``), the teacher read through its head module (``orda_tp.TeacherHead``). The loss sums
   the hidden gradient over the ranks, so the replicated bodies get identical gradients and stay identical
   without any data-parallel wrapper.
4. At the end: a parameter checksum of the bodies is compared across ranks (all_reduce max − min must be
   0), and on a held-out batch the fused tensor-parallel loss and its gradients (hidden, this rank's head
   shard) are checked against a plain full-logits computation on the gathered heads in float64. The
   job exits non-zero on every rank if either check fails on any rank.

Run ``torchrun --standalone --nproc-per-node 2 launch/distill.py`` (gloo on CPU, NCCL with one GPU per rank
when CUDA is present), or ``python launch/distill.py`` (one process, no process group). Only rank 0 prints.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

# Run from a checkout without installing: the repository root holds both `orda_tp` and `launch`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orda_tp  # noqa: E402
from launch.data import Batch, MarkovLanguage, make_language, sample_batch  # noqa: E402
from launch.tiny_lm import LMConfig, TinyLM  # noqa: E402

CHECK_TOLERANCE = 1e-5
HELD_OUT_BATCH = 2**31 - 1  # a batch index that training never reaches
COLLECTIVE_TIMEOUT = timedelta(minutes=5)  # a rank left waiting fails instead of hanging the job


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; the defaults finish in about a minute with 2 ranks on two CPU cores."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=300, help="student training steps")
    parser.add_argument("--teacher-steps", type=positive_int, default=300, help="teacher pre-training steps")
    parser.add_argument("--batch", type=positive_int, default=16, help="sequences per step (the same on every rank)")
    parser.add_argument("--seq", type=positive_int, default=64, help="tokens per sequence")
    parser.add_argument("--vocab", type=positive_int, default=1000, help="real vocabulary size (before padding)")
    parser.add_argument(
        "--pad-vocab-multiple",
        type=positive_int,
        default=64,
        help="pad the vocabulary to a multiple of this times the world size (Megatron's make-vocab-size-divisible-by)",
    )
    parser.add_argument("--teacher-hidden", type=positive_int, default=128)
    parser.add_argument("--student-hidden", type=positive_int, default=64)
    parser.add_argument("--layers", type=positive_int, default=2, help="transformer blocks of each model")
    parser.add_argument("--kl-divergence", default="forward", choices=orda_tp.KL_VARIANTS)
    parser.add_argument("--temperature", type=float, default=2.0, help="KL temperature T (student and teacher)")
    parser.add_argument("--ce-weight", type=float, default=0.5, help="weight of the student CE term")
    parser.add_argument("--kl-weight", type=float, default=0.5, help="weight of the T²-scaled KL term")
    parser.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (cosine decay)")
    parser.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"), help="orda_tp backend")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=positive_int, default=25)
    return parser.parse_args(argv)


# --------------------------------------------------------------------------------------------------
# Runtime: one process, or one rank of a torchrun job.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: its rank, the world size, its device and the process group (None when
    the job runs as a single process without torchrun)."""

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup | None
    mesh: DeviceMesh | None  # the tensor-parallel mesh of all ranks (None without a process group)

    def log(self, message: str) -> None:
        """Print on rank 0 only."""
        if self.rank == 0:
            print(message, flush=True)


def init_runtime() -> Runtime:
    """Join the torchrun process group when torchrun's variables are set: NCCL with one GPU per rank
    when CUDA is present, else gloo on CPU with one thread per rank (the ranks share the cores)."""
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        return Runtime(rank=0, world_size=1, device=torch.device("cuda" if cuda else "cpu"), group=None, mesh=None)
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=COLLECTIVE_TIMEOUT)
    world_size = dist.get_world_size()
    if not cuda and world_size > 1:
        torch.set_num_threads(1)
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("tp",))
    return Runtime(rank=dist.get_rank(), world_size=world_size, device=device, group=dist.group.WORLD, mesh=mesh)


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory so far: allocated CUDA memory on a GPU, the process's maximum RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # ru_maxrss is in KiB on Linux


# ==================================================================================================
# TENSOR PARALLELISM LIVES HERE: the vocab-parallel LM head and the orda_tp loss call site.
# Everything else in this file is an ordinary replicated single-device training loop.
# ==================================================================================================


@dataclass(frozen=True)
class PaddedVocab:
    """The real vocabulary and its padded size (a multiple of pad multiple × world size, as Megatron pads
    it): 1000 tokens, multiple 64, 2 ranks → 1024 rows, 512 per rank, the last 24 of rank 1 padding."""

    real: int
    padded: int

    @staticmethod
    def of(vocab_size: int, multiple: int, world_size: int) -> PaddedVocab:
        step = multiple * world_size
        return PaddedVocab(vocab_size, -(-vocab_size // step) * step)


class LanguageModel(nn.Module):
    """A body (tokens -> hidden states ``[B, T, H]``, replicated on every rank) and its LM head, an
    ``orda_tp.DistillationHead`` that ``VocabParallel`` splits along the vocabulary."""

    def __init__(self, body: TinyLM, lm_head: orda_tp.DistillationHead) -> None:
        super().__init__()
        self.body = body
        self.lm_head = lm_head


def build_model(
    args: argparse.Namespace, hidden: int, vocab: PaddedVocab, runtime: Runtime, **loss_options: object
) -> LanguageModel:
    """A :class:`TinyLM` of width ``hidden`` and a ``DistillationHead`` of ``vocab.padded`` rows computing the
    loss ``loss_options`` describe, its head vocabulary-parallel over the job's ranks."""
    config = LMConfig(vocab=args.vocab, hidden=hidden, layers=args.layers, heads=max(1, hidden // 32), max_seq=args.seq)
    head = orda_tp.DistillationHead(hidden, vocab.padded, vocab_size=vocab.real, backend=args.backend, **loss_options)
    with torch.no_grad():  # the same draw on every rank; padding rows start at zero
        head.weight.normal_(std=0.02)
        head.weight[vocab.real :].zero_()
    model = LanguageModel(TinyLM(config), head).to(runtime.device)
    if runtime.mesh is not None:
        # TENSOR PARALLELISM LIVES HERE: each rank keeps its Shard(0) rows of the head (torch.chunk order).
        parallelize_module(model, runtime.mesh, {"lm_head": orda_tp.VocabParallel()})
    return model


def local_rows(weight: torch.Tensor) -> int:
    """The head rows this rank holds."""
    return (weight.to_local() if isinstance(weight, DTensor) else weight).shape[0]


def full_head(weight: torch.Tensor) -> torch.Tensor:
    """The whole padded head ``(V_padded, H)`` on every rank (gathered from the shards)."""
    return (weight.full_tensor() if isinstance(weight, DTensor) else weight).detach()


# ==================================================================================================
# Training (replicated bodies, same data on every rank).
# ==================================================================================================


def batch_on(language: MarkovLanguage, args: argparse.Namespace, index: int, runtime: Runtime) -> Batch:
    """Batch number ``index`` of the job's stream (the same on every rank), on the runtime's device."""
    batch = sample_batch(language, args.batch, args.seq, seed=(args.seed << 32) + index)
    return Batch(inputs=batch.inputs.to(runtime.device), labels=batch.labels.to(runtime.device), floor=batch.floor)


class ProgressMeter:
    """Throughput between log lines and peak memory, formatted into one progress line."""

    def __init__(self, runtime: Runtime, tokens_per_step: int) -> None:
        self.runtime = runtime
        self.tokens_per_step = tokens_per_step
        self.last_time = time.perf_counter()
        self.last_step = 0

    def line(self, phase: str, step: int, total: int, values: dict[str, float]) -> str:
        """``phase step i/n | name value ... | tok/s | peak_mem`` since the previous line."""
        now = time.perf_counter()
        tokens_per_s = self.tokens_per_step * (step - self.last_step) / max(now - self.last_time, 1e-9)
        self.last_time, self.last_step = now, step
        fields = " | ".join(f"{name} {value:.4f}" for name, value in values.items())
        peak = peak_memory_mib(self.runtime.device)
        return f"{phase} step {step:4d}/{total} | {fields} | tok/s {tokens_per_s:8.0f} | peak_mem {peak:.1f} MiB"


def make_optimizer(
    model: LanguageModel, lr: float, steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW with the learning rate decaying from ``lr`` to 0 along a cosine over ``steps`` steps."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    return optimizer, torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(steps, 1))


def should_log(step: int, total: int, every: int) -> bool:
    """Log the first step, every ``every`` steps, and the last step."""
    return step == 1 or step == total or step % every == 0


def train_teacher(teacher: LanguageModel, language: MarkovLanguage, args: argparse.Namespace, runtime: Runtime) -> None:
    """Pre-train the teacher with plain CE (its head computes the CE alone: ``kl_weight=0``), then freeze it."""
    optimizer, schedule = make_optimizer(teacher, args.lr, args.teacher_steps)
    meter = ProgressMeter(runtime, args.batch * args.seq)
    for step in range(1, args.teacher_steps + 1):
        batch = batch_on(language, args, index=step, runtime=runtime)
        output = teacher.lm_head(teacher.body(batch.inputs), labels=batch.labels)
        optimizer.zero_grad(set_to_none=True)
        output.loss.backward()
        optimizer.step()
        schedule.step()
        if should_log(step, args.teacher_steps, args.log_every):
            runtime.log(meter.line("teacher", step, args.teacher_steps, {"ce": output.student_ce.item()}))
    teacher.requires_grad_(False)
    teacher.eval()


def distill_step(student: LanguageModel, teacher: LanguageModel, batch: Batch) -> orda_tp.DistillationLossOutput:
    """The student's loss on ``batch``: its head reads the frozen teacher through the teacher's head module."""
    with torch.no_grad():
        teacher_hidden = teacher.body(batch.inputs)
    teacher_rows = orda_tp.TeacherHead(teacher_hidden.reshape(-1, teacher_hidden.shape[-1]), teacher.lm_head)
    return student.lm_head(student.body(batch.inputs), labels=batch.labels, teacher=teacher_rows)


def train_student(
    student: LanguageModel,
    teacher: LanguageModel,
    language: MarkovLanguage,
    args: argparse.Namespace,
    runtime: Runtime,
) -> list[float]:
    """Distil the frozen teacher into the student; returns the logged student losses."""
    optimizer, schedule = make_optimizer(student, args.lr, args.steps)
    meter = ProgressMeter(runtime, args.batch * args.seq)
    logged_loss = []
    for step in range(1, args.steps + 1):
        # Student batches continue the stream after the teacher's, so the student sees new text.
        batch = batch_on(language, args, index=args.teacher_steps + step, runtime=runtime)
        output = distill_step(student, teacher, batch)
        optimizer.zero_grad(set_to_none=True)
        output.loss.backward()  # the hidden gradient arrives already summed over the ranks
        optimizer.step()
        schedule.step()
        if should_log(step, args.steps, args.log_every):
            values = {"loss": output.loss.item(), "student_ce": output.student_ce.item(), "kl": output.kl.item()}
            logged_loss.append(values["loss"])
            runtime.log(meter.line("student", step, args.steps, values))
    return logged_loss


def held_out_ce(student: LanguageModel, teacher: LanguageModel, batch: Batch) -> tuple[float, float]:
    """Mean next-token CE of the student and of the teacher on ``batch``."""
    with torch.no_grad():
        student_ce = distill_step(student, teacher, batch).student_ce.item()
        teacher_ce = teacher.lm_head(teacher.body(batch.inputs), labels=batch.labels).student_ce.item()
    return student_ce, teacher_ce


# ==================================================================================================
# Final checks: the bodies stayed replicated; the fused TP loss equals a plain full-logits computation.
# ==================================================================================================


def all_reduce(values: torch.Tensor, op: dist.ReduceOp, runtime: Runtime) -> torch.Tensor:
    """``values`` reduced over the ranks (a copy; unchanged without a process group)."""
    values = values.clone()
    if runtime.group is not None:
        dist.all_reduce(values, op=op, group=runtime.group)
    return values


def check_bodies_replicated(models: dict[str, LanguageModel], runtime: Runtime) -> bool:
    """Every rank must hold bitwise the same bodies: per-parameter float64 checksums (sum and sum of
    squares) reduced with max and min over the ranks must agree exactly."""
    checksums = torch.stack(
        [
            statistic
            for model in models.values()
            for parameter in model.body.parameters()
            for statistic in (parameter.detach().double().sum(), parameter.detach().double().square().sum())
        ]
    )
    spread = all_reduce(checksums, dist.ReduceOp.MAX, runtime) - all_reduce(checksums, dist.ReduceOp.MIN, runtime)
    worst = spread.abs().max().item()
    passed = worst == 0.0
    runtime.log(
        f"replicated bodies {'PASS' if passed else 'FAIL'}: checksum max-min {worst:.3e} over "
        f"{runtime.world_size} rank(s), {checksums.numel() // 2} parameters of {'+'.join(models)}"
    )
    return passed


# Per-row D(p, q) from log p (student) and log q (teacher), tempered log-probabilities (rows, V).
PLAIN_DIVERGENCES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "forward": lambda log_p, log_q: (log_q.exp() * (log_q - log_p)).sum(dim=-1),
    "reverse": lambda log_p, log_q: (log_p.exp() * (log_p - log_q)).sum(dim=-1),
    "jeffreys": lambda log_p, log_q: ((log_q.exp() - log_p.exp()) * (log_q - log_p)).sum(dim=-1),
}


def unfused_kd_loss(
    student_hidden: torch.Tensor,
    student_head: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_head: torch.Tensor,
    labels: torch.Tensor,
    args: argparse.Namespace,
) -> tuple[dict[str, torch.Tensor], str]:
    """The job's loss written out on full logits over the real vocabulary (heads (V, H), no padding):
    ``F.cross_entropy`` plus ``T² · mean_rows D(p, q)`` when the variant has a plain form here, else the
    library's single-device full-logits ``reference`` backend. Returns the values and the oracle's name."""
    if args.kl_divergence not in PLAIN_DIVERGENCES:
        output = orda_tp.distillation_loss(
            student_hidden,
            student_head,
            labels,
            orda_tp.SeparateTeacher(teacher_hidden, teacher_head),
            student_ce_weight=args.ce_weight,
            kl_weight=args.kl_weight,
            kl_temperature=args.temperature,
            kl_divergence=args.kl_divergence,
            backend="reference",
        )
        return output._asdict(), "reference-backend"
    student_logits = student_hidden @ student_head.T
    teacher_logits = teacher_hidden @ teacher_head.T
    student_ce = F.cross_entropy(student_logits, labels)
    log_p = F.log_softmax(student_logits / args.temperature, dim=-1)
    log_q = F.log_softmax(teacher_logits / args.temperature, dim=-1)
    kl = args.temperature**2 * PLAIN_DIVERGENCES[args.kl_divergence](log_p, log_q).mean()
    return {"loss": args.ce_weight * student_ce + args.kl_weight * kl, "student_ce": student_ce, "kl": kl}, "plain"


def relative_error(value: torch.Tensor, expected: torch.Tensor) -> float:
    """``‖value − expected‖ / ‖expected‖`` in float64 (absolute error when ``expected`` is 0)."""
    diff = torch.linalg.vector_norm(value.double() - expected.double()).item()
    scale = torch.linalg.vector_norm(expected.double()).item()
    return diff / scale if scale > 0 else diff


def check_fused_against_unfused(
    student: LanguageModel,
    teacher: LanguageModel,
    batch: Batch,
    vocab: PaddedVocab,
    args: argparse.Namespace,
    runtime: Runtime,
) -> bool:
    """On ``batch``, compare the fused tensor-parallel loss, its components, the hidden gradient and this
    rank's head-shard gradient with the unfused loss computed in float64 from the gathered full heads
    (same fp32 values); the worst relative error over all ranks decides."""
    with torch.no_grad():
        student_hidden = student.body(batch.inputs)
        teacher_hidden = teacher.body(batch.inputs)
    hidden_leaf = student_hidden.clone().requires_grad_(True)
    teacher_rows = orda_tp.TeacherHead(teacher_hidden.reshape(-1, teacher_hidden.shape[-1]), teacher.lm_head)
    fused = student.lm_head(hidden_leaf, labels=batch.labels, teacher=teacher_rows)
    head = student.lm_head.weight
    fused_d_hidden, fused_d_head = torch.autograd.grad(fused.loss, [hidden_leaf, head])
    fused_d_shard = fused_d_head.to_local() if isinstance(fused_d_head, DTensor) else fused_d_head

    # Unfused: every rank gathers the full heads and keeps the real vocabulary rows.
    real = vocab.real
    width = student_hidden.shape[-1]
    hidden64 = student_hidden.reshape(-1, width).double().requires_grad_(True)
    head64 = full_head(head).double().requires_grad_(True)
    teacher_head64 = full_head(teacher.lm_head.weight).double()
    unfused, oracle = unfused_kd_loss(
        hidden64, head64[:real], teacher_rows.hidden.double(), teacher_head64[:real], batch.labels.reshape(-1), args
    )
    d_hidden64, d_head64 = torch.autograd.grad(unfused["loss"], [hidden64, head64])

    errors = {name: relative_error(getattr(fused, name), unfused[name]) for name in ("loss", "student_ce", "kl")}
    errors["d_hidden"] = relative_error(fused_d_hidden.reshape(-1, width), d_hidden64)
    errors["d_head_shard"] = relative_error(fused_d_shard, d_head64.chunk(runtime.world_size)[runtime.rank])
    worst_over_ranks = all_reduce(
        torch.tensor(list(errors.values()), device=runtime.device), dist.ReduceOp.MAX, runtime
    )
    errors = dict(zip(errors, worst_over_ranks.tolist()))
    runtime.log(
        f"held-out loss: fused TP {fused.loss.item():.8f} vs unfused full logits ({oracle}, float64) "
        f"{unfused['loss'].item():.8f} | vocab {real} padded to {vocab.padded} = {runtime.world_size} x "
        f"{local_rows(head)} rows"
    )
    worst = max(errors.values())
    passed = worst <= CHECK_TOLERANCE
    details = ", ".join(f"{name} {error:.2e}" for name, error in errors.items())
    runtime.log(f"check {'PASS' if passed else 'FAIL'} max_rel_err {worst:.3e} tol {CHECK_TOLERANCE:.0e} ({details})")
    return passed


def main(argv: list[str] | None = None) -> int:
    """Run the job; returns the process exit code (1 on every rank when a check fails on any rank)."""
    args = parse_args(argv)
    runtime = init_runtime()
    start = time.perf_counter()
    torch.manual_seed(args.seed)  # the same on every rank: replicated bodies, identical full heads
    language = make_language(args.vocab, seed=args.seed)
    vocab = PaddedVocab.of(args.vocab, args.pad_vocab_multiple, runtime.world_size)
    teacher = build_model(args, args.teacher_hidden, vocab, runtime, teacher_ce_weight=0.0, kl_weight=0.0)
    student = build_model(
        args, args.student_hidden, vocab, runtime,
        student_ce_weight=args.ce_weight, kl_weight=args.kl_weight, kl_temperature=args.temperature,
        kl_divergence=args.kl_divergence,
    )  # fmt: skip
    runtime.log(
        f"distill: world_size {runtime.world_size} device {runtime.device} "
        f"process_group {dist.get_backend(runtime.group) if runtime.group is not None else 'none'} | "
        f"vocab {args.vocab} padded to {vocab.padded}, head shard {local_rows(student.lm_head.weight)} rows/rank | "
        f"tokens/step {args.batch * args.seq} kl {args.kl_divergence} T {args.temperature} backend {args.backend}"
    )

    train_teacher(teacher, language, args, runtime)
    logged_loss = train_student(student, teacher, language, args, runtime)

    held_out = batch_on(language, args, index=HELD_OUT_BATCH, runtime=runtime)
    replicated = check_bodies_replicated({"teacher": teacher, "student": student}, runtime)
    fused_ok = check_fused_against_unfused(student, teacher, held_out, vocab, args, runtime)
    student_ce, teacher_ce = held_out_ce(student, teacher, held_out)
    # Every rank leaves with the same status.
    passed = bool(
        all_reduce(torch.tensor(int(replicated and fused_ok), device=runtime.device), dist.ReduceOp.MIN, runtime)
    )
    runtime.log(
        f"summary: student loss {logged_loss[0]:.4f} -> {logged_loss[-1]:.4f} over {args.steps} steps | "
        f"held-out ce: student {student_ce:.4f} teacher {teacher_ce:.4f} floor {held_out.floor:.4f} | "
        f"{time.perf_counter() - start:.1f} s | peak_mem {peak_memory_mib(runtime.device):.1f} MiB | "
        f"check {'PASS' if passed else 'FAIL'}"
    )
    if runtime.group is not None:
        dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    code = main()
    # Leave without interpreter shutdown: gloo's worker threads release a finished collective's tensors
    # only after wait() has returned, and a release during shutdown aborts the process ("terminate
    # called without an active exception"; docs/integrations.md §10).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
