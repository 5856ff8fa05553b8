"""Worker bodies of tests/test_loss_terms.py's tensor-parallel cases (importable by spawned ranks).

Each case is one of tests/support/tp_workers.py's: the call on this rank's vocabulary shard against the
single-device call on the full tensors (loss, components and gradients; bitwise equal on every
rank), with the loss terms switched on.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from .cases import TEACHER_MODES
from .tp_workers import (
    REDUCTIONS,
    Case,
    chunk_ranges,
    padded_case,
    plain_case,
    run_case,
    upstream_for,
)

TERMS = {"label_smoothing": 0.15, "z_loss_weight": 0.05}


def _cases(rank: int, world: int) -> Iterator[tuple[Case, torch.Tensor | None]]:
    columns = chunk_ranges(203, world)[rank]
    padded = chunk_ranges(208, world)[rank]
    for index, mode in enumerate(TEACHER_MODES):
        for dtype in (torch.float64, torch.float32):
            reduction = REDUCTIONS[index]
            label = f"terms {mode}/{reduction}/{str(dtype)[6:]}"
            case = plain_case(label, "forward", mode, reduction, dtype, columns)
            yield case, upstream_for(reduction, 24, dtype)
            label = f"terms padded 208→150 {mode}/{reduction}/{str(dtype)[6:]}"
            case = padded_case(label, "reverse", mode, reduction, dtype, padded, total=208, vocab_size=150)
            yield case, upstream_for(reduction, 24, dtype)
    # The Triton kernels (interpreted on the CPU) on shards, fp32.
    case = plain_case("terms triton", "skew_js", "tied", "mean", torch.float32, columns)
    case.kwargs["backend"] = "triton"
    yield case, None


def terms_worker(rank: int, world: int) -> list[str]:
    """Label smoothing, z-loss, token weights and soft-caps (alone, together, with and without the
    KL) on vocabulary shards, uneven and padded, every teacher mode and reduction, fp64 and fp32."""
    problems: list[str] = []
    weights = torch.rand(24, dtype=torch.float64, generator=torch.Generator().manual_seed(9)) * 2 - 0.5
    variations: list[dict[str, object]] = [
        {**TERMS, "token_weights": weights},
        {"label_smoothing": TERMS["label_smoothing"], "kl_weight": 0.0},
        {"z_loss_weight": TERMS["z_loss_weight"], "student_ce_weight": 0.0, "token_weights": weights},
    ]
    for case, upstream in _cases(rank, world):
        base, label = dict(case.kwargs), case.label
        caps = {"logit_softcap": 4.0, **({"teacher_logit_softcap": 3.0} if case.mode != "precomputed" else {})}
        for extra in [*variations, caps] if base.get("backend") != "triton" else [{**variations[0], **caps}]:
            case.kwargs, case.label = {**base, **extra}, f"{label} + {extra}"
            problems += run_case(case, dist.group.WORLD, upstream)
    return problems
