"""Several teachers in one loss call: a student distilled from two specialist teachers of different widths with
``orda_tp.TeacherMixture``, every head split over the ranks along the vocabulary, each step checked against the
same loss on one device.

    torchrun --standalone --nproc-per-node 2 examples/mixture_distill.py                 # TP = 2 on gloo (CPU)
    torchrun --standalone --nproc-per-node 2 examples/mixture_distill.py --combine probabilities --no-routing
    python examples/mixture_distill.py                                                   # one process, TP = 1

1. Two domains: two synthetic Markov languages of the main job (``launch/data.py``) over the same vocabulary,
   drawn from seeds ``s`` and ``s + 1``. The corpus holds ``--sequences`` sequences of ``--seq`` tokens, half
   of each domain, shuffled: every sequence is of one domain, a batch mixes both.
2. Two specialists: tiny ``transformers.LlamaForCausalLM`` models (2 layers, untied heads, widths
   ``--teacher-hidden``: 48 and 80), each pre-trained ``--teacher-steps`` steps with plain cross-entropy on its
   own domain, then frozen. Both are replicated on every rank, and each rank reads only its shard of each LM
   head (rows split along the vocabulary, in rank order), as a tensor-parallel teacher would hold it.
3. The student: a tiny Llama of width ``--student-hidden`` whose ``lm_head`` is an ``orda_tp.DistillationHead``
   split over the ranks by ``parallelize_module(student, mesh, {"lm_head": orda_tp.VocabParallel()})``. It
   trains ``--steps`` steps on ``student CE + kl_weight · T² · KL`` with one teacher for both specialists:
   ``TeacherMixture([SeparateTeacher(h_A, W_A shard), SeparateTeacher(h_B, W_B shard)], weights,
   combine=--combine)``. The weights are a ``(rows, 2)`` tensor, one row per token: with ``--routing`` (the
   default) one-hot by the sequence's domain, so each row learns from its domain's specialist alone and each
   teacher's logits GEMM runs over its own rows only; with ``--no-routing`` dense, 0.7 on the row's domain's
   specialist and 0.3 on the other.
4. The check, every step, before the optimizer moves: the same loss on one device (the whole heads of the
   student and of both teachers, no process group) and its gradients with respect to the student's hidden
   states and head, against the tensor-parallel ones (the head's gradient as this rank's shard). Every
   relative error must stay within 1e-5 on every rank (fp32): ``check PASS``, or ``check FAIL`` and exit 1.
   (In one process the head is whole, and the check compares ``DistillationHead`` with the same call of
   ``orda_tp.distillation_loss``.)

Needs transformers (tested with 5.24.0). About 15 s with 2 ranks on two CPU cores, most of it importing torch and
transformers. Only rank 0 prints.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

try:
    from transformers import LlamaForCausalLM
except ImportError as error:  # not a dependency of orda_tp: say how to install it
    raise ImportError("examples/mixture_distill.py needs transformers: pip install 'transformers==5.24.0'") from error

# Run from a checkout without installing: the repository root holds `orda_tp` and the main job's `launch`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_llama import final_hidden, pretrain, tiny_llama  # noqa: E402  (examples/: the script's own directory)

import orda_tp  # noqa: E402
from launch.data import MarkovLanguage, make_language, sample_batch  # noqa: E402
from launch.distill import (  # noqa: E402
    CHECK_TOLERANCE,
    Runtime,
    all_reduce,
    full_head,
    init_runtime,
    positive_int,
    relative_error,
)
from orda_tp.teachers.mixture import COMBINE_MODES  # noqa: E402

DOMAINS = 2  # one specialist per domain
DOMAIN_WEIGHT = 0.7  # --no-routing: a row's weight on its domain's specialist; the other has the rest
NAMES = "AB"  # the specialists' names in the log, by domain


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; the defaults finish in well under a minute with 2 ranks on two CPU cores."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--combine", choices=COMBINE_MODES, default="divergences", help="how teachers mix")
    parser.add_argument(
        "--routing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"one-hot weights by domain (--no-routing: {DOMAIN_WEIGHT} on its specialist, the rest on the other)",
    )
    # Reverse KL, each teacher's divergence weighted by the student's own probabilities (mode-seeking): the
    # per-teacher divergence of multi-teacher on-policy practice (guide §16). Unlike forward KL, whose gradient is
    # the same under "divergences" and "probabilities", it lets --combine change the training of dense weights
    # (a routed row reads one teacher, the same in every mode).
    parser.add_argument("--kl-divergence", default="reverse", help="the KL variant (orda_tp's kl_divergence)")
    parser.add_argument("--steps", type=positive_int, default=8, help="student training steps")
    parser.add_argument("--teacher-steps", type=positive_int, default=60, help="pre-training steps per specialist")
    parser.add_argument("--sequences", type=positive_int, default=32, help="sequences in the corpus (both domains)")
    parser.add_argument("--batch", type=positive_int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=positive_int, default=32, help="tokens per sequence")
    parser.add_argument("--vocab", type=positive_int, default=1024, help="vocabulary (a multiple of the world size)")
    parser.add_argument("--teacher-hidden", type=positive_int, nargs=DOMAINS, default=[48, 80], metavar="WIDTH")
    parser.add_argument("--student-hidden", type=positive_int, default=32)
    parser.add_argument("--temperature", type=float, default=2.0, help="KL temperature T (student and teachers)")
    parser.add_argument("--kl-weight", type=float, default=1.0, help="weight of the T²-scaled KL term")
    parser.add_argument("--lr", type=float, default=1e-2, help="student learning rate (AdamW)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.sequences % DOMAINS != 0 or args.sequences % args.batch != 0:
        parser.error(
            f"--sequences ({args.sequences}) must be even (half per domain) and a multiple of --batch ({args.batch})"
        )
    return args


def loss_options(args: argparse.Namespace) -> dict[str, Any]:
    """The loss's keywords, the same for the student's head and the one-device check (a mixture's teachers are
    frozen: no teacher CE)."""
    return {
        "kl_weight": args.kl_weight,
        "kl_temperature": args.temperature,
        "kl_divergence": args.kl_divergence,
        "teacher_ce_weight": 0.0,
    }


# ---- corpus ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DomainBatch:
    """Sequences of the corpus: their tokens, next-token labels and each sequence's domain."""

    inputs: Tensor  # (batch, seq) token ids
    labels: Tensor  # (batch, seq) next-token labels
    domain: Tensor  # (batch,) 0 or 1


def make_corpus(languages: list[MarkovLanguage], args: argparse.Namespace, device: torch.device) -> list[DomainBatch]:
    """``args.sequences`` sequences, half of each language, in a seeded shuffle (the same on every rank), cut
    into batches of ``args.batch`` sequences on ``device``."""
    half = args.sequences // DOMAINS
    texts = [sample_batch(language, half, args.seq, seed=args.seed + 100 + d) for d, language in enumerate(languages)]
    order = torch.randperm(args.sequences, generator=torch.Generator().manual_seed(args.seed + 200))
    inputs = torch.cat([text.inputs for text in texts])[order].to(device)
    labels = torch.cat([text.labels for text in texts])[order].to(device)
    domain = torch.arange(DOMAINS).repeat_interleave(half)[order].to(device)
    return [
        DomainBatch(inputs[i : i + args.batch], labels[i : i + args.batch], domain[i : i + args.batch])
        for i in range(0, args.sequences, args.batch)
    ]


def mixture_weights(batch: DomainBatch, routing: bool) -> Tensor:
    """``(rows, 2)`` fp32, one row per token in row-major order: one-hot by the sequence's domain (routed), or
    :data:`DOMAIN_WEIGHT` on the domain's specialist and the rest on the other; each row sums to 1."""
    one_hot = F.one_hot(batch.domain, DOMAINS).float()
    per_sequence = one_hot if routing else (1 - DOMAIN_WEIGHT) + (2 * DOMAIN_WEIGHT - 1) * one_hot
    return per_sequence.repeat_interleave(batch.inputs.shape[1], dim=0)


# ---- models ------------------------------------------------------------------------------------


def train_specialists(
    languages: list[MarkovLanguage], args: argparse.Namespace, runtime: Runtime
) -> list[LlamaForCausalLM]:
    """One tiny Llama per domain (2 layers, its width from ``--teacher-hidden``), pre-trained on its own
    language and frozen; each one's CE on held-out text of both domains is logged."""
    held_out = [
        sample_batch(language, args.batch, args.seq, seed=args.seed + 300 + d) for d, language in enumerate(languages)
    ]
    specialists = []
    for d, (language, width) in enumerate(zip(languages, args.teacher_hidden)):
        model = tiny_llama(args.vocab, width, layers=2, max_seq=args.seq, seed=args.seed + d, device=runtime.device)
        done = pretrain(
            model, language, args.teacher_steps, args.seq, (args.seed << 32) + 1000 * (d + 1), runtime.device
        )
        assert done is not None  # --teacher-steps is positive
        with torch.no_grad():
            ces = [
                F.cross_entropy(
                    model(input_ids=text.inputs.to(runtime.device), use_cache=False).logits.flatten(0, 1),
                    text.labels.to(runtime.device).flatten(),
                ).item()
                for text in held_out
            ]
        runtime.log(
            f"teacher {NAMES[d]}: width {width}, {args.teacher_steps} steps on domain {d} (last CE {done.ce:.3f}) | "
            f"held-out CE: domain 0 {ces[0]:.3f}, domain 1 {ces[1]:.3f} (floors {held_out[0].floor:.3f}, "
            f"{held_out[1].floor:.3f})"
        )
        specialists.append(model)
    return specialists


def build_student(args: argparse.Namespace, runtime: Runtime) -> LlamaForCausalLM:
    """The student: its ``lm_head`` a ``DistillationHead`` around the same weight, split along the vocabulary
    over the ranks by ``VocabParallel``."""
    student = tiny_llama(
        args.vocab, args.student_hidden, layers=1, max_seq=args.seq, seed=args.seed + DOMAINS, device=runtime.device
    )
    student.lm_head = orda_tp.DistillationHead.from_linear(student.lm_head, **loss_options(args))
    if runtime.mesh is not None:
        parallelize_module(student, runtime.mesh, {"lm_head": orda_tp.VocabParallel()})
    return student


class Mixtures(NamedTuple):
    """Both specialists as one teacher on a batch: with this rank's shard of each head (the training's), and with
    the whole heads (the one-device check's); the same hidden states and weights."""

    sharded: orda_tp.TeacherMixture
    whole: orda_tp.TeacherMixture


def mixtures(
    specialists: list[LlamaForCausalLM], batch: DomainBatch, args: argparse.Namespace, runtime: Runtime
) -> Mixtures:
    """Each specialist's final hidden states on ``batch`` and its LM head, weighted per row by
    :func:`mixture_weights`, combined by ``--combine``."""
    with torch.no_grad():
        hidden = [final_hidden(model, batch.inputs).flatten(0, 1) for model in specialists]
    heads = [model.lm_head.weight for model in specialists]
    # A tensor-parallel teacher holds only its shard; these replicated ones take their rows (rank order).
    shards = [head.chunk(runtime.world_size)[runtime.rank] for head in heads]
    weights = mixture_weights(batch, args.routing)

    def combined(chosen: list[Tensor]) -> orda_tp.TeacherMixture:
        members = [orda_tp.SeparateTeacher(rows, head) for rows, head in zip(hidden, chosen)]
        return orda_tp.TeacherMixture(members, weights, combine=args.combine)

    return Mixtures(sharded=combined(shards), whole=combined(heads))


# ---- training and the check --------------------------------------------------------------------


def one_device_errors(
    output: orda_tp.HeadOutput,
    hidden: Tensor,
    student: LlamaForCausalLM,
    teacher: orda_tp.TeacherMixture,
    batch: DomainBatch,
    args: argparse.Namespace,
    runtime: Runtime,
) -> dict[str, float]:
    """The step's loss, KL and gradients (``hidden.grad``, this rank's shard of the head's) against the same loss
    on one device: the student's whole head, ``teacher``'s whole heads, no group. Relative errors, the worst over
    the ranks."""
    rows = hidden.detach().flatten(0, 1).requires_grad_()
    head = full_head(student.lm_head.weight).requires_grad_()
    expected = orda_tp.distillation_loss(rows, head, batch.labels.flatten(), teacher, **loss_options(args))
    d_rows, d_head = torch.autograd.grad(expected.loss, [rows, head])
    d_shard = student.lm_head.weight.grad
    assert hidden.grad is not None and d_shard is not None
    errors = {
        "loss": relative_error(output.loss.detach(), expected.loss),
        "kl": relative_error(output.kl.detach(), expected.kl),
        "d_hidden": relative_error(hidden.grad.flatten(0, 1), d_rows),
        "d_head_shard": relative_error(
            d_shard.to_local() if isinstance(d_shard, DTensor) else d_shard,
            d_head.chunk(runtime.world_size)[runtime.rank],
        ),
    }
    values = torch.tensor(list(errors.values()), dtype=torch.float64, device=runtime.device)
    worst = all_reduce(values, dist.ReduceOp.MAX, runtime)
    return dict(zip(errors, worst.tolist()))


def train_student(
    student: LlamaForCausalLM,
    specialists: list[LlamaForCausalLM],
    batches: list[DomainBatch],
    args: argparse.Namespace,
    runtime: Runtime,
) -> float:
    """``args.steps`` AdamW steps on the batches in order (wrapping around the corpus), each step logged and
    checked against one device before the optimizer moves; returns the worst relative error of every check."""
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0)
    worst = 0.0
    for step in range(1, args.steps + 1):
        batch = batches[(step - 1) % len(batches)]
        hidden = final_hidden(student, batch.inputs)
        hidden.retain_grad()  # the check compares the hidden states' gradient, whole on every rank
        teacher = mixtures(specialists, batch, args, runtime)
        output = student.lm_head(hidden, labels=batch.labels, teacher=teacher.sharded)
        optimizer.zero_grad(set_to_none=True)
        output.loss.backward()  # the hidden gradient arrives summed over the ranks: the bodies stay replicated
        errors = one_device_errors(output, hidden, student, teacher.whole, batch, args, runtime)
        optimizer.step()
        worst = max(worst, *errors.values())
        runtime.log(
            f"step {step:3d} | loss {output.loss.item():.8f} | kl {output.kl.item():.8f} | student_ce "
            f"{output.student_ce.item():.6f} | one-device max rel err {max(errors.values()):.2e}"
        )
    return worst


def main(argv: list[str] | None = None) -> int:
    """Train the specialists, distil the student from their mixture, check every step; returns the exit code (1
    on every rank on FAIL)."""
    args = parse_args(argv)
    runtime = init_runtime()
    if runtime.device.type == "cpu":
        torch.set_num_threads(1)  # tiny models: one thread per process runs fastest on shared cores
    if args.vocab % runtime.world_size != 0:
        raise SystemExit(f"--vocab ({args.vocab}) must be a multiple of the world size ({runtime.world_size})")
    began = time.perf_counter()
    runtime.log(
        f"teacher mixture distillation: TP = {runtime.world_size} on {runtime.device} | vocab {args.vocab} "
        f"({args.vocab // runtime.world_size} head rows per rank) | combine {args.combine}, "
        f"{'routed' if args.routing else f'dense ({DOMAIN_WEIGHT}/{1 - DOMAIN_WEIGHT:.1f})'} | "
        f"{args.kl_divergence} KL, T {args.temperature}"
    )
    languages = [make_language(args.vocab, seed=args.seed + d) for d in range(DOMAINS)]
    specialists = train_specialists(languages, args, runtime)
    batches = make_corpus(languages, args, runtime.device)
    worst = train_student(build_student(args, runtime), specialists, batches, args, runtime)
    passed = worst <= CHECK_TOLERANCE
    runtime.log(
        f"check {'PASS' if passed else 'FAIL'} max_rel_err {worst:.3e} tol {CHECK_TOLERANCE:.0e} (loss, kl, "
        f"d_hidden, d_head_shard against one device, {args.steps} steps) | {time.perf_counter() - began:.1f} s"
    )
    if runtime.group is not None:
        dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    code = main()
    # As launch/distill.py: leave without interpreter shutdown (gloo's threads; docs/integrations.md §10).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
