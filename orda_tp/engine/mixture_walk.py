"""A :class:`orda_tp.TeacherMixture` chunk whose rows mix teachers (the "mixed" and "views" forms;
the "linear" form is one teacher's walk): the student and every teacher in one round 1 (each
teacher's ``(m, z, v[y])`` are families and a label column of the same packed record: one
exchange), then the one-teacher steps per *view*, the views' round 2 in one exchange.

- "mixed" (``combine="probabilities"``): one view, the block ``log q̄ = logsumexp_i(c_i + v_i)``
  with ``c_i = log w̃_i − LSE_i`` over the teachers present on the row, formed from the chunk's tiles
  once round 1 has given every ``LSE_i`` (exact under tensor parallelism: the LSEs are global).
- "views" (``combine="divergences"``): a view per teacher; the row's KL is ``Σ_i w_i·KL_i``, and
  each view's logit gradient is weighted by ``w_i`` through its ``keep`` and added to the others'.

A chunk's statistics are recomputed by a deferred backward (reduction "none"), rounds and all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from ..arguments.plan import LogitFamily, LossPlan
from ..divergences.terms import STUDENT_TERMS
from .call import Call
from .logits import LogitsBlock
from .mixture_blocks import MixtureBlocks
from .records import empty_record
from .row_formulas import partition_step
from .row_walk import ChunkTarget, RowRange, kl_round, stage_grads
from .stats import RowStats

__all__ = ["mixture_row_stats"]

_TILE_FAMILY = (LogitFamily("student", 1.0),)  # a teacher's tile, pre-tempered, read as a side of its own


def mixture_row_stats(
    call: Call[LossPlan],
    blocks: Sequence[LogitsBlock],
    labels: Tensor,
    like: Tensor,
    target: ChunkTarget | None,
    rows: RowRange,
) -> RowStats:
    """The chunk's statistics (``walk_rows``' ``steps``) of batch rows ``rows``, and with ``target``
    its logit gradients; each block's ``teacher`` holds the teachers' (n, rows, columns) tiles."""
    plan, mixture = call.plan, call.teacher_blocks
    assert isinstance(mixture, MixtureBlocks) and plan.mixture is not None and plan.computes_kl
    members = len(plan.mixture.members)
    record = _round_one(call, blocks, labels, like, members)
    student_families = len(plan.families) - 1
    families = student_families + members
    # The merged record: [m (student families, teachers) | z (same) | s_y t_y hits sums | v_i[y] per teacher].
    m, z = record[:, :families], record[:, families : 2 * families]
    rest, label_logits = record[:, 2 * families : -members], record[:, -members:]
    student = (m[:, :student_families], z[:, :student_families], rest)
    teachers = m[:, student_families:], z[:, student_families:], label_logits
    weights = mixture.weights(rows[0], rows[1], like.dtype)
    tiles = [b.teacher for b in blocks]
    if plan.mixture.form == "mixed":
        shifts, columns = _mixed_columns(*teachers, weights)
        mixed = [_mixed_block(tile, shifts) for tile in tiles]  # type: ignore[arg-type]
        views = [_View(plan, columns, None, [replace(b, teacher=t) for b, t in zip(blocks, mixed)])]
    else:
        kl_only = replace(plan, student_terms=(), term_weights=(), student_entropy=False)
        views = [
            _View(
                plan if i == 0 else kl_only,
                (teachers[0][:, i], teachers[1][:, i], teachers[2][:, i]),
                weights[:, i],
                [replace(b, teacher=t[i]) for b, t in zip(blocks, tiles)],  # type: ignore[index]
            )
            for i in range(members)
        ]
    return _walk_views(call, views, student, labels, like, target)


class _View:
    """One one-teacher view of the chunk: its plan, its teacher's round-1 columns ``(m, z, t_y)``,
    its weight per row (None: 1) and its blocks; the partition step's results once computed."""

    def __init__(self, plan: LossPlan, teacher: tuple[Tensor, ...], weight: Tensor | None, blocks: list[LogitsBlock]):
        self.plan, self.teacher, self.weight, self.blocks = plan, teacher, weight, blocks
        self.statistics: dict[str, Tensor] = {}
        self.partition = torch.empty(0)

    def weighted(self, keep: Tensor) -> Tensor:
        """``keep·w``: the view's KL gradient scaled by its weight (0 where the weight is 0)."""
        return keep if self.weight is None else keep * self.weight


def _round_one(call: Call[LossPlan], blocks: Sequence[LogitsBlock], labels: Tensor, like: Tensor, n: int) -> Tensor:
    """The chunk's merged round-1 record over every shard: the student's families (the plan's but
    the teacher's last one) and each teacher's ``(m, z)`` as a family, each teacher's label logit
    as an extra summed column; every side read once."""
    plan, math_ = call.plan, call.math
    assert math_ is not None
    student_families = plan.families[:-1]  # the teacher's family (t, 1) is the plan's last: teacher CE is refused
    count, caps = len(student_families), (plan.student_softcap, None)
    records = []
    for b in blocks:
        start = call.layout.vocab_start + b.start
        own = math_.partition(b.student, None, labels, start, student_families, plan.column_sums, caps)
        assert isinstance(b.teacher, Tensor)  # the teachers' stacked tiles, formed dense
        parts = [math_.partition(tile, None, labels, start, _TILE_FAMILY, (), (None, None)) for tile in b.teacher]
        m = [own[:, :count], *(part[:, 0:1] for part in parts)]
        z = [own[:, count : 2 * count], *(part[:, 1:2] for part in parts)]
        records.append(torch.cat([*m, *z, own[:, 2 * count :], *(part[:, 2:3] for part in parts)], dim=1))
    families = count + n
    if not records:  # this device holds only vocabulary padding
        records = [empty_record(labels.shape[0], families, len(plan.column_sums) + n, like)]
    record = records[0] if len(records) == 1 else math_.merge_stacked(torch.stack(records), families)
    if call.exchange is not None:
        # One all-gather for the student and every teacher: the teachers' columns are families like the student's.
        record = call.exchange.merge_partitions(record, families, math_.merge_stacked)
    return record


def _mixed_columns(m: Tensor, z: Tensor, label_logits: Tensor, weights: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
    """The shifts ``c_i`` (rows, n) of ``log q̄`` and its round-1 columns ``(m, z, t_y)``: ``m = 0``,
    ``z = 1`` (``log q̄`` is normalized) on a row with a teacher present, ``(−inf, 0)`` without one."""
    lse = m + z.log()  # an absent teacher's (−inf, 0) gives −inf
    present = (weights > 0) & (m > -math.inf)
    total = torch.where(present, weights, 0.0).sum(1, keepdim=True)
    # The weights renormalized over the teachers present: an absent one is left out, as a cache row of −inf.
    shifts = torch.where(present, weights.log() - lse - total.log(), -math.inf)
    has_teacher = present.any(1)
    columns = (
        torch.where(has_teacher, 0.0, -math.inf).to(m.dtype),
        has_teacher.to(m.dtype),
        torch.logsumexp(shifts + label_logits, 1),
    )
    return shifts, columns


def _mixed_block(tiles: Tensor, shifts: Tensor) -> Tensor:
    """``logsumexp_i(c_i + v_i)`` of a block's (n, rows, columns) tiles, one teacher at a time."""
    mixed = tiles[0] + shifts[:, 0, None]
    for index in range(1, tiles.shape[0]):
        mixed = torch.logaddexp(mixed, tiles[index] + shifts[:, index, None])
    return mixed


def _walk_views(
    call: Call[LossPlan],
    views: list[_View],
    student: tuple[Tensor, Tensor, Tensor],
    labels: Tensor,
    like: Tensor,
    target: ChunkTarget | None,
) -> RowStats:
    """Each view's partition step, round 2 (one exchange for all), finish step and logit gradients."""
    plan, math_ = call.plan, call.math
    assert math_ is not None
    for view in views:
        _partition(call, view, student, like)
    in_gradient_pass = target is not None and plan.kl_sums_in_gradient_pass
    local_sums = []
    for index, view in enumerate(views):
        width = len(view.plan.round_two_terms)
        if in_gradient_pass:
            assert target is not None
            sums = like.new_full((labels.shape[0], width), -0.0)  # −0.0: the first block's sums added exactly
            keep = view.weighted(view.statistics["present"])
            _stage(call, view, labels, {**view.statistics, "keep": keep}, target, index, like, sums)
        else:
            vocab_start, lse_u, lse_v = call.layout.vocab_start, view.statistics["lse_u"], view.statistics["lse_v"]
            sums = like.new_zeros(labels.shape[0], width)
            for b in view.blocks:  # block after block, in column order: the same bits every run
                sums = sums + math_.kl_sums(
                    view.plan, b.student, b.teacher, labels, vocab_start + b.start, lse_u, lse_v
                )
        local_sums.append(sums)
    summed = torch.cat(local_sums, dim=1)
    if call.exchange is not None:
        summed = call.exchange.sum_over_shards(summed)  # every view's sums in one collective
    alone = replace(call, exchange=None)  # the views' rounds are summed: each finishes on its own
    kl = like.new_zeros(labels.shape[0])
    results = []
    for view, sums in zip(views, summed.split([s.shape[1] for s in local_sums], dim=1)):
        view_kl, kl_stats, entropy = kl_round(replace(alone, plan=view.plan), [], labels, view.statistics, like, sums)
        assert kl_stats is not None
        # A teacher of weight 0 on a row adds 0 (never 0·inf).
        kl = kl + (view_kl if view.weight is None else torch.where(view.weight > 0, view.weight * view_kl, 0.0))
        view.statistics.update(keep=view.weighted(kl_stats.keep), **kl_stats.consts)
        results.append((kl_stats, entropy))
    if target is not None and not in_gradient_pass:
        for index, view in enumerate(views):
            _stage(call, view, labels, view.statistics, target, index, like)
    first, outputs = views[0], views[0].statistics
    return RowStats(
        log_partitions=first.partition[:, : first.plan.step_key.num_families],
        owned=outputs["owned"],
        absent=outputs.get("absent"),
        student_terms={term.name: outputs[term.name] for term in STUDENT_TERMS},
        teacher_ce=outputs["teacher_ce"],
        kl=kl,
        student_entropy=results[0][1],
        kl_stats=results[0][0] if len(views) == 1 else None,
    )


def _partition(call: Call[LossPlan], view: _View, student: tuple[Tensor, Tensor, Tensor], like: Tensor) -> None:
    """The view's partition step from the merged record: its plan's families read from the student's
    columns and its teacher's, as a one-teacher record would hold them."""
    plan, math_ = view.plan, call.math
    assert math_ is not None
    m_s, z_s, rest = student
    chosen = [call.plan.families.index(family) for family in plan.families[:-1]]
    m, z, label_logit = view.teacher
    sums = rest[:, 3 : 3 + len(plan.column_sums)]  # a KL-only view has no student term: no column sums
    columns = [m_s[:, chosen], m[:, None], z_s[:, chosen], z[:, None], rest[:, :1], label_logit[:, None], rest[:, 2:3]]
    record = torch.cat([*columns, sums], dim=1)
    step = partition_step(plan.step_key)
    inputs = dict(zip(step.inputs, record.unbind(1)))  # the step reads the record's columns by name
    scalars = {"t_s": plan.student_temperature, "t_t": plan.teacher_temperature, **plan.term_scalars}
    view.partition = math_.rows(step, inputs, scalars, like)
    outputs = dict(zip(step.outputs, view.partition.unbind(1)))
    lse = {f"lse{f}": view.partition[:, f] for f in range(plan.step_key.num_families)}
    view.statistics = {**lse, **outputs}


def _stage(
    call: Call[LossPlan],
    view: _View,
    labels: Tensor,
    statistics: dict[str, Tensor],
    target: ChunkTarget,
    index: int,
    like: Tensor,
    sums_out: Tensor | None = None,
) -> None:
    """The view's logit gradients: the first view's written into the target, each later one's added
    to it (the teachers are frozen: only the student's side)."""
    assert target[0].grads.teacher is None
    stage_grads(replace(call, plan=view.plan), view.blocks, labels, statistics, target, like, sums_out, index > 0)
