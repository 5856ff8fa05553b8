"""Top-k caches for the tests: the k most likely ids of a teacher and the dense teacher a cache
stands for, written from the definitions (docs/guide.md §15), independently of orda_tp's code."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def topk_of(
    logits: Tensor, k: int, vocab_size: int | None = None, dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """``(ids, log-probabilities)`` of each row's ``k`` most likely columns of ``softmax(logits)``
    over the real vocabulary (the first ``vocab_size`` columns), computed in fp64 and stored in
    ``dtype`` (the logits' when None)."""
    real = logits if vocab_size is None else logits[:, :vocab_size]
    top = torch.log_softmax(real.double(), dim=-1).topk(k, dim=-1)
    return top.indices, top.values.to(logits.dtype if dtype is None else dtype)


def dense_teacher(ids: Tensor, logprobs: Tensor, tail: str, vocab: int, vocab_size: int | None = None) -> Tensor:
    """(rows, vocab) fp64 teacher logits: the cached log-probabilities at their ids; elsewhere in
    the real vocabulary ``log((1 − Σ p) / (V − k))`` (uniform) or −inf (renormalize); a large
    finite value on padding columns (which the loss must not read)."""
    real = vocab if vocab_size is None else vocab_size
    rows, k = ids.shape
    values = logprobs.double()
    dense = torch.full((rows, vocab), 30.0, dtype=torch.float64)
    for row in range(rows):
        mass = sum(math.exp(v) for v in values[row].tolist())
        tail_value = -math.inf
        if tail == "uniform" and mass < 1:
            tail_value = math.log(1.0 - mass) - math.log(real - k)
        dense[row, :real] = tail_value
        for column, value in zip(ids[row].tolist(), values[row].tolist()):
            dense[row, column] = value
    return dense
