"""How a top-k cache stores its rows: the stored dtypes and the compact encoding
(:mod:`orda_tp.topk_cache.compact`): their size, their read speed and the error of a loss read
through them, beside the encodings the compact one was chosen from.

``python benchmarks/topk_cache_dtype.py`` (CPU, a few minutes on two cores; ``--device cuda`` times
the codec and the reader on a GPU too). Prints one JSON line per result:

- ``bytes``: bytes per token of each encoding (``ENCODINGS``) at V = 32000, 128256, 151936,
  262144 and 2³¹ and k = 16, 64, 128, 256, on two kinds of realistic top-k id sets (their mean:
  the escape-based encodings depend on the gaps between a row's sorted ids, the others do not):
  ``uniform``, the top-k of Gaussian logits (every id as likely: the tests' problems, a random
  head), and ``zipf``, the top-k of ``−log(1 + id) + 2·N(0, 1)`` (ids ordered by frequency, as BPE
  vocabularies roughly are, and a context that moves them). At 2³¹ only the fixed-size ones.
  The escape-based ones also need a row index (4 B a row), counted; a shard's header is not.
- ``speed``: encode and decode rows/s of the codec at k = 64 (one thread: one data-loader worker),
  beside the rows/s of the plain cache's read (int32 ids and float16 values widened to int64 and
  float32); compare with the tokens/s of ``benchmarks/train_step.py --methods orda_topk`` (a
  training step on a top-64 cache; this script does not run it).
- ``reader``: rows/s of :class:`~orda_tp.topk_cache.TopKCacheReader` reading a cache of each
  encoding (V = 128256, k = 64, ``--speed-rows`` rows in shards of 65536) a step's 8192 rows at a
  time onto each device (int64 ids and float32 log-probabilities there: the compact one decodes
  there), after a first pass that verified the shards' checksums (timed apart): the files sit in
  the page cache, so this is the reader's cost, not the disk's.
- ``error``: as the first version of this script did (docs/benchmarks.md, "The cache on disk"): a
  teacher of logits std 3 over V = 32000, its top-k (k = 16, 64, 128)
  written float32, float16 and bfloat16, and float16 with ``encoding="compact"``, by
  :class:`~orda_tp.topk_cache.TopKCacheWriter` and read back by the reader; ``student_ce + forward KL`` with
  ``tail="uniform"`` and its gradients wrt the student's hidden states and head, relative to the
  float32 cache's: ``loss_rel``, ``kl_rel``, ``grad_rel`` (the larger norm-wise gradient error).
  ``res12``/``res8`` are the per-row-reference alternatives (the row's largest value in float32
  and ``(max − l)`` in 12 or 8 bits, steps 2⁻⁷ and 2⁻³ nats, quantized here, not stored).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import orda_tp  # noqa: E402
from orda_tp.topk_cache import CacheSettings, TopKCacheReader, TopKCacheWriter, stored_logprobs  # noqa: E402
from orda_tp.topk_cache.compact import LOGPROB_BITS, decode, encode, layout  # noqa: E402

VOCABS = (32000, 128256, 151936, 262144, 2**31)
KS = (16, 64, 128, 256)


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def id_sets(kind: str, vocab: int, k: int, rows: int, generator: torch.Generator) -> torch.Tensor:
    """``rows`` top-k id sets of a ``kind`` teacher over ``vocab`` ids (module docstring)."""
    parts = []
    for _ in range(0, rows, 32):  # 32 rows of logits at a time
        noise = torch.randn(32, vocab, generator=generator)
        logits = noise if kind == "uniform" else 2.0 * noise - torch.log1p(torch.arange(vocab, dtype=torch.float32))
        parts.append(logits.topk(k, dim=1).indices)
    return torch.cat(parts)[:rows]


def escapes(ids: torch.Tensor, limit: int) -> float:
    """Mean escapes a row of delta coding needs: sorted ids' deltas (the first from 0) of ``limit`` or more."""
    ordered = ids.sort(dim=1).values
    deltas = torch.cat([ordered[:, :1], ordered[:, 1:] - ordered[:, :-1]], dim=1)
    return float((deltas >= limit).sum(dim=1).double().mean())


def encodings(vocab: int, k: int, ids: torch.Tensor | None) -> dict[str, float]:
    """Bytes per row of each encoding considered (``ids``: a realistic set, None for only the fixed-size ones)."""
    chosen = layout(k, vocab)
    sizes: dict[str, float] = {
        "int32+fp16 (today)": 6 * k,
        "packed ceil(log2 V)-bit ids + fp16 magnitude": math.ceil(k * (math.ceil(math.log2(vocab)) + LOGPROB_BITS) / 8),
        "elias-fano + fp16 magnitude (chosen)": chosen.row_bytes,
        "elias-fano + 12-bit residual": chosen.id_bytes + math.ceil(12 * k / 8) + 4,
        "elias-fano + 8-bit residual": chosen.id_bytes + k + 4,
        "ids' information log2 C(V,k) (bound, ids only)": (
            math.lgamma(vocab + 1) - math.lgamma(k + 1) - math.lgamma(vocab - k + 1)
        )
        / math.log(2)
        / 8,
    }
    if ids is not None:
        # An escape: the delta's field holds its largest value, the id follows in 4 bytes; a row index per row.
        sizes["uint16 delta + escapes + fp16"] = 4 * k + 4 * escapes(ids, 2**16 - 1) + 4
        sizes["17-bit delta | 15-bit magnitude (uint32) + escapes"] = 4 * k + 4 * escapes(ids, 2**17 - 1) + 4
    return sizes


def bytes_table(rows: int, generator: torch.Generator) -> None:
    for vocab in VOCABS:
        for k in KS:
            if vocab > 2**20:
                emit(table="bytes", vocab=vocab, k=k, ids="any", **_rounded(encodings(vocab, k, None)))
                continue
            for kind in ("uniform", "zipf"):
                ids = id_sets(kind, vocab, k, rows, generator)
                emit(table="bytes", vocab=vocab, k=k, ids=kind, **_rounded(encodings(vocab, k, ids)))


def _rounded(sizes: dict[str, float]) -> dict[str, float]:
    return {name: round(value, 1) for name, value in sizes.items()}


def best_seconds(work: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` timed runs of ``work`` (one untimed first)."""
    work()
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def speed(rows: int, device: torch.device, repeats: int, generator: torch.Generator) -> None:
    k = 64
    for vocab in VOCABS:
        ids = torch.rand(rows, k, generator=generator).mul(vocab).long().clamp(max=vocab - 1)  # repeats allowed
        logprobs = torch.log_softmax(3.0 * torch.randn(rows, k, generator=generator), dim=1)
        emit(table="speed", device=str(device), threads=torch.get_num_threads(), vocab=vocab, k=k, rows=rows,
             **timings(ids.to(device), logprobs.to(device), vocab, repeats))  # fmt: skip


def timings(ids: torch.Tensor, logprobs: torch.Tensor, vocab: int, repeats: int) -> dict[str, object]:
    """Encode, decode and today's read (widening int32 and float16) of the rows, in rows/s."""
    rows, k = ids.shape
    stored = encode(ids, logprobs, vocab)
    today = (ids.to(torch.int32), logprobs.to(torch.float16))
    encode_s = best_seconds(lambda: encode(ids, logprobs, vocab), ids.device, repeats)
    decode_s = best_seconds(lambda: decode(stored, k, vocab), ids.device, repeats)
    widen_s = best_seconds(lambda: (today[0].to(torch.int64), today[1].to(torch.float32)), ids.device, repeats)
    return {
        "encode_rows_per_s": round(rows / encode_s),
        "decode_rows_per_s": round(rows / decode_s),
        "today_read_rows_per_s": round(rows / widen_s),
    }


def reader_speed(rows: int, devices: list[torch.device], generator: torch.Generator) -> None:
    vocab, k, batch = 128256, 64, 8192
    ids = torch.rand(rows, vocab // 16, generator=generator).argsort(dim=1)[:, :k] * 16  # distinct ids
    logprobs = torch.log_softmax(3.0 * torch.randn(rows, 2 * k, generator=generator), dim=1)[:, :k]
    with tempfile.TemporaryDirectory() as root:
        for encoding in ("plain", "compact"):
            directory = os.path.join(root, encoding)
            settings = CacheSettings(vocab_size=vocab, k=k, teacher="bench", encoding=encoding)
            with TopKCacheWriter(directory, settings, rows_per_shard=65536) as writer:
                writer.append((ids, logprobs))
            for device in devices:
                reader = TopKCacheReader(directory)

                def read_all(reader: TopKCacheReader = reader, device: torch.device = device) -> None:
                    for begin in range(0, rows, batch):
                        reader.rows(begin, min(rows, begin + batch), device=device)

                start = time.perf_counter()
                read_all()  # the first pass verifies every shard's checksums
                first = time.perf_counter() - start
                seconds = best_seconds(read_all, device, 3)
                rates = {"first_pass_rows_per_s": round(rows / first), "rows_per_s": round(rows / seconds)}
                emit(table="reader", encoding=encoding, device=str(device), threads=torch.get_num_threads(), **rates)


Result = tuple[float, float, torch.Tensor, torch.Tensor]


def loss_and_grads(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, teacher: orda_tp.PrecomputedTeacher
) -> Result:
    """The loss ``student_ce + forward KL``, the KL, and the loss's gradients wrt ``hidden`` and ``weight``."""
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = orda_tp.distillation_loss(
        hidden, weight, labels, teacher, student_ce_weight=1.0, kl_weight=1.0, kl_divergence="forward", backend="torch"
    )
    out.loss.backward()
    assert hidden.grad is not None and weight.grad is not None
    return float(out.loss.detach()), float(out.kl), hidden.grad, weight.grad


def errors(result: Result, reference: Result) -> dict[str, float]:
    """The relative loss and KL errors and the larger norm-wise relative gradient error."""
    relative = [abs(got - want) / abs(want) for got, want in zip(result[:2], reference[:2])]
    grad_rel = max(float((got - want).norm() / want.norm()) for got, want in zip(result[2:], reference[2:]))
    return {"loss_rel": relative[0], "kl_rel": relative[1], "grad_rel": grad_rel}


def teacher(ids: torch.Tensor, logprobs: torch.Tensor) -> orda_tp.PrecomputedTeacher:
    """A top-k cache's rows as the loss's teacher, as ``TopKCacheReader.teacher`` makes it (temperature 1)."""
    return orda_tp.PrecomputedTeacher(topk_ids=ids, topk_logprobs=logprobs, tail="uniform", topk_temperature=1.0)


def residual(logprobs: torch.Tensor, bits: int, step: float) -> torch.Tensor:
    """``logprobs`` through a per-row-reference code: the row's largest value in float32, each value
    as ``max − q·step`` with ``q < 2^bits − 1`` (the top code: −inf), to nearest, or up (toward −inf)
    in the rows whose mass would round above 1."""
    reference = logprobs.max(dim=1, keepdim=True).values
    top = 2**bits - 1
    scaled = (reference - logprobs) / step

    def decoded(steps: torch.Tensor) -> torch.Tensor:
        return torch.where(scaled.isinf() | (steps >= top), float("-inf"), reference - steps * step)

    nearest = decoded(scaled.round())
    over = torch.exp(nearest.double()).sum(dim=1, keepdim=True) > 1
    return torch.where(over, decoded(scaled.ceil()), nearest)


#: The caches of the error table: name, stored dtype, encoding.
CACHES = (
    ("float32", torch.float32, "plain"),
    ("float16", torch.float16, "plain"),
    ("bfloat16", torch.bfloat16, "plain"),
    ("compact", torch.float16, "compact"),
)


def error_table(args: argparse.Namespace) -> None:
    generator = torch.Generator().manual_seed(0)
    rows, width, vocab = args.rows, args.hidden, args.vocab
    teacher_hidden = torch.randn(rows, width, generator=generator)
    teacher_weight = torch.randn(vocab, width, generator=generator) * (args.teacher_std / width**0.5)
    hidden = teacher_hidden + 0.5 * torch.randn(rows, width, generator=generator)  # a student near the teacher
    weight = teacher_weight / args.teacher_std * 2.0 + 0.1 * torch.randn(vocab, width, generator=generator) / width**0.5
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    for k in args.ks:
        topk = orda_tp.teacher_topk(teacher_hidden, teacher_weight, k, backend="torch")
        results: dict[str, Result] = {}
        with tempfile.TemporaryDirectory() as root:
            for name, dtype, encoding in CACHES:
                settings = CacheSettings(vocab_size=vocab, k=k, teacher="bench", logprob_dtype=dtype, encoding=encoding)
                directory = os.path.join(root, name)
                with TopKCacheWriter(directory, settings, rows_per_shard=65536) as writer:
                    writer.append(topk)
                results[name] = loss_and_grads(hidden, weight, labels, TopKCacheReader(directory).teacher(0, rows))
            size = sum(os.path.getsize(path) for path in glob.glob(os.path.join(root, "compact", "*")))
            ids, logprobs = TopKCacheReader(os.path.join(root, "compact")).rows(0, rows)
        # The float16 cache's pairs in the codec's order (by id): the same numbers, summed in the same order.
        order = topk.ids.sort(dim=1).indices
        fp16 = stored_logprobs(topk.logprobs, torch.float16).float()
        same = torch.equal(ids, topk.ids.gather(1, order)) and torch.equal(logprobs, fp16.gather(1, order))
        results["float16 by id"] = loss_and_grads(
            hidden, weight, labels, teacher(topk.ids.gather(1, order), fp16.gather(1, order))
        )
        for bits, step in ((12, 2.0**-7), (8, 2.0**-3)):
            coded = teacher(topk.ids, residual(topk.logprobs, bits, step))
            results[f"res{bits}"] = loss_and_grads(hidden, weight, labels, coded)
        mass = float(torch.exp(topk.logprobs.double()).sum(dim=1).mean())
        emit(table="error", k=k, topk_mass_mean=round(mass, 4), compact_values_equal_float16=same,
             compact_file_bytes_per_token=round(size / rows, 1),
             compact_row_bytes=layout(k, vocab).row_bytes)  # fmt: skip
        for name in ("float16", "compact", "float16 by id", "bfloat16", "res12", "res8"):
            measured = errors(results[name], results["float32"])
            emit(table="error", k=k, cache=name, **{key: float(f"{value:.3g}") for key, value in measured.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="where to time the codec (cpu, cuda)")
    parser.add_argument("--id-rows", type=int, default=256, help="rows of each realistic id set")
    parser.add_argument("--speed-rows", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads while timing")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--ks", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--teacher-std", type=float, default=3.0, help="std of the teacher's logits")
    parts = ["bytes", "speed", "reader", "error"]
    parser.add_argument("--only", choices=parts, nargs="+", default=parts)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    if "bytes" in args.only:
        bytes_table(args.id_rows, generator)
    if "speed" in args.only:
        threads = torch.get_num_threads()
        torch.set_num_threads(args.threads)
        devices = [torch.device("cpu")] + ([torch.device(args.device)] if args.device != "cpu" else [])
        for device in devices:
            speed(args.speed_rows, device, args.repeats, generator)
        torch.set_num_threads(threads)
    if "reader" in args.only:
        devices = [torch.device("cpu")] + ([torch.device(args.device)] if args.device != "cpu" else [])
        reader_speed(args.speed_rows, devices, generator)
    if "error" in args.only:
        error_table(args)


if __name__ == "__main__":
    main()
