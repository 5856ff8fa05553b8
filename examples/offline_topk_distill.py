"""Offline distillation from a top-k teacher cache: write the cache once with a tensor-parallel teacher, then
train a tensor-parallel student from it, and check that this is the same training as with the teacher online.

    torchrun --standalone --nproc-per-node 2 examples/offline_topk_distill.py            # TP = 2 on gloo (CPU)
    torchrun --standalone --nproc-per-node 2 examples/offline_topk_distill.py --k 32 --steps 12 --cache-dir /tmp/c
    torchrun --standalone --nproc-per-node 2 examples/offline_topk_distill.py --k 32 --cache-dir /tmp/c --resume
    python examples/offline_topk_distill.py                                               # one process, TP = 1

1. The corpus: ``--sequences`` sequences of ``--seq`` tokens drawn from the synthetic Markov language of the
   main job (``launch/data.py``). Token ``t`` of sequence ``i`` has the global offset ``i · seq + t``: the row
   of the cache that holds the teacher's prediction at that position (whose label is token ``t + 1``).
2. The teacher: a tiny ``transformers.LlamaForCausalLM`` built from a ``LlamaConfig`` (seeded, nothing is
   downloaded), pre-trained briefly with plain cross-entropy so that its top-k is not noise. It is replicated
   on every rank, and each rank reads only its shard of the LM head (rows split along the vocabulary, in rank
   order), as a tensor-parallel teacher would hold it.
3. Phase "write": every rank runs the teacher over the corpus, batch by batch, and extracts each row's top-k
   log-probabilities with ``orda_tp.teacher_topk(hidden, head_shard, k, tp_group=...)``: each rank reads its
   shard of the head, the candidates are merged in one all-gather per chunk, and every rank gets the
   single-device result without forming the (tokens × vocab) logits. Rank 0 stores it with
   ``orda_tp.topk_cache.TopKCacheWriter`` (log-probabilities in fp16), the rows in corpus order.
   With data parallelism, data-parallel rank ``d`` would run the teacher over its own contiguous range of
   sequences and its tensor-parallel rank 0 would open a writer with ``start=`` the global offset of that
   range's first token; here TP = world size and DP = 1, so one writer holds every row from offset 0.
   The writer writes a shard every ``--rows-per-shard`` rows. A ``--cache-dir`` that already holds shards
   is refused (on every rank, before the teacher trains) unless ``--resume`` is given, which keeps them
   and finishes the cache (the writer continues after its last whole shard: a killed run loses at most
   the rows of one shard), or ``--replace``, which deletes them and writes the cache again.
4. Phase "train": the student, a smaller tiny Llama whose ``lm_head`` is an ``orda_tp.DistillationHead``
   split over the ranks by ``parallelize_module(student, mesh, {"lm_head": orda_tp.VocabParallel()})``,
   trains ``--steps`` steps on ``student CE + kl_weight · T² · KL(teacher_T ‖ student_T)``, each batch's
   teacher rows read from the cache with ``reader.teacher(start, stop, tail="uniform")`` (the cached
   probabilities, the missing mass spread evenly over the other ids: a normalized teacher). The cache's
   settings are checked against the student's vocabulary and ``k`` first (``reader.check``).
5. The checks: the cache's rows are the extraction's and nothing else (the same ids, the log-probabilities
   rounded to fp16); and the same student initialization trained the same steps on the same batches with the
   teacher online (``teacher_topk`` of the same teacher computed in memory every step, fp32) gives the same
   losses within the cache's fp16 rounding (relative 2⁻¹¹ per stored log-probability). The script prints
   both losses per step and ``check PASS`` (or ``check FAIL``, exiting 1 on every rank).
6. Beside the PASS, what the cache costs against the real teacher (a measure, not a check): on the first
   batch, with the student trained from the cache, the KD term ``T²·KL(teacher_T ‖ student_T)`` from the
   cache and from the teacher itself (its final hidden states through its head: every id, at the training
   temperature), and the cosine and size of the KD term's gradient with respect to the student's hidden
   states, from the cache against the dense teacher's (docs/benchmarks.md, "Top-k caches against the
   teacher they stand for", measures them on a V = 32000 teacher).

Needs transformers (tested with 5.24.0) and safetensors for the cache (``pip install -e '.[cache]'``). About 10 s
with 2 ranks on two CPU cores. Only rank 0 prints.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

try:
    from transformers import LlamaForCausalLM
except ImportError as error:  # not a dependency of orda_tp: say how to install it
    raise ImportError(
        "examples/offline_topk_distill.py needs transformers: pip install 'transformers==5.24.0'"
    ) from error

# Run from a checkout without installing: the repository root holds `orda_tp` and the main job's `launch`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_llama import final_hidden, pretrain, tiny_llama  # noqa: E402  (examples/: the script's own directory)

import orda_tp  # noqa: E402
from launch.data import Batch, make_language, sample_batch  # noqa: E402
from launch.distill import Runtime, all_reduce, init_runtime, positive_int  # noqa: E402
from orda_tp.topk_cache import CacheSettings, TopKCacheReader, TopKCacheWriter, head_digest, stored_logprobs  # noqa: E402

STORED_DTYPE = torch.float16  # the cache's log-probabilities
# fp16 keeps 11 significant bits: each stored log-probability is within 2⁻¹¹ of its value, relatively. The losses
# from the cache and online must agree to twice that, relatively: a rounding-sized bound (the measured gap is far
# smaller; after the first step it also holds the parameters' drift, each step's gradient seeing the rounding).
CHECK_TOLERANCE = 2 * 2.0**-11
TAIL = "uniform"  # guide §15: every variant stays finite, and the teacher stays a normalized distribution


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; the defaults finish in well under a minute with 2 ranks on two CPU cores."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", type=Path, default=None, help="where to write the cache (default: a temp dir)")
    existing = parser.add_mutually_exclusive_group()
    existing.add_argument(
        "--resume", action="store_true", help="keep the shards already in --cache-dir and finish the cache"
    )
    existing.add_argument(
        "--replace", action="store_true", help="delete the shards already in --cache-dir and write the cache again"
    )
    parser.add_argument("--rows-per-shard", type=positive_int, default=1024, help="rows in each shard of the cache")
    parser.add_argument("--k", type=positive_int, default=64, help="log-probabilities cached per token")
    parser.add_argument("--steps", type=positive_int, default=8, help="student training steps")
    parser.add_argument("--teacher-steps", type=int, default=150, help="teacher pre-training steps (0: random)")
    parser.add_argument("--sequences", type=positive_int, default=64, help="sequences in the corpus")
    parser.add_argument("--batch", type=positive_int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=positive_int, default=32, help="tokens per sequence")
    parser.add_argument("--vocab", type=positive_int, default=2048, help="vocabulary (a multiple of the world size)")
    parser.add_argument("--teacher-hidden", type=positive_int, default=64)
    parser.add_argument("--student-hidden", type=positive_int, default=32)
    parser.add_argument("--temperature", type=float, default=2.0, help="KL temperature T (student and teacher)")
    parser.add_argument("--kl-weight", type=float, default=1.0, help="weight of the T²-scaled KL term")
    parser.add_argument("--lr", type=float, default=1e-2, help="student learning rate (AdamW)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.teacher_steps < 0:
        parser.error(f"--teacher-steps must be >= 0, got {args.teacher_steps}")
    if args.sequences % args.batch != 0:
        parser.error(f"--sequences ({args.sequences}) must be a multiple of --batch ({args.batch})")
    if (args.resume or args.replace) and args.cache_dir is None:
        parser.error("--resume and --replace need --cache-dir (the default is a new temporary directory)")
    return args


# ---- corpus ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CorpusBatch:
    """Sequences ``[first, first + batch)`` of the corpus and their rows ``[start, stop)`` in the cache."""

    inputs: Tensor  # (batch, seq) token ids
    labels: Tensor  # (batch, seq) next-token labels
    start: int
    stop: int


def make_corpus(args: argparse.Namespace) -> Batch:
    """The corpus: ``args.sequences`` sequences of the Markov language, the same on every rank."""
    return sample_batch(make_language(args.vocab, seed=args.seed), args.sequences, args.seq, seed=args.seed + 1)


def corpus_batches(corpus: Batch, batch: int, device: torch.device) -> list[CorpusBatch]:
    """The corpus in batches of ``batch`` sequences, in order, on ``device``; a batch's rows in the cache are
    ``[start, stop)``, the offset of a token being ``sequence · seq + position``."""
    inputs, labels, seq = corpus.inputs.to(device), corpus.labels.to(device), corpus.inputs.shape[1]
    return [
        CorpusBatch(inputs[i : i + batch], labels[i : i + batch], i * seq, (i + batch) * seq)
        for i in range(0, inputs.shape[0], batch)
    ]


# ---- models ------------------------------------------------------------------------------------


def pretrain_teacher(teacher: LlamaForCausalLM, args: argparse.Namespace, runtime: Runtime) -> None:
    """A few steps of plain next-token CE on fresh text of the language (the same on every rank), then freeze."""
    language = make_language(args.vocab, seed=args.seed)
    done = pretrain(teacher, language, args.teacher_steps, args.seq, (args.seed << 32) + 1000, runtime.device)
    if done is not None:
        runtime.log(f"teacher: {args.teacher_steps} pre-training steps, CE {done.ce:.4f} (floor {done.floor:.4f})")


def build_student(args: argparse.Namespace, runtime: Runtime) -> LlamaForCausalLM:
    """The student (always the same initialization): its ``lm_head`` a ``DistillationHead`` around the same
    weight, split along the vocabulary over the ranks by ``VocabParallel``."""
    student = tiny_llama(
        args.vocab, args.student_hidden, layers=1, max_seq=args.seq, seed=args.seed + 2, device=runtime.device
    )
    student.lm_head = orda_tp.DistillationHead.from_linear(
        student.lm_head, kl_weight=args.kl_weight, kl_temperature=args.temperature, teacher_ce_weight=0.0
    )
    if runtime.mesh is not None:
        parallelize_module(student, runtime.mesh, {"lm_head": orda_tp.VocabParallel()})
    return student


# ---- the teacher's top-k -----------------------------------------------------------------------


def extract_topk(
    teacher: LlamaForCausalLM, inputs: Tensor, k: int, temperature: float, runtime: Runtime
) -> orda_tp.TeacherTopK:
    """The teacher's top-``k`` log-probabilities at ``temperature`` (the training's: the cache is then the
    teacher the loss reads, as it is) at every position of ``inputs``, ``(batch · seq, k)`` rows in row-major
    order, from its final hidden states and this rank's vocabulary shard of its head."""
    with torch.no_grad():
        hidden = final_hidden(teacher, inputs)
    # A tensor-parallel teacher holds only its shard; this replicated one takes its rows of the head (rank order).
    head_shard = teacher.lm_head.weight.chunk(runtime.world_size)[runtime.rank]
    rows = hidden.reshape(-1, hidden.shape[-1])
    return orda_tp.teacher_topk(rows, head_shard, k, temperature=temperature, tp_group=runtime.group)


def cache_settings(teacher_name: str, args: argparse.Namespace) -> CacheSettings:
    """What the cache holds: log-probabilities of the uncapped teacher ``teacher_name`` at the training's
    temperature."""
    return CacheSettings(
        vocab_size=args.vocab,
        k=args.k,
        temperature=args.temperature,
        logit_softcap=None,
        teacher=teacher_name,
        logprob_dtype=STORED_DTYPE,
    )


def write_cache(
    teacher: LlamaForCausalLM,
    settings: CacheSettings,
    batches: list[CorpusBatch],
    directory: Path,
    args: argparse.Namespace,
    runtime: Runtime,
) -> int:
    """Phase "write": every rank extracts every batch's top-k (the head split over the ranks); rank 0 appends it
    to the cache, in corpus order from offset 0. With ``--resume`` the writer continues after the shards it
    finds (their settings must be these), and the batches they hold are not run again. Returns the rows the
    directory held before (0 without ``--resume``)."""
    with contextlib.ExitStack() as stack:
        writer: TopKCacheWriter | None = None
        opened: list[tuple[int, str]] = [(0, "")]  # rank 0's: the rows its shards hold, or why it cannot write
        if runtime.rank == 0:
            try:
                writer = TopKCacheWriter(
                    directory, settings, start=0, rows_per_shard=args.rows_per_shard, resume=args.resume
                )
                stack.enter_context(writer)
                opened = [(writer.num_written, "")]
            except (OSError, ValueError) as error:  # e.g. kept shards of another teacher, k or temperature
                opened = [(0, f"cannot write the cache in {directory}: {error}")]
        if runtime.group is not None:
            # On every rank: the extraction is collective, so every rank skips the same batches, or raises.
            dist.broadcast_object_list(opened, src=0, group=runtime.group)
        kept, failure = opened[0]
        if failure:
            raise SystemExit(failure)
        for batch in batches:
            if batch.stop <= kept:
                continue
            topk = extract_topk(teacher, batch.inputs, args.k, args.temperature, runtime)
            if writer is not None:
                skip = max(0, kept - batch.start)  # the rows of a batch that a kept shard already holds
                writer.append(
                    topk._replace(
                        ids=topk.ids[skip:], logprobs=topk.logprobs[skip:], log_partition=topk.log_partition[skip:]
                    )
                )
    if runtime.group is not None:
        dist.barrier(group=runtime.group)  # the cache is complete before any rank reads it
    return kept


def cache_directory(args: argparse.Namespace, runtime: Runtime) -> Path:
    """``--cache-dir``, or a new temporary directory made by rank 0, its path sent to every rank. Shards already
    there are refused on every rank unless ``--resume`` keeps them or ``--replace`` has rank 0 delete them."""
    listing: list[list[str]] = [[]]  # rank 0's: the directory, then the names of the shards in it
    if runtime.rank == 0:
        chosen = args.cache_dir if args.cache_dir is not None else Path(tempfile.mkdtemp(prefix="orda_topk_"))
        listing = [[str(chosen), *sorted(path.name for path in chosen.glob(f"{CacheSettings.PREFIX}-*.safetensors"))]]
    if runtime.group is not None:
        dist.broadcast_object_list(listing, src=0, group=runtime.group)  # before rank 0 writes or deletes anything
    directory, shards = Path(listing[0][0]), listing[0][1:]
    if shards and not (args.resume or args.replace):
        raise SystemExit(
            f"--cache-dir {directory} already holds {len(shards)} top-k cache shards ({shards[0]} …): pass --resume "
            "to keep them and finish the cache, or --replace to delete them and write it again"
        )
    if shards and args.replace:
        if runtime.rank == 0:
            # The cache's files only (and a killed writer's hidden temporaries); anything else in the directory stays.
            prefix = CacheSettings.PREFIX
            for path in (*directory.glob(f"{prefix}-*.safetensors"), *directory.glob(f".{prefix}-*.safetensors.tmp")):
                path.unlink()
        runtime.log(f"--replace: deleted the {len(shards)} shards in {directory}")
    return directory


def disk_mib(directory: Path) -> float:
    """The size of the files in ``directory``, in MiB."""
    return sum(path.stat().st_size for path in directory.iterdir() if path.is_file()) / 2**20


# ---- training ----------------------------------------------------------------------------------


TeacherSource = Callable[[CorpusBatch], orda_tp.PrecomputedTeacher]


def train_student(
    student: LlamaForCausalLM, teacher_of: TeacherSource, batches: list[CorpusBatch], args: argparse.Namespace
) -> list[float]:
    """``args.steps`` AdamW steps of ``student`` on the batches in order (wrapping around the corpus), each
    batch's teacher from ``teacher_of``; returns the loss of every step."""
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.0)
    losses = []
    for step in range(args.steps):
        batch = batches[step % len(batches)]
        output = student.lm_head(final_hidden(student, batch.inputs), labels=batch.labels, teacher=teacher_of(batch))
        optimizer.zero_grad(set_to_none=True)
        output.loss.backward()  # the hidden gradient arrives summed over the ranks: the bodies stay replicated
        optimizer.step()
        losses.append(output.loss.item())
    return losses


class AgainstTeacher(NamedTuple):
    """The KD term ``T²·KL(teacher_T ‖ student_T)`` from the cache and from the dense teacher, and the cosine
    and size (norm ratio) of its gradient with respect to the student's hidden states, cache against teacher."""

    kd_cache: float
    kd_teacher: float
    hidden_cosine: float
    hidden_size: float


def against_teacher(
    student: LlamaForCausalLM,
    teacher: LlamaForCausalLM,
    reader: TopKCacheReader,
    batch: CorpusBatch,
    args: argparse.Namespace,
    runtime: Runtime,
) -> AgainstTeacher:
    """What the cache costs against the real teacher on ``batch``: the KD term alone (student CE weight 0) from
    ``reader``'s rows and from the dense teacher (its final hidden states through this rank's shard of its head,
    at the training temperature), and its gradient with respect to the student's hidden states."""
    with torch.no_grad():
        hidden = final_hidden(student, batch.inputs).flatten(0, 1)
        teacher_hidden = final_hidden(teacher, batch.inputs).flatten(0, 1)
    weight = student.lm_head.weight
    weight = (weight.to_local() if isinstance(weight, DTensor) else weight).detach()  # this rank's vocabulary shard
    head_shard = teacher.lm_head.weight.chunk(runtime.world_size)[runtime.rank]
    teachers = (
        reader.teacher(batch.start, batch.stop, tail=TAIL, device=runtime.device),
        orda_tp.SeparateTeacher(teacher_hidden, head_shard),
    )
    terms, grads = [], []
    for source in teachers:
        rows = hidden.clone().requires_grad_()
        output = orda_tp.distillation_loss(
            rows, weight, batch.labels.flatten(), source, student_ce_weight=0.0, teacher_ce_weight=0.0,
            kl_weight=1.0, kl_temperature=args.temperature, tp_group=runtime.group,
        )  # fmt: skip
        (grad,) = torch.autograd.grad(output.loss, rows)  # whole on every rank: the ranks' parts are summed
        terms.append(output.loss.item())
        grads.append(grad.flatten().double())
    cosine = F.cosine_similarity(grads[0], grads[1], dim=0).item()
    return AgainstTeacher(terms[0], terms[1], cosine, (grads[0].norm() / grads[1].norm()).item())


def check_rows(
    reader: TopKCacheReader,
    teacher: LlamaForCausalLM,
    batches: list[CorpusBatch],
    args: argparse.Namespace,
    runtime: Runtime,
) -> bool:
    """The cache holds what the extraction returns, rounded to its dtype and nothing else: on every batch, the
    ids of ``reader.rows`` equal the online ones and the log-probabilities equal theirs as the writer rounds
    them to fp16 (``stored_logprobs``: to nearest, or toward −inf in a row whose mass would round above 1)."""
    rows, exact = 0, True
    for batch in batches:
        ids, logprobs = (rows.to(runtime.device) for rows in reader.rows(batch.start, batch.stop))
        online = extract_topk(teacher, batch.inputs, args.k, args.temperature, runtime)
        exact &= torch.equal(ids, online.ids) and torch.equal(
            logprobs, stored_logprobs(online.logprobs.cpu(), STORED_DTYPE).to(logprobs)
        )
        rows += ids.shape[0]
    passed = bool(all_reduce(torch.tensor(int(exact), device=runtime.device), dist.ReduceOp.MIN, runtime))
    verdict = "PASS" if passed else "FAIL"
    runtime.log(f"cache rows {verdict}: ids and fp16-rounded log-probabilities equal the online ones on {rows} rows")
    return passed


def check_losses(cached: list[float], online: list[float], runtime: Runtime) -> bool:
    """Print both runs' losses step by step; PASS when every step agrees within :data:`CHECK_TOLERANCE`
    (relative) on every rank."""
    relative = [abs(c - o) / abs(o) for c, o in zip(cached, online)]
    for step, (c, o, r) in enumerate(zip(cached, online, relative), start=1):
        runtime.log(f"step {step:3d} | loss from cache {c:.8f} | teacher online {o:.8f} | rel diff {r:.2e}")
    worst = all_reduce(
        torch.tensor(max(relative), dtype=torch.float64, device=runtime.device), dist.ReduceOp.MAX, runtime
    ).item()
    passed = worst <= CHECK_TOLERANCE
    runtime.log(
        f"losses {'PASS' if passed else 'FAIL'}: max_rel_diff {worst:.3e} tol {CHECK_TOLERANCE:.3e} "
        f"(cache in {str(STORED_DTYPE).removeprefix('torch.')} vs online fp32, {len(cached)} steps)"
    )
    return passed


def main(argv: list[str] | None = None) -> int:
    """Write the cache, train from it and online, compare; returns the exit code (1 on every rank on FAIL)."""
    args = parse_args(argv)
    runtime = init_runtime()
    if runtime.device.type == "cpu":
        torch.set_num_threads(1)  # tiny models: one thread per process runs fastest on shared cores
    if args.vocab % runtime.world_size != 0:
        raise SystemExit(f"--vocab ({args.vocab}) must be a multiple of the world size ({runtime.world_size})")
    began = time.perf_counter()
    # Before the teacher trains: a directory that holds shards is refused at once, on every rank.
    directory = cache_directory(args, runtime)
    batches = corpus_batches(make_corpus(args), args.batch, runtime.device)
    teacher = tiny_llama(
        args.vocab, args.teacher_hidden, layers=2, max_seq=args.seq, seed=args.seed, device=runtime.device
    )
    runtime.log(
        f"offline top-k distillation: TP = {runtime.world_size} on {runtime.device} | vocab {args.vocab} "
        f"({args.vocab // runtime.world_size} head rows per rank) | corpus {args.sequences} x {args.seq} tokens | "
        f"k {args.k} | T {args.temperature} | tail {TAIL}"
    )
    pretrain_teacher(teacher, args, runtime)
    teacher_name = head_digest(teacher.lm_head.weight)  # names the teacher (and its training) the cache is of
    kept = write_cache(teacher, cache_settings(teacher_name, args), batches, directory, args, runtime)
    reader = TopKCacheReader(directory)
    mass = reader.rows(0, reader.num_tokens)[1].exp().sum(dim=1).mean().item()
    runtime.log(
        f"write: {reader.num_tokens} tokens x top-{args.k} in {directory} ({len(reader.shards)} shards, "
        f"{disk_mib(directory):.2f} MiB; {kept} rows kept, {reader.num_tokens - kept} written now) | "
        f"mean top-k mass {mass:.4f} | {time.perf_counter() - began:.1f} s"
    )
    # The student's settings: a cache of another vocabulary, k, temperature or teacher raises here (a job
    # without the teacher at hand passes teacher=None, or the name it was written with).
    reader.check(
        vocab_size=args.vocab, k=args.k, temperature=args.temperature, logit_softcap=None, teacher=teacher_name
    )
    rows_ok = check_rows(reader, teacher, batches, args, runtime)
    student = build_student(args, runtime)
    cached = train_student(
        student,
        lambda batch: reader.teacher(batch.start, batch.stop, tail=TAIL, device=runtime.device),
        batches,
        args,
    )
    online = train_student(
        build_student(args, runtime),
        lambda batch: extract_topk(teacher, batch.inputs, args.k, args.temperature, runtime).teacher(tail=TAIL),
        batches,
        args,
    )
    losses_ok = check_losses(cached, online, runtime)
    cost = against_teacher(student, teacher, reader, batches[0], args, runtime)
    relative = cost.kd_cache / cost.kd_teacher - 1
    runtime.log(
        f"cache vs teacher: KD term {cost.kd_cache:.6f} from the cache, {cost.kd_teacher:.6f} from the dense teacher "
        f"(rel {relative:+.2e}) | hidden-gradient cosine {cost.hidden_cosine:.6f}, size {cost.hidden_size:.4f} "
        f"(batch 1, the student trained from the cache, T {args.temperature})"
    )
    if runtime.group is not None:
        dist.barrier(group=runtime.group)  # every rank is done with the cache
    if args.cache_dir is None and runtime.rank == 0:
        shutil.rmtree(directory)
    passed = rows_ok and losses_ok
    runtime.log(
        f"summary: student loss {cached[0]:.4f} -> {cached[-1]:.4f} over {args.steps} steps from the cache | "
        f"cache vs teacher: KL rel {relative:+.1e}, hidden-gradient cosine {cost.hidden_cosine:.4f} | "
        f"{time.perf_counter() - began:.1f} s | check {'PASS' if passed else 'FAIL'}"
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
