"""Distillation demo: a tiny causal LM teacher taught to a smaller student through ``orda_tp``.

1. A synthetic language (a sparse Markov chain, ``launch/data.py``) supplies token batches.
2. The teacher (``launch/tiny_lm.py``) trains briefly with plain cross-entropy, then is frozen.
3. The student trains on ``student_ce_weight · CE + kl_weight · T² · KL(teacher ‖ student)`` (or the
   variant named by ``--kl-divergence``), computed by ``orda_tp.distillation_loss`` from hidden states
   and head weights, never from ``(BT, V)`` logits.
4. On a held-out batch, the fused loss (``backend="torch"``) and its gradients are checked against a
   plain full-logits computation; the script exits non-zero if they differ by more than 1e-5 relative.

Run ``python launch/distill.py`` or ``torchrun --standalone --nproc-per-node 1 launch/distill.py``.
Under torchrun every rank runs the same job and only rank 0 prints.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# Run from a checkout without installing: the repository root holds both `orda_tp` and `launch`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orda_tp  # noqa: E402
from launch.data import Batch, MarkovLanguage, make_language, sample_batch  # noqa: E402
from launch.tiny_lm import LMConfig, TinyLM  # noqa: E402

CHECK_TOLERANCE = 1e-5
HELD_OUT_BATCH = 2**31 - 1  # a batch index that training never reaches


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; the defaults finish in well under a minute on two CPU cores."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=300, help="student training steps")
    parser.add_argument("--teacher-steps", type=positive_int, default=300, help="teacher pre-training steps")
    parser.add_argument("--batch", type=positive_int, default=16, help="sequences per step")
    parser.add_argument("--seq", type=positive_int, default=64, help="tokens per sequence")
    parser.add_argument("--vocab", type=positive_int, default=1000, help="vocabulary size of the synthetic language")
    parser.add_argument("--teacher-hidden", type=positive_int, default=128)
    parser.add_argument("--student-hidden", type=positive_int, default=64)
    parser.add_argument("--layers", type=positive_int, default=2, help="transformer blocks of each model")
    parser.add_argument("--kl-divergence", default="forward", choices=orda_tp.KL_VARIANTS)
    parser.add_argument("--temperature", type=float, default=2.0, help="KL temperature T (student and teacher)")
    parser.add_argument("--ce-weight", type=float, default=0.5, help="weight of the student CE term")
    parser.add_argument("--kl-weight", type=float, default=0.5, help="weight of the T²-scaled KL term")
    parser.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (cosine decay)")
    parser.add_argument("--backend", default="auto", choices=("auto", "torch", "reference"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=positive_int, default=20)
    return parser.parse_args(argv)


# --------------------------------------------------------------------------------------------------
# Runtime: single process or torchrun.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Runtime:
    """Where this process runs: its rank, the world size and its device."""

    rank: int
    world_size: int
    device: torch.device

    def log(self, message: str) -> None:
        """Print on rank 0 only."""
        if self.rank == 0:
            print(message, flush=True)


def init_runtime() -> Runtime:
    """Join the torchrun process group when torchrun's variables are set (nccl on CUDA, else gloo)."""
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        return Runtime(rank=0, world_size=1, device=torch.device("cuda" if cuda else "cpu"))
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return Runtime(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory so far: allocated CUDA memory on a GPU, the process's maximum RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # ru_maxrss is in KiB on Linux


# --------------------------------------------------------------------------------------------------
# The vocabulary head and the loss: the one place that a vocab-parallel head changes.
# --------------------------------------------------------------------------------------------------


def new_head(vocab: int, hidden: int, device: torch.device) -> nn.Parameter:
    """The LM head weight (V, H), kept outside the model so that the loss takes hidden + weight."""
    return nn.Parameter(torch.randn(vocab, hidden, device=device) * 0.02)


def ce_loss(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, backend: str) -> torch.Tensor:
    """Mean next-token cross-entropy of ``hidden @ head.T`` (teacher pre-training).

    A CE-only call: with ``teacher_ce_weight=0`` and ``kl_weight=0`` no teacher term has weight, so the
    tied teacher descriptor is never read.
    """
    output = orda_tp.distillation_loss(
        hidden, head, labels, orda_tp.TiedTeacher(hidden.detach()), teacher_ce_weight=0.0, backend=backend
    )
    return output.loss


def kd_loss(
    student_hidden: torch.Tensor,
    student_head: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_head: torch.Tensor,
    labels: torch.Tensor,
    args: argparse.Namespace,
    backend: str,
) -> orda_tp.DistillationLossOutput:
    """``ce_weight · CE(student) + kl_weight · T² · D(student, frozen teacher)``, rows (BT, ·)."""
    return orda_tp.distillation_loss(
        student_hidden,
        student_head,
        labels,
        orda_tp.SeparateTeacher(teacher_hidden.detach(), teacher_head.detach()),
        student_ce_weight=args.ce_weight,
        kl_weight=args.kl_weight,
        kl_temperature=args.temperature,
        kl_divergence=args.kl_divergence,
        backend=backend,
    )


# --------------------------------------------------------------------------------------------------
# Training.
# --------------------------------------------------------------------------------------------------


@dataclass
class LanguageModel:
    """A body (tokens -> hidden states) and its separate head weight."""

    body: TinyLM
    head: nn.Parameter

    def parameters(self) -> list[nn.Parameter]:
        """All trainable parameters, head included."""
        return [*self.body.parameters(), self.head]

    def hidden_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """Final hidden states flattened to rows (B·T, H)."""
        hidden = self.body(tokens)
        return hidden.reshape(-1, hidden.shape[-1])


def build_model(args: argparse.Namespace, hidden: int, runtime: Runtime) -> LanguageModel:
    """A :class:`TinyLM` of width ``hidden`` with a fresh head, on the runtime's device."""
    config = LMConfig(vocab=args.vocab, hidden=hidden, layers=args.layers, heads=max(1, hidden // 32), max_seq=args.seq)
    return LanguageModel(body=TinyLM(config).to(runtime.device), head=new_head(args.vocab, hidden, runtime.device))


def batch_on(language: MarkovLanguage, args: argparse.Namespace, index: int, runtime: Runtime) -> Batch:
    """Batch number ``index`` of the job's stream, on the runtime's device; labels flattened to (B·T,)."""
    batch = sample_batch(language, args.batch, args.seq, seed=(args.seed << 32) + index)
    inputs = batch.inputs.to(runtime.device)
    return Batch(inputs=inputs, labels=batch.labels.reshape(-1).to(runtime.device), floor=batch.floor)


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
    """Pre-train the teacher with plain CE, then freeze it."""
    optimizer, schedule = make_optimizer(teacher, args.lr, args.teacher_steps)
    meter = ProgressMeter(runtime, args.batch * args.seq)
    for step in range(1, args.teacher_steps + 1):
        batch = batch_on(language, args, index=step, runtime=runtime)
        loss = ce_loss(teacher.hidden_rows(batch.inputs), teacher.head, batch.labels, args.backend)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if should_log(step, args.teacher_steps, args.log_every):
            runtime.log(meter.line("teacher", step, args.teacher_steps, {"ce": loss.item()}))
    for parameter in teacher.parameters():
        parameter.requires_grad_(False)
    teacher.body.eval()


def train_student(
    student: LanguageModel,
    teacher: LanguageModel,
    language: MarkovLanguage,
    args: argparse.Namespace,
    runtime: Runtime,
) -> list[float]:
    """Distil the frozen teacher into the student; returns the logged student CE values."""
    optimizer, schedule = make_optimizer(student, args.lr, args.steps)
    meter = ProgressMeter(runtime, args.batch * args.seq)
    logged_ce = []
    for step in range(1, args.steps + 1):
        # Student batches continue the stream after the teacher's, so the student sees new text.
        batch = batch_on(language, args, index=args.teacher_steps + step, runtime=runtime)
        with torch.no_grad():
            teacher_hidden = teacher.hidden_rows(batch.inputs)
        output = kd_loss(
            student.hidden_rows(batch.inputs),
            student.head,
            teacher_hidden,
            teacher.head,
            batch.labels,
            args,
            args.backend,
        )
        optimizer.zero_grad(set_to_none=True)
        output.loss.backward()
        optimizer.step()
        schedule.step()
        if should_log(step, args.steps, args.log_every):
            values = {
                "loss": output.loss.item(),
                "student_ce": output.student_ce.item(),
                "kl": output.kl.item(),
            }
            logged_ce.append(values["student_ce"])
            runtime.log(meter.line("student", step, args.steps, values))
    return logged_ce


# --------------------------------------------------------------------------------------------------
# The final check: fused loss versus a plain full-logits computation.
# --------------------------------------------------------------------------------------------------

# Per-row D(p, q) from log p (student) and log q (teacher), tempered log-probabilities (rows, V).
PLAIN_DIVERGENCES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "forward": lambda log_p, log_q: (log_q.exp() * (log_q - log_p)).sum(dim=-1),
    "reverse": lambda log_p, log_q: (log_p.exp() * (log_p - log_q)).sum(dim=-1),
    "jeffreys": lambda log_p, log_q: ((log_q.exp() - log_p.exp()) * (log_q - log_p)).sum(dim=-1),
}


def plain_kd_loss(
    student_hidden: torch.Tensor,
    student_head: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_head: torch.Tensor,
    labels: torch.Tensor,
    args: argparse.Namespace,
) -> dict[str, torch.Tensor]:
    """The demo's loss written out on full logits: ``F.cross_entropy`` plus ``T² · mean_rows D(p, q)``."""
    student_logits = student_hidden @ student_head.T
    teacher_logits = teacher_hidden @ teacher_head.T
    student_ce = F.cross_entropy(student_logits, labels)
    log_p = F.log_softmax(student_logits / args.temperature, dim=-1)
    log_q = F.log_softmax(teacher_logits / args.temperature, dim=-1)
    kl = args.temperature**2 * PLAIN_DIVERGENCES[args.kl_divergence](log_p, log_q).mean()
    return {"loss": args.ce_weight * student_ce + args.kl_weight * kl, "student_ce": student_ce, "kl": kl}


def oracle_kd_loss(
    student_hidden: torch.Tensor,
    student_head: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_head: torch.Tensor,
    labels: torch.Tensor,
    args: argparse.Namespace,
) -> dict[str, torch.Tensor]:
    """The unfused float64 loss: :func:`plain_kd_loss` when the variant has a plain form here,
    else the library's full-logits ``reference`` backend."""
    inputs = (student_hidden, student_head, teacher_hidden, teacher_head, labels, args)
    if args.kl_divergence in PLAIN_DIVERGENCES:
        return plain_kd_loss(*inputs)
    return kd_loss(*inputs, backend="reference")._asdict()


def relative_error(value: torch.Tensor, expected: torch.Tensor) -> float:
    """``‖value − expected‖ / ‖expected‖`` in float64 (absolute error when ``expected`` is 0)."""
    diff = torch.linalg.vector_norm(value.double() - expected.double()).item()
    scale = torch.linalg.vector_norm(expected.double()).item()
    return diff / scale if scale > 0 else diff


def check_fused_against_unfused(
    student: LanguageModel, teacher: LanguageModel, batch: Batch, args: argparse.Namespace, runtime: Runtime
) -> bool:
    """Compare the fused ``backend="torch"`` loss, components and gradients (head, hidden) on ``batch``
    with the unfused loss computed in float64 from the same fp32 values; log the errors."""
    with torch.no_grad():
        student_hidden = student.hidden_rows(batch.inputs)
        teacher_hidden = teacher.hidden_rows(batch.inputs)
    leaves = [student_hidden.clone().requires_grad_(True), student.head.detach().clone().requires_grad_(True)]
    fused = kd_loss(leaves[0], leaves[1], teacher_hidden, teacher.head, batch.labels, args, backend="torch")
    fused_grads = torch.autograd.grad(fused.loss, leaves)

    leaves64 = [leaf.detach().double().requires_grad_(True) for leaf in leaves]
    unfused = oracle_kd_loss(
        leaves64[0], leaves64[1], teacher_hidden.double(), teacher.head.detach().double(), batch.labels, args
    )
    unfused_grads = torch.autograd.grad(unfused["loss"], leaves64)

    errors = {name: relative_error(getattr(fused, name), unfused[name]) for name in ("loss", "student_ce", "kl")}
    errors["d_hidden"] = relative_error(fused_grads[0], unfused_grads[0])
    errors["d_head"] = relative_error(fused_grads[1], unfused_grads[1])
    oracle = "plain" if args.kl_divergence in PLAIN_DIVERGENCES else "reference-backend"
    fused_value, unfused_value = fused.loss.item(), unfused["loss"].item()
    runtime.log(f"held-out loss: fused {fused_value:.8f} vs unfused ({oracle}, float64) {unfused_value:.8f}")
    worst = max(errors.values())
    passed = worst <= CHECK_TOLERANCE
    details = ", ".join(f"{name} {error:.2e}" for name, error in errors.items())
    runtime.log(f"check {'PASS' if passed else 'FAIL'} max_rel_err {worst:.3e} tol {CHECK_TOLERANCE:.0e} ({details})")
    return passed


def held_out_ce(model: LanguageModel, batch: Batch, backend: str) -> float:
    """Mean next-token CE of ``model`` on ``batch``."""
    with torch.no_grad():
        return ce_loss(model.hidden_rows(batch.inputs), model.head, batch.labels, backend).item()


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit code (1 when the fused-vs-unfused check fails)."""
    args = parse_args(argv)
    runtime = init_runtime()
    start = time.perf_counter()
    torch.manual_seed(args.seed)
    language = make_language(args.vocab, seed=args.seed)
    teacher = build_model(args, args.teacher_hidden, runtime)
    student = build_model(args, args.student_hidden, runtime)
    runtime.log(
        f"distill: world_size {runtime.world_size} device {runtime.device} vocab {args.vocab} "
        f"tokens/step {args.batch * args.seq} kl {args.kl_divergence} T {args.temperature} "
        f"backend {args.backend}"
    )

    train_teacher(teacher, language, args, runtime)
    logged_ce = train_student(student, teacher, language, args, runtime)

    held_out = batch_on(language, args, index=HELD_OUT_BATCH, runtime=runtime)
    passed = check_fused_against_unfused(student, teacher, held_out, args, runtime)
    student_ce, teacher_ce = (held_out_ce(model, held_out, args.backend) for model in (student, teacher))
    runtime.log(
        f"summary: student_ce {logged_ce[0]:.4f} -> {logged_ce[-1]:.4f} over {args.steps} steps | "
        f"held-out ce: student {student_ce:.4f} teacher {teacher_ce:.4f} floor {held_out.floor:.4f} | "
        f"{time.perf_counter() - start:.1f} s | peak_mem {peak_memory_mib(runtime.device):.1f} MiB | "
        f"check {'PASS' if passed else 'FAIL'}"
    )
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
