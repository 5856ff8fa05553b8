"""Several frozen teachers in one call: :class:`TeacherMixture`, whose weights say how much each
teacher counts on each row, and :class:`MixtureRouting`, what a call decided from those weights.

With ``v_i`` teacher i's tempered logits and ``q_i = softmax(v_i)``, a row's KL is, by ``combine``:
``"divergences"`` Σ_i w_i·D(q_i‖p); ``"probabilities"`` D(Σ_i w_i q_i‖p) (each row's weights sum
to 1); ``"log_probabilities"`` D(softmax(Σ_i w_i v_i)‖p), the renormalized product of experts."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from .source import (
    ExpectedShape,
    LogitsInputs,
    SeparateTeacher,
    ShardReader,
    TeacherHead,
    TeacherSource,
    ValueCheck,
)

__all__ = ["COMBINE_MODES", "WEIGHT_SUM_TOLERANCE", "MixtureRouting", "TeacherMixture"]

COMBINE_MODES = ("divergences", "probabilities", "log_probabilities")
#: How far a row of ``combine="probabilities"`` weights may sum from 1 (``cross_vocab.mixing``'s tolerance).
WEIGHT_SUM_TOLERANCE = 1e-6
#: The forms a call runs (docs: issue 38's plan): "linear" forms one block Σ_i w_i·v_i per chunk (every
#: ``log_probabilities`` call, and rows routed to one teacher of weight 1); "mixed" and "views" read every
#: teacher's statistics (not built yet for the chunked backends).
FORMS = ("linear", "mixed", "views")


@dataclass(frozen=True)
class MixtureRouting:
    """What :meth:`TeacherMixture.prepared` read of the weights, once per call."""

    # Per teacher, the sorted rows (CPU int64) where its weight is > 0; None: every row (scalar weights).
    rows: tuple[Tensor | None, ...]
    weights: Tensor | None  # (rows, n) fp64 on the labels' device ("probabilities": divided by each row's sum)
    scalars: tuple[float, ...] | None  # the weights when given as n numbers
    form: str  # one of FORMS
    has_teacher: Tensor | None  # (rows,) bool on the labels' device: some weight > 0 (None: every row)
    unit_weights: bool = False  # every weight > 0 is 1 (rows routed to one teacher each, or n numbers 0/1)


def _member_name(index: int) -> str:
    return f"TeacherMixture.teachers[{index}]"


@dataclass(frozen=True)
class TeacherMixture(TeacherSource):
    """``teachers``: frozen teachers of any kind (tied, separate, precomputed, top-k, ``TeacherHead``);
    ``weights``: n numbers, or a floating (rows, n) tensor of per-row weights on the labels' device
    (one-hot rows route each row to one teacher; a row of zeros has no teacher: KL 0); ``combine``:
    ``"divergences"``, ``"probabilities"`` or ``"log_probabilities"``. Built unchecked: a call checks
    it, so that under a group every rank raises alike."""

    teachers: Sequence[TeacherSource | TeacherHead]
    weights: Sequence[float] | Tensor
    combine: str = "divergences"
    routing: MixtureRouting | None = field(default=None, compare=False, repr=False)

    kind = "mixture"
    reads_head = True  # each teacher's own cap and scale are the mixture plan's, not LossPlan's

    @property
    def trainable(self) -> bool:  # type: ignore[override]
        """Whether every teacher is read through a head (tied, separate, ``TeacherHead``): then, as a
        trainable teacher, no column is −inf on a row where a teacher counts and no value check runs
        (no error columns, no host read under tensor parallelism). A mixture is never trained: the
        plan refuses every way the loss would train one."""
        teachers = self.teachers if isinstance(self.teachers, (list, tuple)) else ()
        return bool(teachers) and all(
            isinstance(member, TeacherHead) or (isinstance(member, TeacherSource) and member.trainable)
            for member in teachers
        )

    @property
    def holds_modules(self) -> bool:
        """Whether a teacher is a ``TeacherHead`` (read before any check: False for a malformed mixture)."""
        teachers = self.teachers if isinstance(self.teachers, (list, tuple)) else ()
        return any(isinstance(member, TeacherHead) for member in teachers)

    def members(self) -> list[TeacherSource]:
        """The teachers as descriptors (a ``TeacherHead`` as the ``SeparateTeacher`` of its module's
        weight and bias as they are: a call has gathered FSDP2-sharded heads before it reads them);
        only after :meth:`check_structure`."""
        out: list[TeacherSource] = []
        for member in self.teachers:
            if isinstance(member, TeacherHead):
                bias = getattr(member.head, "bias", None)
                weight = member.head.weight
                assert isinstance(weight, Tensor)
                member = SeparateTeacher(member.hidden, weight, bias if isinstance(bias, Tensor) else None)
            assert isinstance(member, TeacherSource)
            out.append(member)
        return out

    def check_structure(self, label_rows: int) -> None:
        """Types and shapes of ``teachers``, ``weights`` and ``combine`` (no host read)."""
        teachers = self.teachers
        if not isinstance(teachers, (list, tuple)) or not teachers:
            raise TypeError(f"TeacherMixture.teachers must be a non-empty list of teachers, got {teachers!r:.80}")
        for index, member in enumerate(teachers):
            if isinstance(member, TeacherMixture):
                raise TypeError(f"{_member_name(index)} is a TeacherMixture: a mixture cannot hold a mixture")
            if not isinstance(member, (TeacherSource, TeacherHead)):
                raise TypeError(
                    f"{_member_name(index)} must be a TiedTeacher, SeparateTeacher, PrecomputedTeacher or "
                    f"TeacherHead, got {type(member).__name__}"
                )
        if self.combine not in COMBINE_MODES:
            raise ValueError(f"TeacherMixture.combine must be one of {COMBINE_MODES}, got {self.combine!r}")
        n, weights = len(teachers), self.weights
        if isinstance(weights, Tensor):
            if not weights.is_floating_point():
                raise TypeError(f"TeacherMixture.weights must be a floating-point tensor, got dtype {weights.dtype}")
            if tuple(weights.shape) not in ((n,), (label_rows, n)):
                raise ValueError(
                    f"TeacherMixture.weights must have shape ({n},) (one weight per teacher) or ({label_rows}, {n}) "
                    f"(one row per label, one column per teacher), got {tuple(weights.shape)}"
                )
            if weights.requires_grad:
                raise ValueError("TeacherMixture.weights must not require grad (no gradient reaches them)")
            return
        if not isinstance(weights, (list, tuple)) or len(weights) != n:
            raise ValueError(
                f"TeacherMixture.weights must be {n} numbers (one per teacher) or a tensor, got {weights!r}"
            )
        for index, value in enumerate(weights):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"TeacherMixture.weights[{index}] must be a real number, got {value!r}")

    def prepared(self, label_rows: int) -> TeacherMixture:
        """This mixture with its :class:`MixtureRouting`: the weights' values checked (one host read
        of a weights tensor; n numbers are read as numbers), "probabilities" rows divided by their
        sums, the form decided."""
        given = self.weights
        if not isinstance(given, Tensor) or given.dim() == 1:  # n weights: a tensor of them is read once
            values = given.detach().double().tolist() if isinstance(given, Tensor) else [float(v) for v in given]
            scalars = _scalar_weights(values, self.combine)
            unit = all(value in (0.0, 1.0) for value in scalars)
            form = _form(self.combine, unit and sum(value > 0 for value in scalars) == 1)
            return replace(self, routing=MixtureRouting((None,) * len(scalars), None, scalars, form, None, unit))
        table = given.detach().double().cpu()
        _check_weight_values(table, self.combine)
        sums = table.sum(1, keepdim=True)
        if self.combine == "probabilities":  # a row of zeros stays zeros: it has no teacher
            table = table / torch.where(sums > 0, sums, torch.ones_like(sums))
        positive = table > 0
        routed = bool(((positive.sum(1) <= 1) & ((table == 1) | ~positive).all(1)).all())
        rows = tuple(torch.nonzero(positive[:, i]).flatten() for i in range(table.shape[1]))
        weights = table.to(given.device)  # fp64: each chunk reads them in its statistics dtype
        unit = bool((table[positive] == 1).all())
        has_teacher = positive.any(1).to(given.device)
        routing = MixtureRouting(rows, weights, None, _form(self.combine, routed), has_teacher, unit)
        return replace(self, routing=routing)

    def named_tensors(self) -> list[tuple[str, Tensor]]:
        # Runs before any check (a call's DTensor scan): a malformed mixture lists what it can, never raises.
        named: list[tuple[str, Tensor]] = []
        teachers = self.teachers if isinstance(self.teachers, (list, tuple)) else ()
        for index, member in enumerate(teachers):
            if isinstance(member, TeacherSource) and not isinstance(member, TeacherMixture):
                named += [(f"teachers[{index}].{name}", tensor) for name, tensor in member.named_tensors()]
            elif isinstance(member, TeacherHead):
                named.append((f"teachers[{index}].hidden", member.hidden))
                for name in ("weight", "bias"):
                    tensor = getattr(member.head, name, None)
                    named += [(f"teachers[{index}].head.{name}", tensor)] if isinstance(tensor, Tensor) else []
        return named + ([("weights", self.weights)] if isinstance(self.weights, Tensor) else [])

    def logits_inputs(self, vocab_start: int, vocab_size: int) -> LogitsInputs:
        # The engine forms the mixture's blocks (orda_tp.engine.mixture_blocks), reading each teacher's own.
        return LogitsInputs(None, None, None, None)

    def expected_shapes(self, rows: int, width: int, label_rows: int, vocab: int | None) -> list[ExpectedShape]:
        self.check_structure(label_rows)
        shapes: list[ExpectedShape] = []
        for index, member in enumerate(self.members()):
            for expected in member.expected_shapes(rows, width, label_rows, vocab):
                name = expected.name.replace("teacher.", f"teacher.teachers[{index}].", 1)
                shapes.append(expected._replace(name=name))
        return shapes

    def localized(self, reader: ShardReader) -> TeacherSource:
        members = []
        for index, member in enumerate(self.members()):
            local = member.localized(reader)
            members.append(local)
            _prefixed(index, local.check_shardable)
        return replace(self, teachers=members)

    def check_shardable(self) -> None:
        for index, member in enumerate(self.members()):
            _prefixed(index, member.check_shardable)

    def vocab_columns(self) -> int | None:
        """The teachers' common column count on this rank (None: every teacher reads the student's head
        or is a top-k cache)."""
        counts = [(index, member.vocab_columns()) for index, member in enumerate(self.members())]
        given = [(index, count) for index, count in counts if count is not None]
        for index, count in given[1:]:
            if count != given[0][1]:
                raise ValueError(
                    f"{_member_name(index)} holds {count} vocabulary columns on this rank, "
                    f"{_member_name(given[0][0])} {given[0][1]}: the teachers' vocabularies differ"
                )
        return given[0][1] if given else None

    def replicated_tensors(self) -> list[tuple[str, Tensor]]:
        named = [
            (name.replace("teacher.", f"teacher.teachers[{index}].", 1), tensor)
            for index, member in enumerate(self.members())
            for name, tensor in member.replicated_tensors()
        ]
        return named + ([("teacher.weights", self.weights)] if isinstance(self.weights, Tensor) else [])

    def checked_values(self, real_columns: int) -> list[ValueCheck]:
        checks = []
        for index, member in enumerate(self.members()):
            for check in member.checked_values(real_columns):
                checks.append(check._replace(name=check.name.replace("teacher.", f"teacher.teachers[{index}].", 1)))
        return checks

    def check_cache_values(self, vocab_size: int) -> None:
        for index, member in enumerate(self.members()):
            _prefixed(index, member.check_cache_values, vocab_size)

    def trained_tensors(self) -> list[tuple[str, Tensor]]:
        return [
            (name.replace("teacher ", f"teacher.teachers[{index}].", 1), tensor)
            for index, member in enumerate(self.members())
            for name, tensor in member.trained_tensors()
        ]

    def check_unmodified(self) -> None:
        for index, member in enumerate(self.members()):
            _prefixed(index, member.check_unmodified)

    def settings_text(self) -> str:
        weights = "<tensor>" if isinstance(self.weights, Tensor) else repr(self.weights)
        lines = ["teacher=TeacherMixture", f"teacher.combine={self.combine!r}", f"teacher.weights={weights}"]
        lines += [f"teacher.form={self.routing.form}"] if self.routing is not None else []
        for index, member in enumerate(self.members()):
            lines += [f"teachers[{index}].{line}" for line in member.settings_text().splitlines()]
        return "\n".join(lines)


def _form(combine: str, routed: bool) -> str:
    """ "linear" for a product of experts or rows routed to one teacher of weight 1, else by ``combine``."""
    if combine == "log_probabilities" or routed:
        return "linear"
    return "mixed" if combine == "probabilities" else "views"


def _scalar_weights(weights: list[float], combine: str) -> tuple[float, ...]:
    """n numbers checked (finite, ≥ 0, not all 0; "probabilities": summing to 1), then divided by
    their sum for "probabilities"."""
    for index, value in enumerate(weights):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"TeacherMixture.weights[{index}] is {value!r}: {_VALUE_RULE}")
    total = sum(weights)
    if total == 0:
        raise ValueError("TeacherMixture.weights are all 0: no teacher has weight")
    if combine != "probabilities":
        return tuple(weights)
    if abs(total - 1) > WEIGHT_SUM_TOLERANCE:
        raise ValueError(f"TeacherMixture.weights sums to {total!r}: {_SUM_RULE}")
    return tuple(value / total for value in weights)


_VALUE_RULE = "weights must be finite and >= 0"
_SUM_RULE = (
    f"with combine='probabilities' each row's weights must sum to 1 (within {WEIGHT_SUM_TOLERANCE}), or all be 0 "
    "(a row without a teacher)"
)


def _check_weight_values(table: Tensor, combine: str) -> None:
    """A (rows, n) table: finite, ≥ 0; "probabilities": each row sums to 1 (or is all zero)."""
    bad = torch.nonzero(~torch.isfinite(table) | (table < 0))
    if bad.numel():
        row, col = (int(i) for i in bad[0])
        raise ValueError(f"TeacherMixture.weights[{row}, {col}] is {float(table[row, col])!r}: {_VALUE_RULE}")
    if combine != "probabilities":
        return
    sums = table.sum(1)
    off = torch.nonzero((sums != 0) & ((sums - 1).abs() > WEIGHT_SUM_TOLERANCE)).flatten()
    if off.numel():
        row = int(off[0])
        raise ValueError(f"TeacherMixture.weights[{row}] sums to {float(sums[row])!r}: {_SUM_RULE}")


def _prefixed(index: int, check: object, *args: object) -> None:
    """Run a teacher's check, its error naming the teacher in the mixture."""
    assert callable(check)
    try:
        check(*args)
    except ValueError as error:
        raise ValueError(f"{_member_name(index)}: {error}") from error
