"""A :class:`orda_tp.TeacherMixture`'s logits as one teacher's blocks (:class:`MixtureBlocks`), and
each teacher's own (the reference's): ``v_i = cap_i(scale_i·(h_i·W_iᵀ + b_i))/T_i`` (a cache's
values ``/T_i``), each teacher's GEMM only over the rows that weigh on it.

The "linear" form's block is ``Σ_i w_ri·v_i`` over the teachers with ``w_ri > 0`` (``−inf`` on a
row without one: no teacher, KL 0); read at temperature 1 it is the product of experts, or the row's
one routed teacher. The "mixed" and "views" forms' blocks are the teachers' tiles, stacked
(n, rows, columns): ``engine.mixture_walk`` reads them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from ..arguments.mixture import MemberPlan, MixturePlan
from ..parallel.collectives import gather_sequence_rows
from ..parallel.layout import VocabLayout
from ..teachers import TeacherSource
from ..teachers.mixture import MixtureRouting, TeacherMixture
from ..teachers.source import TeacherBlocks
from .logits import HeadLogits, HeadTensors, StoredLogits, addmm_fp32_into

__all__ = ["MixtureBlocks", "mixture_blocks"]


class Scattered(NamedTuple):
    """A teacher's rows of a chunk that are not one run: chunk-local indices ``local`` on the device,
    the first and last of them as host numbers."""

    local: Tensor
    first: int
    last: int


Rows = slice | Scattered  # a chunk's rows a teacher reads


@dataclass(frozen=True)
class _Member:
    """One teacher's logits source, its plan and the rows where it has weight (sorted, on the host
    and, copied once per call, on the device)."""

    source: TeacherBlocks  # a head's product, stored logits, or a top-k cache's blocks
    plan: MemberPlan
    rows: Tensor | None  # None: every row
    device_rows: Tensor | None

    def chunk_rows(self, begin: int, end: int) -> Rows | None:
        """Its rows within ``[begin, end)``, chunk-local: a slice where they are one run; None: none."""
        if self.rows is None or self.device_rows is None:
            return slice(0, end - begin)
        lo, hi = (int(i) for i in torch.searchsorted(self.rows, torch.tensor([begin, end])))
        if lo == hi:
            return None
        first, last = int(self.rows[lo]), int(self.rows[hi - 1])
        if last - first + 1 == hi - lo:  # one run: read in place, no gather
            return slice(first - begin, last + 1 - begin)
        # A slice of the call's device copy: no host-to-device copy per chunk.
        return Scattered(self.device_rows[lo:hi] - begin, first - begin, last - begin)

    def logits(self, begin: int, rows: Rows, start: int, stop: int, dtype: torch.dtype) -> Tensor:
        """``v`` on ``rows`` of the chunk starting at ``begin``, local columns ``[start, stop)``."""
        source = self.source
        if isinstance(rows, slice):
            block = source.block(begin + rows.start, begin + rows.stop, start, stop, dtype, False)
        elif isinstance(source, HeadLogits):  # a GEMM over the gathered rows only
            gathered = HeadLogits(source.hidden.detach()[rows.local + begin], *_head_rest(source))
            block = gathered.block(0, rows.local.numel(), start, stop, dtype, False)
        elif isinstance(source, StoredLogits):  # only these rows' block is copied
            block = source.logits.detach()[:, start:stop][rows.local + begin].to(dtype)
        else:  # a top-k cache's dense block over the rows' span, then its rows
            span = source.block(begin + rows.first, begin + rows.last + 1, start, stop, dtype, False)
            assert isinstance(span, Tensor)  # formed dense (not as stored)
            block = span[rows.local - rows.first]
        assert isinstance(block, Tensor)  # formed dense (not as stored)
        return block if self.plan.temperature == 1.0 else block / self.plan.temperature

    def added_into(
        self, out: Tensor, begin: int, rows: slice, start: int, stop: int, weight: float, accumulate: bool
    ) -> bool:
        """``out[rows] (+)= weight·v`` by the GEMM's epilogue (a head without cap or bias, bf16/fp16 on
        CUDA into fp32: no product tensor); False, nothing written, where it cannot."""
        source = self.source
        if not isinstance(source, HeadLogits) or source.cap is not None or source.bias is not None:
            return False
        hidden = source.hidden.detach()[begin + rows.start : begin + rows.stop]
        alpha = weight * source.scale / self.plan.temperature
        beta = 1.0 if accumulate else 0.0
        return addmm_fp32_into(out[rows], hidden, source.weight.detach()[start:stop].T, beta, alpha)


def _head_rest(source: HeadLogits) -> tuple[Tensor, float | None, Tensor | None, float]:
    return source.weight, source.cap, source.bias, source.scale


class MixtureBlocks:
    """The blocks of a mixture read as one teacher (a ``TeacherBlocks``), and its teachers' own."""

    def __init__(
        self, plan: MixturePlan, routing: MixtureRouting, members: list[_Member], device: torch.device, columns: int
    ):
        self.plan, self.routing, self.members, self.device, self.columns = plan, routing, members, device, columns
        self._scalar_rows: dict[torch.dtype, Tensor] = {}  # n numbers as a device row, per dtype

    def weights(self, begin: int, end: int, dtype: torch.dtype) -> Tensor:
        """(rows, n) weights of rows ``[begin, end)`` (n numbers broadcast)."""
        if self.routing.weights is not None:
            return self.routing.weights[begin:end].to(dtype)
        scalars = self.routing.scalars
        assert scalars is not None
        if dtype not in self._scalar_rows:
            row = torch.empty(len(scalars), dtype=dtype, device=self.device)
            for index, value in enumerate(scalars):
                row[index].fill_(value)  # a fill, not a copy from the host: no synchronization
            self._scalar_rows[dtype] = row
        return self._scalar_rows[dtype].expand(end - begin, -1)

    def member_tiles(self, begin: int, end: int, start: int, stop: int, dtype: torch.dtype) -> Tensor:
        """(n, rows, columns): each teacher's ``v_i`` on rows ``[begin, end)``, −inf on its rows
        without weight, each written once into its tile (by its GEMM where it can)."""
        tiles = torch.empty(len(self.members), end - begin, stop - start, dtype=dtype, device=self.device)
        for tile, member in zip(tiles, self.members):
            rows = member.chunk_rows(begin, end)
            if rows != slice(0, end - begin):
                tile.fill_(-math.inf)  # the rows where the teacher has no weight: no teacher there
            if rows is None:
                continue
            if isinstance(rows, Scattered):
                tile.index_copy_(0, rows.local, member.logits(begin, rows, start, stop, dtype))
            elif not member.added_into(tile, begin, rows, start, stop, 1.0, accumulate=False):
                tile[rows] = member.logits(begin, rows, start, stop, dtype)
        return tiles

    def block(self, begin: int, end: int, start: int, stop: int, dtype: torch.dtype, as_stored: bool) -> Tensor:
        if self.plan.form != "linear":  # (n, rows, columns): each teacher's tile (engine.mixture_walk reads them)
            return self.member_tiles(begin, end, start, stop, dtype)
        out = torch.zeros(end - begin, stop - start, dtype=dtype, device=self.device)
        weights = self.weights(begin, end, dtype)
        for index, member in enumerate(self.members):
            rows = member.chunk_rows(begin, end)
            scalar = None if self.routing.scalars is None else self.routing.scalars[index]
            if rows is None or scalar == 0.0:
                continue
            # One weight for the whole run (n numbers, or routed rows of weight 1): added by the GEMM itself.
            uniform = scalar if scalar is not None else 1.0 if self.routing.unit_weights else None
            if isinstance(rows, slice) and uniform is not None:
                if member.added_into(out, begin, rows, start, stop, uniform, accumulate=True):
                    continue
            logits = member.logits(begin, rows, start, stop, dtype)
            if isinstance(rows, slice):
                # Σ w·v over the rows with w > 0 only: a 0·(−inf) would be NaN.
                weight = weights[rows, index, None]
                out[rows].add_(logits * weight if scalar is None else logits.mul_(scalar))
            else:
                out.index_add_(0, rows.local, logits * weights[rows.local, index, None])
        if self.routing.has_teacher is not None:  # a row without a teacher: absent (KL 0, no gradient)
            out.masked_fill_(~self.routing.has_teacher[begin:end, None], -math.inf)
        return out

    def mixed_logits(self, rows: int, dtype: torch.dtype) -> Tensor:
        """``log Σ_i w̃_i q_i`` over every column of rows ``[0, rows)`` (the reference's, on one device):
        the teachers present on a row (weight > 0, not all −inf) with their weights renormalized over
        them; −inf on a row with none."""
        logits = self.member_tiles(0, rows, 0, self.columns, dtype)
        lse = torch.logsumexp(logits, -1)
        weights = self.weights(0, rows, dtype).T
        present = (weights > 0) & (lse > -math.inf)
        total = torch.where(present, weights, 0.0).sum(0)
        shifts = torch.where(present, weights.log() - lse - total.log(), -math.inf)
        return torch.logsumexp(logits + shifts[:, :, None], 0)


def mixture_blocks(plan: MixturePlan, teacher: TeacherSource, head: HeadTensors, layout: VocabLayout) -> MixtureBlocks:
    """The blocks of a prepared :class:`TeacherMixture` over this device's columns (``layout``);
    ``head``: the call's tensors (a tied teacher reads the student's head and bias)."""
    assert isinstance(teacher, TeacherMixture) and teacher.routing is not None
    inputs = [source.logits_inputs(layout.vocab_start, layout.vocab_size) for source in teacher.members()]
    hiddens = [given.hidden for given in inputs if given.hidden is not None]
    if layout.sequence_parallel and layout.group is not None and hiddens:
        # Each teacher's rows, as the student's: this rank's share gathered, every teacher's in one collective.
        full = iter(gather_sequence_rows(hiddens, layout.group))
        inputs = [given if given.hidden is None else given._replace(hidden=next(full)) for given in inputs]
    members = []
    for given, member_plan, rows in zip(inputs, plan.members, teacher.routing.rows):
        hidden, weight, logits, blocks, bias = given
        side: TeacherBlocks
        if blocks is not None:
            side = blocks
        elif logits is not None:
            side = StoredLogits(logits)
        else:
            assert hidden is not None
            tied = weight is None
            member_weight = head.weight if weight is None else weight
            side = HeadLogits(
                hidden,
                member_weight,
                member_plan.softcap,
                head.bias if tied else bias,
                member_plan.scale,
            )
        device_rows = None if rows is None else rows.to(head.student_hidden.device)  # once per call
        members.append(_Member(side, member_plan, rows, device_rows))
    return MixtureBlocks(plan, teacher.routing, members, head.student_hidden.device, layout.real_local_columns)
