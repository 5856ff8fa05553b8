"""Which log-probability dtype a top-k cache (:mod:`orda_tp.topk_cache`) may store: accuracy and size.

On the CPU (``python benchmarks/topk_cache_dtype.py``; about a minute on two cores): a teacher of
logits std ``--teacher-std`` over V = 32000 is extracted (:func:`orda_tp.teacher_topk`, fp32) for
k = 16, 64, 128, written through :class:`~orda_tp.topk_cache.TopKCacheWriter` with float32,
float16 and bfloat16 log-probabilities and read back; the loss ``student_ce + forward KL``
(``tail="uniform"``) and its gradients with respect to the student's hidden states and head are
compared with those of the float32 cache:

- ``loss_rel``: ``|L − L₃₂| / |L₃₂|`` (``kl_rel``: the same of the KL term alone);
  ``grad_rel``: the larger of ``‖g − g₃₂‖ / ‖g₃₂‖`` over the two gradients.
- ``bf16_input_floor``: the same errors of the float32 cache's loss when the student's hidden
  states and head are rounded to bfloat16 first: the error a bf16 training step carries anyway.
- ``bytes_per_token``: the written files' sizes over the rows, float16 log-probabilities and int32 ids.

Prints one JSON line per result.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

import orda_tp
from orda_tp.topk_cache import CacheSettings, TopKCacheReader, TopKCacheWriter

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


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


def cached(topk: orda_tp.TeacherTopK, settings: CacheSettings, directory: str) -> tuple[TopKCacheReader, int]:
    """``topk`` written to ``directory`` and read back, with the bytes the files take."""
    with TopKCacheWriter(directory, settings, rows_per_shard=65536) as writer:
        writer.append(topk)
    size = sum(os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory))
    return TopKCacheReader(directory), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--ks", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--teacher-std", type=float, default=3.0, help="std of the teacher's logits")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    rows, width, vocab = args.rows, args.hidden, args.vocab
    teacher_hidden = torch.randn(rows, width, generator=generator)
    teacher_weight = torch.randn(vocab, width, generator=generator) * (args.teacher_std / width**0.5)
    hidden = teacher_hidden + 0.5 * torch.randn(rows, width, generator=generator)  # a student near the teacher
    weight = teacher_weight / args.teacher_std * 2.0 + 0.1 * torch.randn(vocab, width, generator=generator) / width**0.5
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    for k in args.ks:
        topk = orda_tp.teacher_topk(teacher_hidden, teacher_weight, k, backend="torch")
        mass = float(torch.exp(topk.logprobs.double()).sum(dim=1).mean())
        emit(k=k, topk_mass_mean=round(mass, 4), teacher_logit_std=args.teacher_std)
        results = {}
        with tempfile.TemporaryDirectory() as root:
            for name, dtype in DTYPES.items():
                settings = CacheSettings(vocab_size=vocab, k=k, teacher="bench", logprob_dtype=dtype)
                reader, size = cached(topk, settings, os.path.join(root, name))
                results[name] = loss_and_grads(hidden, weight, labels, reader.teacher(0, rows, tail="uniform"))
                if name == "float16":
                    emit(k=k, bytes_per_token=size / rows, payload_bytes_per_token=k * (4 + 2), file_bytes=size)
        reference = results["float32"]
        for name in ("float16", "bfloat16"):
            emit(
                k=k, logprob_dtype=name, **errors(results[name], reference), loss=results[name][0], kl=results[name][1]
            )
        fp32_teacher = topk.teacher("uniform")
        rounded = loss_and_grads(hidden.bfloat16().float(), weight.bfloat16().float(), labels, fp32_teacher)
        emit(k=k, bf16_input_floor=True, **errors(rounded, reference), loss=reference[0], kl=reference[1])


if __name__ == "__main__":
    main()
