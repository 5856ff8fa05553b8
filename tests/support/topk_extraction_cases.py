"""The oracle of tests/test_topk_extraction.py and its tensor-parallel workers: a teacher's top-k
log-probabilities from its full logits in fp64, ties broken by the lowest id."""

from __future__ import annotations

import torch

from orda_tp import TeacherTopK


def oracle_topk(
    logits: torch.Tensor,
    k: int,
    *,
    temperature: float = 1.0,
    logit_softcap: float | None = None,
    vocab_size: int | None = None,
) -> TeacherTopK:
    """``log_softmax(cap(z)/T)`` over the first ``vocab_size`` columns of ``logits`` in fp64, its
    ``k`` largest values by value, largest first, equal values by id, lowest first."""
    z = logits.double()[:, : vocab_size or logits.shape[1]]
    if logit_softcap is not None:
        z = logit_softcap * torch.tanh(z / logit_softcap)
    scaled = z / temperature
    log_partition = torch.logsumexp(scaled, dim=-1)
    values, ids = torch.sort(scaled - log_partition[:, None], dim=-1, descending=True, stable=True)
    return TeacherTopK(ids[:, :k], values[:, :k], log_partition)


def topk_problems(label: str, got: TeacherTopK, want: TeacherTopK, tolerance: float) -> list[str]:
    """What differs between an extraction and the oracle: any id, or a value or log-partition by
    more than ``tolerance`` (absolute)."""
    problems = []
    if got.ids.shape != want.ids.shape or not torch.equal(got.ids.cpu(), want.ids.cpu()):
        rows = (
            (got.ids.cpu() != want.ids.cpu()).any(-1).nonzero().flatten().tolist()
            if got.ids.shape == want.ids.shape
            else []
        )
        problems.append(
            f"{label}: ids differ (shape {tuple(got.ids.shape)} vs {tuple(want.ids.shape)}, rows {rows[:5]})"
        )
    for name in ("logprobs", "log_partition"):
        a, b = getattr(got, name).double().cpu(), getattr(want, name).double().cpu()
        error = float((a - b).abs().max()) if a.shape == b.shape and a.numel() else 0.0
        if a.shape != b.shape or error > tolerance:
            problems.append(f"{label}: {name} differ by {error:.2e} (tolerance {tolerance:.0e})")
    return problems
