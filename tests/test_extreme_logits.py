"""Logits near +1000 in one column block (or shard) and near −1000 in the others, and the reverse.

The merge of block records must rescale every partial log-partition to the largest maximum; with
ordinary logits a merge that took another maximum still passes (only test_merge.py would see it).
Here the spread is 2000, so any other choice overflows. The heads are built so that
``hidden · weightᵀ`` has these magnitudes (tests/support/extreme_logit_workers.py), for the student side
and for the teacher side, and the chunked torch backend with several column blocks per row chunk
(SMALL_CHUNKS: blocks of 64 over V = 203) is compared with the fp64 reference: values and every
gradient, all finite. On 2 gloo ranks the hot columns are one whole shard or one block inside a
shard, against the single-device call.
"""

from __future__ import annotations

import math

import pytest
import torch

from .support import extreme_logit_workers
from .support.cases import (
    COTRAINED,
    SMALL_CHUNKS,
    TEACHER_MODES,
    call_kwargs,
    loss_and_grads,
    make_problem,
    relative_error,
    separate_problem,
    stable_seed,
)
from .support.distributed import run_distributed
from .support.extreme_logit_workers import REDUCTIONS, SIDES, construction_problems, extreme_problem
from .support.tp_workers import SAMPLE_VARIANTS, Columns

TOLERANCE = 1e-10  # fp64, as tests/test_equivalence.py
# Blocks of SMALL_CHUNKS over V = 203: [0, 64), [64, 128), [128, 192), [192, 203).
HOT_BLOCKS = {"first": (0, 64), "middle": (64, 128), "last": (192, 203)}
# The reference's textbook dkd takes log(exp(log p_y)): where the student's label logit is near
# −1000, p_y underflows to 0 and the reference gives inf, while the chunked backends work from
# log p_y and stay finite. dkd is compared with it on the teacher side only.
BEYOND_THE_REFERENCE = {("dkd", "student")}


def reference_mismatches(label: str, variant: str, mode: str, side: str, hot: Columns, reduction: str) -> list[str]:
    """The chunked torch backend (fp64, SMALL_CHUNKS) against the fp64 reference on an extreme
    problem: loss, components and every gradient finite and within TOLERANCE."""
    base = make_problem(seed=stable_seed("extreme", variant, mode, side))
    if mode == "separate":
        base = separate_problem(base)
    problem = extreme_problem(base, side, hot)
    problems = construction_problems(label, problem, mode, side, hot)
    kwargs = call_kwargs(variant, mode, reduction)
    upstream = None
    if reduction == "none":
        upstream = torch.rand(base.labels.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    expected, expected_grads = loss_and_grads(problem, mode, upstream, backend="reference", **kwargs)
    actual, actual_grads = loss_and_grads(problem, mode, upstream, backend="torch", config=SMALL_CHUNKS, **kwargs)
    for field in ("loss", "student_ce", "teacher_ce", "kl"):
        value, want = getattr(actual, field), getattr(expected, field)
        error = relative_error(value, want)
        if not (torch.isfinite(value).all() and math.isfinite(error) and error <= TOLERANCE):
            problems.append(
                f"{label}: {field} relative error {error:.2e} (finite: {bool(torch.isfinite(value).all())})"
            )
    for index, (grad, want) in enumerate(zip(actual_grads, expected_grads)):
        if (grad is None) != (want is None):
            problems.append(f"{label}: gradient {index} is {grad is None}, the reference's {want is None}")
        elif grad is not None and want is not None:
            error = relative_error(grad, want)
            if not (torch.isfinite(grad).all() and math.isfinite(error) and error <= TOLERANCE):
                problems.append(f"{label}: gradient {index} relative error {error:.2e}")
    return problems


@pytest.mark.parametrize("hot", list(HOT_BLOCKS))
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("mode", TEACHER_MODES)
def test_extreme_block_logits_match_the_reference(mode: str, side: str, hot: str) -> None:
    """SAMPLE_VARIANTS (every kind of statistic), the reductions taken in turn, on one device."""
    problems: list[str] = []
    variants = [
        variant
        for variant in SAMPLE_VARIANTS
        if not (variant in COTRAINED and mode == "precomputed") and (variant, side) not in BEYOND_THE_REFERENCE
    ]
    for index, variant in enumerate(variants):
        reduction = REDUCTIONS[index % len(REDUCTIONS)]
        label = f"{variant}/{reduction}"
        problems += reference_mismatches(label, variant, mode, side, HOT_BLOCKS[hot], reduction)
    assert not problems, "\n".join(problems)


def test_extreme_shard_logits_on_two_gloo_ranks() -> None:
    """One whole shard hot, or one column block inside a shard, against the single-device call."""
    reports = run_distributed(2, extreme_logit_workers.extreme_worker, timeout=180)
    problems = [f"rank {rank}: {problem}" for rank, report in enumerate(reports) for problem in report]
    assert not problems, f"{len(problems)} mismatches:\n" + "\n".join(problems[:60])
