"""Logits near ±1000 whose maximum lies in one column block (or one shard): problems and the gloo worker.

The records of column blocks and shards merge their partial log-partitions ``(m, z)`` by
rescaling every ``z`` to the largest ``m`` (orda_tp/engine/records.py). With ordinary logits a merge
that picked another ``m`` still gives finite, nearly right values; with one block near +1000 and
the others near −1000 (spread 2000, and 1000 after dividing by a temperature of 2) any other
choice overflows ``e^{m − M}`` in fp64. :func:`extreme_problem` builds such heads for the student
or the teacher side; tests/test_extreme_logits.py compares them with the fp64 reference on one
device and :func:`extreme_worker` with the single-device call on vocabulary shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .cases import COTRAINED, TEACHER_MODES, Columns, Problem, shard_problem, stable_seed
from .tp_workers import (
    ROWS,
    SAMPLE_VARIANTS,
    VOCAB,
    Case,
    call_kwargs,
    chunk_ranges,
    full_problem,
    run_case,
    upstream_for,
)

MAGNITUDE = 1000.0
SIDES = ("student", "teacher")
REDUCTIONS = ("sum", "mean", "none")


def row_signs(rows: int) -> Tensor:
    """(rows, 1): +1 on even rows (the hot block near +1000), −1 on odd rows (the reverse)."""
    return torch.where(torch.arange(rows) % 2 == 0, 1.0, -1.0).to(torch.float64)[:, None]


def _widened(tensor: Tensor, column: Tensor) -> Tensor:
    """``tensor`` with ``column`` appended as its last feature (a fresh leaf, same grad requirement)."""
    wide = torch.cat([tensor.detach(), column.to(tensor.dtype)], dim=1)
    return wide.requires_grad_(tensor.requires_grad)


def extreme_problem(problem: Problem, side: str, hot: Columns) -> Problem:
    """``problem`` (fp64) with ``side``'s logits shifted by ±MAGNITUDE: the hot columns up and the
    others down on even rows, the reverse on odd rows; the other side's logits unchanged.

    One feature is appended to every hidden state and head: the heads' new column is +1 on the
    ``hot`` columns and −1 elsewhere, the hidden states' new feature is ±MAGNITUDE on ``side`` and 0
    on the other side, so ``hidden · weightᵀ`` itself has these magnitudes (a precomputed teacher
    gets the same shift added to its logits). Two valid rows get a label in the hot block (one at
    +1000, one at −1000)."""
    rows, vocab = problem.labels.shape[0], problem.weight.shape[0]
    pattern = torch.full((vocab, 1), -1.0, dtype=torch.float64)
    pattern[hot[0] : hot[1]] = 1.0
    shift = MAGNITUDE * row_signs(rows)
    student, teacher = (shift, torch.zeros_like(shift)) if side == "student" else (torch.zeros_like(shift), shift)
    labels = problem.labels.clone()
    labels[1], labels[2] = hot[0], hot[1] - 1  # rows 0, 5, ... are ignored
    return Problem(
        student_hidden=_widened(problem.student_hidden, student),
        weight=_widened(problem.weight, pattern),
        labels=labels,
        teacher_hidden=_widened(problem.teacher_hidden, teacher),
        teacher_weight=_widened(problem.teacher_weight, pattern),
        teacher_logits=problem.teacher_logits + (teacher * pattern.T).to(problem.teacher_logits.dtype),
    )


def side_logits(problem: Problem, mode: str, side: str) -> Tensor:
    """The full (rows, V) logits of ``side`` under teacher ``mode``."""
    if side == "student":
        return problem.student_hidden @ problem.weight.T
    if mode == "precomputed":
        return problem.teacher_logits
    head = problem.weight if mode == "tied" else problem.teacher_weight
    return problem.teacher_hidden @ head.T


def construction_problems(label: str, problem: Problem, mode: str, side: str, hot: Columns) -> list[str]:
    """A problem unless ``side``'s logits really are above 900 on the hot columns and below −900
    elsewhere on even rows (the reverse on odd rows)."""
    logits = side_logits(problem, mode, side).detach() * row_signs(problem.labels.shape[0])
    inside, outside = logits[:, hot[0] : hot[1]], torch.cat([logits[:, : hot[0]], logits[:, hot[1] :]], dim=1)
    if inside.min() > 900 and outside.max() < -900:
        return []
    return [f"{label}: the {side} logits are not near ±{MAGNITUDE:g} as built"]


def extreme_case(
    label: str, variant: str, mode: str, reduction: str, side: str, hot: Columns, columns: Columns
) -> Case:
    """A tensor-parallel call on this rank's ``columns`` of an extreme problem, against the
    single-device call on the full one (torch backend, fp64, several column blocks per shard)."""
    base = full_problem(mode, torch.float64, stable_seed("extreme", variant, mode, side))
    full = extreme_problem(base, side, hot)
    return Case(
        label=label,
        mode=mode,
        kwargs=call_kwargs(variant, mode, reduction),
        full=full,
        local=shard_problem(full, columns),
        columns=columns,
        tp_kwargs={"tp_group": dist.group.WORLD},
    )


def extreme_worker(rank: int, world: int) -> list[str]:
    """SAMPLE_VARIANTS × teacher modes × sides, the reductions taken in turn, with the hot columns
    one whole shard or one column block inside a shard (of TP_CHUNKS' 64 columns)."""
    assert world == 2
    columns = chunk_ranges(VOCAB, world)[rank]
    hot_columns = {"shard 1": chunk_ranges(VOCAB, world)[1], "block [64, 102) of shard 0": (64, 102)}
    pairs = [(v, m) for v in SAMPLE_VARIANTS for m in TEACHER_MODES if not (v in COTRAINED and m == "precomputed")]
    problems: list[str] = []
    for index, (variant, mode) in enumerate(pairs):
        reduction = REDUCTIONS[index % len(REDUCTIONS)]
        upstream = upstream_for(reduction, ROWS, torch.float64)
        for side in SIDES:
            for where, hot in hot_columns.items():
                label = f"{variant}/{mode}/{reduction} {side} hot={where}"
                case = extreme_case(label, variant, mode, reduction, side, hot, columns)
                problems += construction_problems(label, case.full, mode, side, hot)
                problems += run_case(case, dist.group.WORLD, upstream)
    return problems
