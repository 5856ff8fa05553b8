"""Span-aligned likelihood distillation between models with different tokenizers: the two models'
log-likelihoods of aligned text spans compared as binary events, from per-token likelihoods of the
chunked loss, never the full logits (docs/cross_vocab.md, "Span-aligned likelihoods")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..loss import distillation_loss
from ..teachers import TiedTeacher
from ._checks import check_choice, check_real
from ._logmath import log1mexp

__all__ = [
    "SPAN_OBJECTIVES",
    "AlignedLikelihoodConfig",
    "AlignedSpanLossOutput",
    "AlignedSpanPairs",
    "CrossVocabTeacher",
    "PrecomputedSpanTeacher",
    "aligned_span_distillation_loss",
    "build_precomputed_span_teacher",
]

SPAN_OBJECTIVES = ("binary_kl", "binary_ce")
_REDUCTIONS = ("mean", "sum")


def _check_ranges(ranges: object, name: str) -> torch.Tensor:
    """``ranges`` as int64 ``[C, 2]`` half-open ``[start, stop)`` pairs with ``0 <= start <= stop``."""
    if not isinstance(ranges, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [C, 2], got {type(ranges).__name__}")
    if ranges.is_floating_point() or ranges.is_complex() or ranges.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {ranges.dtype}")
    if ranges.dim() != 2 or ranges.shape[1] != 2:
        raise ValueError(f"{name} must have shape [C, 2] (half-open [start, stop) rows), got {tuple(ranges.shape)}")
    ranges = ranges.long()
    starts, stops = ranges[:, 0], ranges[:, 1]
    bad = torch.nonzero((starts < 0) | (stops < starts)).squeeze(1)
    if bad.numel() > 0:
        row = int(bad[0])
        raise ValueError(f"{name} must hold rows with 0 <= start <= stop, got {ranges[row].tolist()} at row {row}")
    return ranges


def _check_ranges_within(ranges: torch.Tensor, rows: int, name: str, rows_name: str) -> None:
    """Raise unless every stop of ``ranges`` is ``<= rows``."""
    if ranges.shape[0] > 0:
        largest = int(ranges[:, 1].max())
        if largest > rows:
            raise ValueError(f"{name} must stop within the {rows} rows of {rows_name}, got a stop of {largest}")


def _check_labels(labels: object, name: str) -> torch.Tensor:
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dim() != 1:
        raise ValueError(f"{name} must be 1-D (BT,), got shape {tuple(labels.shape)}")
    return labels


def _span_sums(values: torch.Tensor, ranges: torch.Tensor) -> torch.Tensor:
    """``out[c] = Σ_{start_c <= i < stop_c} values[i]``, shape ``(C,)``, over each span's own elements
    (spans may overlap)."""
    # Never a difference of prefix sums: a span of tiny terms keeps its value (ℓ = 0 stays exactly P = 1).
    ranges = ranges.to(values.device)
    starts, lengths = ranges[:, 0], ranges[:, 1] - ranges[:, 0]
    # Each element's span and token row: spans may overlap, so the elements are gathered, not sliced.
    span_of = torch.repeat_interleave(torch.arange(ranges.shape[0], device=values.device), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    token_of = starts[span_of] + torch.arange(span_of.numel(), device=values.device) - first[span_of]
    return values.new_zeros(ranges.shape[0]).index_add(0, span_of, values[token_of])


def _span_log_likelihoods(nll: torch.Tensor, ranges: torch.Tensor) -> torch.Tensor:
    """``ℓ(c) = −Σ_{i ∈ c} nll_i`` in float64, at most 0 (NaN stays NaN)."""
    # nll_i ≥ 0 exactly: the clamp only removes a rounding −ε of a backend, which would make log(1 − e^ℓ) NaN.
    return _span_sums(-nll.to(torch.float64), ranges).clamp_max(0.0)


def _per_token_nll(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``−log p(y_i)`` per row (0 at ignored rows), from the chunked core: full logits never exist."""
    # A teacher the loss never reads (no KL, no teacher CE): the student CE alone, per row, chunked.
    return distillation_loss(
        hidden,
        weight,
        labels,
        TiedTeacher(hidden.detach()),
        student_ce_weight=1.0,
        teacher_ce_weight=0.0,
        kl_weight=0.0,
        reduction="none",
        ignore_index=ignore_index,
    ).loss


@dataclass(frozen=True)
class AlignedSpanPairs:
    """Aligned spans: row ``c`` of ``student_ranges`` and of ``teacher_ranges`` (integer tensors
    ``[C, 2]``, stored as int64) are half-open ``[start, stop)`` ranges of each side's flattened (BT)
    token rows that cover the same text; ``0 <= start <= stop``, spans may be empty or overlap."""

    student_ranges: torch.Tensor
    teacher_ranges: torch.Tensor

    def __post_init__(self) -> None:
        student = _check_ranges(self.student_ranges, "AlignedSpanPairs.student_ranges")
        teacher = _check_ranges(self.teacher_ranges, "AlignedSpanPairs.teacher_ranges")
        if student.shape[0] != teacher.shape[0]:
            raise ValueError(
                "AlignedSpanPairs.student_ranges and teacher_ranges must hold the same number of spans, got "
                f"{student.shape[0]} and {teacher.shape[0]}"
            )
        object.__setattr__(self, "student_ranges", student)
        object.__setattr__(self, "teacher_ranges", teacher)

    @property
    def num_spans(self) -> int:
        """``C``, the number of aligned span pairs."""
        return self.student_ranges.shape[0]


@dataclass(frozen=True)
class AlignedLikelihoodConfig:
    """Options of :func:`aligned_span_distillation_loss`: ``loss = student_ce_weight · CE + span_kl_weight ·
    span_term``; ``objective``: ``binary_kl`` or ``binary_ce``; ``reduction``: ``mean`` (CE over valid
    tokens, span term over kept spans) or ``sum``; student rows labelled ``ignore_index`` count nowhere."""

    student_ce_weight: float = 1.0
    span_kl_weight: float = 1.0
    ignore_index: int = -100
    reduction: str = "mean"
    objective: str = "binary_kl"

    def __post_init__(self) -> None:
        check_real(self.student_ce_weight, "AlignedLikelihoodConfig.student_ce_weight")
        check_real(self.span_kl_weight, "AlignedLikelihoodConfig.span_kl_weight")
        if not isinstance(self.ignore_index, int) or isinstance(self.ignore_index, bool):
            raise TypeError(f"AlignedLikelihoodConfig.ignore_index must be an int, got {self.ignore_index!r}")
        check_choice(self.reduction, "AlignedLikelihoodConfig.reduction", _REDUCTIONS)
        check_choice(self.objective, "AlignedLikelihoodConfig.objective", SPAN_OBJECTIVES)


@dataclass(frozen=True)
class PrecomputedSpanTeacher:
    """A frozen teacher reduced to its span log-likelihoods: ``ranges`` int64 ``[C, 2]`` (its row
    ranges), ``log_likelihoods`` ``(C,)`` ``ℓ_t(c) = Σ_{i ∈ c, label valid} log q(y_i)`` (``<= 0``,
    ``-inf`` allowed; no NaN, no grad) and ``valid_counts`` int64 ``(C,)`` (its valid labels per span;
    the loss drops a span with none). Built by :func:`build_precomputed_span_teacher` (float64), or
    from span log-probabilities obtained elsewhere (e.g. summed token log-probs of a hosted teacher)."""

    ranges: torch.Tensor
    log_likelihoods: torch.Tensor
    valid_counts: torch.Tensor

    def __post_init__(self) -> None:
        ranges = _check_ranges(self.ranges, "PrecomputedSpanTeacher.ranges")
        count = ranges.shape[0]
        values, counts = self.log_likelihoods, self.valid_counts
        if not isinstance(values, torch.Tensor) or not values.is_floating_point():
            raise TypeError(f"PrecomputedSpanTeacher.log_likelihoods must be a floating-point tensor, got {values!r}")
        if not isinstance(counts, torch.Tensor) or counts.dtype != torch.long:
            raise TypeError(f"PrecomputedSpanTeacher.valid_counts must be an int64 tensor, got {counts!r}")
        for name, tensor in (("log_likelihoods", values), ("valid_counts", counts)):
            if tensor.shape != (count,):
                raise ValueError(
                    f"PrecomputedSpanTeacher.{name} must have shape ({count},) (one per range), got "
                    f"{tuple(tensor.shape)}"
                )
        if values.requires_grad:
            raise ValueError("PrecomputedSpanTeacher.log_likelihoods must not require grad; pass .detach()")
        if bool((torch.isnan(values) | (values > 0)).any()):
            raise ValueError(
                "PrecomputedSpanTeacher.log_likelihoods must be log-probabilities <= 0 (no NaN), got "
                f"values in [{values.min().item()}, {values.max().item()}]"
            )
        if bool((counts < 0).any()):
            raise ValueError(f"PrecomputedSpanTeacher.valid_counts must be >= 0, got minimum {int(counts.min())}")
        object.__setattr__(self, "ranges", ranges)

    @property
    def num_spans(self) -> int:
        """``C``, the number of spans."""
        return self.ranges.shape[0]


@dataclass(frozen=True)
class CrossVocabTeacher:
    """A live span teacher, ``hidden`` (BT_t, D_t), head ``weight`` (V_t, D_t) and ``labels`` (BT_t,)
    over its own vocabulary: :func:`aligned_span_distillation_loss` scores it at each call as
    :func:`build_precomputed_span_teacher` would on ``pairs.teacher_ranges`` (with the config's
    ``ignore_index``), detached: none of its tensors receives a gradient."""

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("hidden", "weight", "labels"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"CrossVocabTeacher.{name} must be a torch.Tensor, got {type(value).__name__}")

    def scored(self, ranges: torch.Tensor, ignore_index: int) -> PrecomputedSpanTeacher:
        """Its span log-likelihoods over ``ranges``, detached."""
        return build_precomputed_span_teacher(
            self.hidden.detach(), self.weight.detach(), self.labels, ranges, ignore_index=ignore_index
        )


class AlignedSpanLossOutput(NamedTuple):
    """Result of :func:`aligned_span_distillation_loss`, 0-d tensors; only ``loss`` is differentiable.
    ``student_ce`` and ``span_kl`` (the configured objective) are unweighted, both always computed."""

    loss: torch.Tensor
    student_ce: torch.Tensor
    span_kl: torch.Tensor


def build_precomputed_span_teacher(
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_labels: torch.Tensor,
    teacher_ranges: torch.Tensor,
    *,
    ignore_index: int = -100,
) -> PrecomputedSpanTeacher:
    """The teacher scored once: span log-likelihoods ``ℓ_t(c) = Σ_{i ∈ c, y_i ≠ ignore} log q(y_i)`` of
    the logits ``teacher_hidden`` (BT_t, D_t) · ``teacher_weight`` (V_t, D_t)ᵀ over ``teacher_ranges``
    ``[C, 2]`` (normally ``pairs.teacher_ranges``), chunk by chunk under ``torch.no_grad()``, in float64."""
    ranges = _check_ranges(teacher_ranges, "teacher_ranges")
    labels = _check_labels(teacher_labels, "teacher_labels")
    _check_ranges_within(ranges, labels.shape[0], "teacher_ranges", "teacher_labels")
    with torch.no_grad():
        nll = _per_token_nll(teacher_hidden, teacher_weight, labels, ignore_index)
        log_likelihoods = _span_log_likelihoods(nll, ranges)
        valid_counts = _span_sums((labels != ignore_index).long(), ranges)
    return PrecomputedSpanTeacher(ranges=ranges, log_likelihoods=log_likelihoods, valid_counts=valid_counts)


def _binary_span_terms(teacher_ll: torch.Tensor, student_ll: torch.Tensor, objective: str) -> torch.Tensor:
    """Per-span ``binary_kl`` or ``binary_ce`` from float64 log-likelihoods ``ℓ_t, ℓ_s <= 0`` (``P = 1``: below)."""
    teacher_else = -torch.expm1(teacher_ll)  # 1 − P_t, exactly 0 at ℓ_t = 0
    # P_t = 1: the "anything else" term has weight 1 − P_t = 0 and is 0 (0·log 0 = 0).
    teacher_sure = teacher_else == 0
    # P_s = 1 while P_t < 1: the student gives no mass to an outcome the teacher allows (+inf below).
    student_sure = student_ll == 0
    # log(1 − P) at ℓ = 0 would be -inf; evaluate it at a stand-in ℓ = −1 instead. The "else" term
    # then has weight 1 − P_t = 0 (teacher sure) or is replaced by +inf below (student sure only),
    # so the stand-in never shows in a value or a gradient.
    log_teacher_else = log1mexp(torch.where(teacher_sure, -1.0, teacher_ll))
    log_student_else = log1mexp(torch.where(student_sure, -1.0, student_ll))
    if objective == "binary_kl":
        value = teacher_ll.exp() * (teacher_ll - student_ll) + teacher_else * (log_teacher_else - log_student_else)
        value = value.clamp_min(0.0)  # a KL: ≥ 0 in exact arithmetic, rounding aside
    else:
        value = -(teacher_ll.exp() * student_ll + teacher_else * log_student_else)
    # +inf where the student is sure and the teacher not, its gradient dropped (the KL variants' zero-support rule).
    return torch.where(student_sure & ~teacher_sure, math.inf, value)


def aligned_span_distillation_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    student_labels: torch.Tensor,
    span_teacher: PrecomputedSpanTeacher | CrossVocabTeacher,
    pairs: AlignedSpanPairs,
    config: AlignedLikelihoodConfig | None = None,
) -> AlignedSpanLossOutput:
    """Student CE plus a per-span binary likelihood term against a span teacher, without the full logits:
    with ``nll_i = −log p(y_i)`` of ``student_hidden`` (BT, D) · ``student_weight`` (V, D)ᵀ (chunked), a
    span's ``ℓ_s(c) = −Σ_{i ∈ c} nll_i`` over its valid rows, ``ℓ_t(c)`` from ``span_teacher``, ``P = e^ℓ``:
    ``binary_kl = P_t(ℓ_t − ℓ_s) + (1 − P_t)(log(1 − P_t) − log(1 − P_s))``,
    ``binary_ce = −[P_t ℓ_s + (1 − P_t) log(1 − P_s)]``. ``CE = Σ_i nll_i / N_valid`` (``mean``) or
    ``Σ_i nll_i`` (``sum``); ``span_term = Σ_{c kept} term(c) / N_kept`` or the plain sum, a span kept
    when it holds a valid label on both sides; ``loss = student_ce_weight · CE + span_kl_weight ·
    span_term``, a term of weight 0 left out (an infinite component cannot make it NaN); an empty mean
    is 0. ``span_teacher`` must have been built on ``pairs.teacher_ranges`` (a :class:`CrossVocabTeacher`
    is scored on them at the call). Gradients reach ``student_hidden`` and ``student_weight`` only."""
    config = AlignedLikelihoodConfig() if config is None else config
    if not isinstance(config, AlignedLikelihoodConfig):
        raise TypeError(f"config must be an AlignedLikelihoodConfig or None, got {type(config).__name__}")
    if not isinstance(pairs, AlignedSpanPairs):
        raise TypeError(f"pairs must be an AlignedSpanPairs, got {type(pairs).__name__}")
    if isinstance(span_teacher, CrossVocabTeacher):
        span_teacher = span_teacher.scored(pairs.teacher_ranges, config.ignore_index)
    if not isinstance(span_teacher, PrecomputedSpanTeacher):
        raise TypeError(
            f"span_teacher must be a PrecomputedSpanTeacher or CrossVocabTeacher, got {type(span_teacher).__name__}"
        )
    # A teacher scored on other ranges would be compared with other text.
    if not torch.equal(span_teacher.ranges.cpu(), pairs.teacher_ranges.cpu()):
        raise ValueError(
            "span_teacher must be built on pairs.teacher_ranges, got ranges of shape "
            f"{tuple(span_teacher.ranges.shape)} that differ from pairs.teacher_ranges "
            f"{tuple(pairs.teacher_ranges.shape)}"
        )
    labels = _check_labels(student_labels, "student_labels")
    _check_ranges_within(pairs.student_ranges, labels.shape[0], "pairs.student_ranges", "student_labels")

    nll = _per_token_nll(student_hidden, student_weight, labels, config.ignore_index)
    valid = labels != config.ignore_index
    student_ll = _span_log_likelihoods(nll, pairs.student_ranges)
    student_counts = _span_sums(valid.long(), pairs.student_ranges)
    teacher_ll = span_teacher.log_likelihoods.to(device=nll.device, dtype=torch.float64)
    # A span without a valid label on either side has no likelihood to compare: dropped.
    kept = (student_counts > 0) & (span_teacher.valid_counts.to(nll.device) > 0)

    # A dropped span gets the stand-in ℓ = −1 on both sides: its masked term and gradient stay finite, not NaN.
    terms = _binary_span_terms(
        torch.where(kept, teacher_ll, -1.0), torch.where(kept, student_ll, -1.0), config.objective
    )
    span_term = torch.where(kept, terms, torch.zeros_like(terms)).sum()
    student_ce = nll.sum()
    if config.reduction == "mean":
        span_term = span_term / kept.sum().clamp_min(1)  # an empty mean is 0, not NaN
        student_ce = student_ce / valid.sum().clamp_min(1)
    span_term = span_term.to(nll.dtype)  # from float64 back to the student's loss dtype

    loss = nll[:0].sum()  # 0, attached to the graph even if both weights are 0
    # A term of weight 0 is left out, not multiplied by 0: 0·inf would make the loss NaN.
    if config.student_ce_weight > 0:
        loss = loss + config.student_ce_weight * student_ce
    if config.span_kl_weight > 0:
        loss = loss + config.span_kl_weight * span_term
    return AlignedSpanLossOutput(loss=loss, student_ce=student_ce.detach(), span_kl=span_term.detach())
