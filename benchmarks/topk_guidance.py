"""How far a top-k teacher cache is from the teacher it stands for, measured on a trained teacher:
the KD term and its gradients from the cache against those from the dense teacher, for the choices
a user makes (``k``, the tail, the temperature the cache is extracted at). docs/guide.md §15.3 reads
its advice from these numbers (docs/benchmarks.md, "Top-k caches against the teacher they stand for").

    python benchmarks/topk_guidance.py            # 2–3 minutes on a 2-core CPU (more beside other jobs)
    python benchmarks/topk_guidance.py --quick    # fewer steps and tokens: 1–2 minutes

The teacher: a ``transformers.LlamaForCausalLM`` built from a ``LlamaConfig`` (vocab 32000, hidden 64,
1 layer, untied head; seeded, nothing downloaded), trained with plain cross-entropy for ``--teacher-steps``
steps (AdamW, 16 × 32 tokens a step) on a synthetic language with the statistics of text: each token has
8 successors with log-normal probabilities (the Markov language of ``launch/data.py``, which the offline
example trains its teacher on), drawn from a Zipf law over the vocabulary, and with probability
``BACKGROUND`` the next token is drawn from that Zipf law instead. Trained briefly, the teacher is peaked
where text is (its top-k masses at T = 1 and 2 are printed) and its tail is not flat: the frequent ids
stand above the rare ones, as in a real LM. (One layer suffices for a first-order language; in a CPU
minute it learns it faster than two layers do.)

The students, the same for every cache (so that the KL is not 0): a smaller Llama (hidden 32, 1 layer,
another seed) "untrained" (its initialization: near-uniform predictions, as at the start of a
distillation), and the same model after each of ``--student-steps`` (30 and 100) steps of the same
cross-entropy: "30 steps", its held-out CE well above the teacher's but its frequent ids already above
the rare ones, as early in a distillation, and "100 steps", within a few hundredths of a nat of the
teacher's CE, as late in one. The held-out CEs are printed.

On held-out text (``--tokens`` tokens) the teacher's final hidden states and head, and the student's, are
taken in fp64. For each student, T ∈ {1, 2}, k ∈ {16, 64, 256} and each cache
  - "at T": extracted at the training temperature (``orda_tp.teacher_topk(..., temperature=T)``),
  - "1→2":  extracted at T = 1 and read at T = 2 (``TeacherTopK.teacher(tail, retemper=True)``),
and each tail
  - "uniform", "renormalize": the library's (``PrecomputedTeacher``'s tails),
  - "ghost": one more category for the mass the ids miss, as Megatron's and ModelOpt's ghost token: the
    teacher's listed probabilities and its tail mass ``g`` (``1 − Σq``; re-tempered, the uniform tail's
    model of it) matched against the student's probabilities at the listed ids and its whole mass outside
    them, ``KL = Σ_m q_m·log(q_m/p_m) + g·log(g/p_rest)``. Written here by hand on the full fp64 logits
    (checked against the library on the dense teacher), not part of the library,
the KD term ``T²·KL(teacher_T ‖ student_T)`` (mean over tokens, student CE weight 0) and its gradients
with respect to the student's hidden states and head are compared with the dense teacher's (the full
teacher through its head, ``SeparateTeacher``, at the same T): the KD term's relative error, each
gradient's cosine to the dense one and its size (norm ratio). One JSON line per result, then a table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import orda_tp  # noqa: E402

VOCAB, SEQ, BATCH = 32000, 32, 16
BRANCHING, ZIPF_EXPONENT, SPREAD = 8, 1.1, 1.5  # successors per token; their Zipf law; log-normal spread
BACKGROUND = 0.05  # the probability that the next token is drawn from the Zipf law instead
KS = (16, 64, 256)
TEMPERATURES = (1.0, 2.0)
TAILS = ("uniform", "renormalize", "ghost")
LR = 1e-2
CHUNK_ROWS = 256  # rows per block of the hand-written fp64 logits


# ---- the language -------------------------------------------------------------------------------


class ZipfLanguage(NamedTuple):
    """``successors[a, j]`` follows ``a`` with ``probs[a, j]``; ``unigram`` (V,): the Zipf law of the ids."""

    successors: Tensor  # (V, BRANCHING) int64
    probs: Tensor  # (V, BRANCHING) fp64, rows sum to 1
    unigram: Tensor  # (V,) fp64


def make_language(vocab: int, seed: int) -> ZipfLanguage:
    """Each id's ``BRANCHING`` successors drawn without repeat from a Zipf law over the ids (in a random
    order of ranks), with log-normal probabilities of log-scale ``SPREAD``."""
    generator = torch.Generator().manual_seed(seed)
    law = torch.arange(1, vocab + 1, dtype=torch.float64) ** -ZIPF_EXPONENT
    unigram = torch.empty(vocab, dtype=torch.float64)
    unigram[torch.randperm(vocab, generator=generator)] = law / law.sum()  # the id of each rank, at random
    successors = torch.multinomial(unigram.expand(vocab, -1), BRANCHING, replacement=False, generator=generator)
    probs = (SPREAD * torch.randn(vocab, BRANCHING, generator=generator, dtype=torch.float64)).softmax(dim=1)
    return ZipfLanguage(successors, probs, unigram)


def sample(language: ZipfLanguage, batch: int, seed: int) -> tuple[Tensor, Tensor]:
    """``batch`` sequences of ``SEQ`` inputs and their next-token labels, from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.empty(batch, SEQ + 1, dtype=torch.int64)
    tokens[:, 0] = torch.multinomial(language.unigram, batch, replacement=True, generator=generator)
    for position in range(SEQ):
        state = tokens[:, position]
        choice = torch.multinomial(language.probs[state], 1, generator=generator).squeeze(1)
        background = torch.multinomial(language.unigram, batch, replacement=True, generator=generator)
        drawn = torch.rand(batch, generator=generator, dtype=torch.float64) < BACKGROUND
        tokens[:, position + 1] = torch.where(drawn, background, language.successors[state, choice])
    return tokens[:, :-1], tokens[:, 1:]


# ---- the models ---------------------------------------------------------------------------------


def tiny_llama(hidden: int, layers: int, seed: int) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` from a config (as examples/offline_topk_distill.py builds its models), untied."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def pretrain(
    model: LlamaForCausalLM, language: ZipfLanguage, steps: int, seed: int, after: Callable[[int], None] | None = None
) -> None:
    """``steps`` AdamW steps of next-token CE on fresh batches; ``after(n)`` is called after the ``n``-th."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(1, steps + 1):
        inputs, labels = sample(language, BATCH, seed=(seed << 20) + step - 1)
        loss = F.cross_entropy(model(input_ids=inputs, use_cache=False).logits.flatten(0, 1), labels.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if after is not None:
            after(step)


class Head(NamedTuple):
    """A model on the held-out rows, in fp64: what its LM head reads ``(rows, H)`` and the head ``(V, H)``."""

    hidden: Tensor
    weight: Tensor


def head_of(model: LlamaForCausalLM, inputs: Tensor) -> Head:
    with torch.no_grad():
        hidden = model.model(input_ids=inputs, use_cache=False).last_hidden_state
    return Head(hidden.flatten(0, 1).double(), model.lm_head.weight.detach().double())


def held_out_ce(head: Head, labels: Tensor) -> float:
    """The model's next-token CE on the held-out rows."""
    return F.cross_entropy(head.hidden @ head.weight.T, labels).item()


# ---- the KD term and its gradients --------------------------------------------------------------


class Gradients(NamedTuple):
    """The KD term ``T²·KL`` (mean over rows) and its gradients with respect to the student's hidden
    states and head."""

    kd: float
    hidden: Tensor
    head: Tensor


def library_kd(student: Head, labels: Tensor, teacher: orda_tp.PrecomputedTeacher | orda_tp.SeparateTeacher,
               temperature: float) -> Gradients:  # fmt: skip
    """The library's forward KL at ``temperature`` (student and teacher), student CE weight 0, in fp32 (its
    fp64 path on a CPU takes 3–10 × as long); the gradients returned in fp64."""
    hidden, weight = (tensor.float().requires_grad_() for tensor in student)
    out = orda_tp.distillation_loss(
        hidden, weight, labels, teacher, student_ce_weight=0.0, kl_weight=1.0, kl_temperature=temperature
    )
    out.loss.backward()
    assert hidden.grad is not None and weight.grad is not None
    return Gradients(out.loss.item(), hidden.grad.double(), weight.grad.double())


# Rows [begin, end)'s KL(teacher ‖ student), given the student's fp64 log-probabilities of those rows.
TeacherRows = Callable[[int, int, Tensor], Tensor]


def by_hand_kd(student: Head, teacher_of: TeacherRows, temperature: float) -> Gradients:
    """``T²·KL`` by hand in fp64 on the student's full logits, ``CHUNK_ROWS`` rows at a time, each block's
    KL from ``teacher_of(rows, student log-probabilities)``."""
    hidden, weight = (tensor.clone().requires_grad_() for tensor in student)
    rows, total = hidden.shape[0], 0.0
    for begin in range(0, rows, CHUNK_ROWS):
        end = min(rows, begin + CHUNK_ROWS)
        log_p = torch.log_softmax(hidden[begin:end] @ weight.T / temperature, dim=1)
        term = temperature**2 * teacher_of(begin, end, log_p).sum() / rows
        term.backward()  # each block's graph freed before the next: the gradients accumulate
        total += term.item()
    assert hidden.grad is not None and weight.grad is not None
    return Gradients(total, hidden.grad, weight.grad)


@dataclass(frozen=True)
class DenseRows:
    """The dense teacher ``softmax(z_t/T)``, from its fp64 hidden states and head: ``Σ_j q_j·log(q_j/p_j)``."""

    teacher: Head
    temperature: float

    def __call__(self, begin: int, end: int, log_p: Tensor) -> Tensor:
        log_q = torch.log_softmax(self.teacher.hidden[begin:end] @ self.teacher.weight.T / self.temperature, dim=1)
        return (log_q.exp() * (log_q - log_p)).sum(dim=1)


@dataclass(frozen=True)
class GhostRows:
    """The ghost-token teacher: the listed probabilities ``q_m`` and the missing mass ``g`` as one more
    category, matched against the student's listed probabilities and its mass outside them:
    ``Σ_m q_m·log(q_m/p_m) + g·log(g/p_rest)``. Read at another temperature than the cache's (ratio
    ``made_at / T``), the values are re-tempered as the uniform tail re-tempers them (the missing mass
    spread over the ``V − k`` other ids): only the matching of the tail differs from "uniform"."""

    ids: Tensor  # (rows, k)
    logprobs: Tensor  # (rows, k) fp64, at the cache's temperature
    ratio: float  # made_at / T

    def __call__(self, begin: int, end: int, log_p: Tensor) -> Tensor:
        ids, listed = self.ids[begin:end], self.logprobs[begin:end]
        others = log_p.shape[1] - ids.shape[1]
        missing = (1.0 - listed.exp().sum(dim=1, keepdim=True)).clamp_min(0.0)
        # The tail's V − k ids of τ = log(missing/(V − k)) each, as one category: log(V − k) + ratio·τ.
        bucket = math.log(others) + self.ratio * (missing.log() - math.log(others))
        log_q = torch.log_softmax(torch.cat([self.ratio * listed, bucket], dim=1), dim=1)
        # The student's mass outside the listed ids, as a log-sum-exp with those ids masked out.
        log_rest = log_p.scatter(1, ids, float("-inf")).logsumexp(dim=1, keepdim=True)
        log_p = torch.cat([log_p.gather(1, ids), log_rest], dim=1)
        return torch.xlogy(log_q.exp(), log_q.exp()).sum(dim=1) - (log_q.exp() * log_p).sum(dim=1)


# ---- the comparison -----------------------------------------------------------------------------


def cosine(a: Tensor, b: Tensor) -> float:
    return F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


def size(a: Tensor, b: Tensor) -> float:
    return (a.norm() / b.norm()).item()


@dataclass(frozen=True)
class Result:
    """One cache against the dense teacher, for one student at one temperature."""

    student: str
    temperature: float
    cache: str  # "at T" (extracted at the training temperature) or "1→2" (at 1, read re-tempered at 2)
    k: int
    mass: float  # the mean mass the listed ids hold in the dense teacher at T
    tail: str
    kd: float
    kd_dense: float
    kd_error: float  # kd / kd_dense − 1
    hidden_cosine: float
    hidden_size: float  # ‖grad‖ / ‖dense grad‖
    head_cosine: float
    head_size: float


def result(key: tuple[str, float, str, int, float, str], got: Gradients, dense: Gradients) -> Result:
    """``got`` against ``dense``, under ``key`` (student, temperature, cache, k, mass, tail)."""
    return Result(
        *key,
        kd=got.kd,
        kd_dense=dense.kd,
        kd_error=got.kd / dense.kd - 1.0,
        hidden_cosine=cosine(got.hidden, dense.hidden),
        hidden_size=size(got.hidden, dense.hidden),
        head_cosine=cosine(got.head, dense.head),
        head_size=size(got.head, dense.head),
    )


def listed_mass(teacher: Head, ids: Tensor, temperature: float) -> float:
    """The mean mass of ``ids`` (rows, k) in the dense teacher at ``temperature``."""
    log_q = torch.log_softmax(teacher.hidden @ teacher.weight.T / temperature, dim=1)
    return log_q.gather(1, ids).exp().sum(dim=1).mean().item()


def measure(name: str, student: Head, teacher: Head, labels: Tensor, temperature: float,
            caches: dict[tuple[float, int], orda_tp.TeacherTopK]) -> list[Result]:  # fmt: skip
    """Every cache (``caches[(made_at, k)]``) and tail against the dense teacher at ``temperature``, for one
    student."""
    dense_teacher = orda_tp.SeparateTeacher(teacher.hidden.float(), teacher.weight.float())
    dense = library_kd(student, labels, dense_teacher, temperature)
    exact = by_hand_kd(student, DenseRows(teacher, temperature), temperature)
    # The hand-written KL (the ghost's) is the library's on the dense teacher, within fp32 rounding.
    assert abs(exact.kd / dense.kd - 1) < 1e-5 and cosine(exact.hidden, dense.hidden) > 1 - 1e-6, (exact, dense)
    made = [("at T", temperature)] + ([("1→2", 1.0)] if temperature == 2.0 else [])
    results = []
    for cache, made_at in made:
        for k in KS:
            top = caches[(made_at, k)]
            mass = listed_mass(teacher, top.ids, temperature)
            for tail in TAILS:
                if tail == "ghost":  # by hand in fp64: against the fp64 dense teacher
                    rows = GhostRows(top.ids, top.logprobs.double(), made_at / temperature)
                    got, reference = by_hand_kd(student, rows, temperature), exact
                else:
                    retemper = made_at != temperature
                    got, reference = (
                        library_kd(student, labels, top.teacher(tail, retemper=retemper), temperature),
                        dense,
                    )
                results.append(result((name, temperature, cache, k, mass, tail), got, reference))
                print(json.dumps(asdict(results[-1])), flush=True)
    return results


def table(results: list[Result]) -> str:
    """The results as a markdown table, one row per (student, T, cache, k), the tails side by side."""
    lines = [
        "| student | T | cache | k | mass | KD error: uniform / renorm. / ghost | hidden cos | hidden size "
        "| head cos | head size |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, float, str, int], list[Result]] = {}
    for result in results:
        groups.setdefault((result.student, result.temperature, result.cache, result.k), []).append(result)
    for (student, temperature, cache, k), group in groups.items():

        def each(field: str, form: str, row: list[Result] = group) -> str:
            return " / ".join(format(getattr(result, field), form) for result in row)

        lines.append(
            f"| {student} | {temperature:g} | {cache} | {k} | {group[0].mass:.3f} | {each('kd_error', '+.3f')} | "
            f"{each('hidden_cosine', '.4f')} | {each('hidden_size', '.3f')} | {each('head_cosine', '.4f')} | "
            f"{each('head_size', '.3f')} |"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Setup:
    """What was measured on: the models' training, the held-out tokens, the teacher's mean top-1, 16, 64 and
    256 masses at T = 1 and 2, the models' held-out CE (nats), and the training's seconds."""

    teacher_steps: int
    student_steps: list[int]
    tokens: int
    teacher_mass_t1: list[float]
    teacher_mass_t2: list[float]
    teacher_ce: float
    student_ce: dict[str, float]
    train_seconds: float
    vocab: int = VOCAB
    teacher: str = "LlamaForCausalLM hidden 64, 1 layer"
    student: str = "LlamaForCausalLM hidden 32, 1 layer"
    torch_version: str = torch.__version__
    threads: int = torch.get_num_threads()


def steps_list(text: str) -> list[int]:
    """``"30,100"`` → ``[30, 100]``, each a positive count."""
    steps = [int(part) for part in text.split(",")]
    if not steps or min(steps) < 1:
        raise argparse.ArgumentTypeError(f"expected positive step counts, comma-separated, got {text!r}")
    return steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="50 teacher steps, a student of 10 steps, 256 tokens")
    parser.add_argument("--teacher-steps", type=int, default=150)
    parser.add_argument(
        "--student-steps", type=steps_list, default=[30, 100], help="the trained students' steps (comma-separated)"
    )
    parser.add_argument("--tokens", type=int, default=512, help="held-out tokens (a multiple of 32)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.teacher_steps, args.student_steps, args.tokens = 50, [10], 256
    if args.tokens % SEQ or args.tokens <= 0:
        parser.error(f"--tokens must be a positive multiple of {SEQ}, got {args.tokens}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    began = time.perf_counter()
    language = make_language(VOCAB, args.seed)
    teacher = tiny_llama(hidden=64, layers=1, seed=args.seed)
    pretrain(teacher, language, args.teacher_steps, seed=args.seed + 1)
    student_model = tiny_llama(hidden=32, layers=1, seed=args.seed + 2)
    inputs, labels = sample(language, args.tokens // SEQ, seed=args.seed + 3)  # held out: another seed
    labels = labels.flatten()
    students = {"untrained": head_of(student_model, inputs)}

    def snapshot(step: int) -> None:
        if step in args.student_steps:
            students[f"{step} steps"] = head_of(student_model, inputs)

    pretrain(student_model, language, max(args.student_steps), seed=args.seed + 4, after=snapshot)
    trained_in = time.perf_counter() - began
    teacher_head = head_of(teacher, inputs)
    ranked = torch.topk(teacher_head.hidden @ teacher_head.weight.T, max(KS)).indices  # the same at every T
    setup = Setup(
        teacher_steps=args.teacher_steps,
        student_steps=args.student_steps,
        tokens=args.tokens,
        teacher_mass_t1=[round(listed_mass(teacher_head, ranked[:, :k], 1.0), 4) for k in (1, *KS)],
        teacher_mass_t2=[round(listed_mass(teacher_head, ranked[:, :k], 2.0), 4) for k in (1, *KS)],
        teacher_ce=round(held_out_ce(teacher_head, labels), 4),
        student_ce={name: round(held_out_ce(head, labels), 4) for name, head in students.items()},
        train_seconds=round(trained_in, 1),
    )
    print(json.dumps(asdict(setup)), flush=True)
    # Extracted once each, from the fp32 teacher (as the library's calls read it): at 1 and 2, every k.
    caches = {
        (made_at, k): orda_tp.teacher_topk(
            teacher_head.hidden.float(), teacher_head.weight.float(), k, temperature=made_at
        )
        for made_at in TEMPERATURES
        for k in KS
    }
    results = []
    for name, student in students.items():
        for temperature in TEMPERATURES:
            results += measure(name, student, teacher_head, labels, temperature, caches)
    print(table(results))
    print(f"{time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
