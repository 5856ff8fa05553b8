"""Argument checks: every bad input raises a ValueError/TypeError that names the argument, what
was expected and what was received. Nothing is clamped or reinterpreted.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from dataclasses import dataclass
from numbers import Integral, Real
from types import FrameType
from typing import Literal, Protocol, TypeGuard

import torch
from torch import Tensor

from .config import EntropyGate, KernelConfig, resolve_config
from .divergences import Divergence, DivergenceParams, get_divergence
from .plan import REDUCTIONS, LossPlan
from .teachers import PrecomputedTeacher, SeparateTeacher, TiedTeacher

__all__ = [
    "IgnoredArgumentWarning",
    "LossOptions",
    "resolve_options",
    "resolve_divergence",
    "check_ignore_index",
    "check_inputs",
    "build_plan",
    "with_vocabulary",
    "BACKENDS",
]

BACKENDS = ("auto", "triton", "torch", "reference")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _is_real(value: object) -> TypeGuard[Real]:
    return isinstance(value, Real) and not isinstance(value, bool)


def _is_int(value: object) -> TypeGuard[Integral]:
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_loss_weight(name: str, value: object) -> float:
    if not _is_real(value) or not math.isfinite(float(value)) or float(value) < 0:
        raise ValueError(f"{name} must be a finite real number >= 0, got {value!r}")
    return float(value)


def check_temperature(name: str, value: object) -> float:
    if not _is_real(value) or not math.isfinite(float(value)) or float(value) <= 0:
        raise ValueError(f"{name} must be a finite real number > 0, got {value!r}")
    return float(value)


class IgnoredArgumentWarning(UserWarning):
    """A keyword that has no effect on this call was given, and is ignored (orda-kernel accepts
    it silently): e.g. ``kl_alpha`` with a variant that reads no ``kl_alpha``."""


VARIANT_PARAMETERS = ("kl_alpha", "kl_beta", "entropy_gate")  # the order of Divergence.resolve's arguments
# Frames of these directories sit between a user's call and the warning (torch's are the
# torch.compiler.disable wrappers around the public entry points).
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(path)) + os.sep for path in (__file__, torch.__file__))


def _caller_stacklevel() -> int:
    """``stacklevel`` for a ``warnings.warn`` in the calling function that names the first frame
    outside orda_tp and torch: the user's line, so that Python's default filter shows the warning
    once per call site."""
    level = 1
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        level, frame = level + 1, frame.f_back
    return level


def _reads(divergence: Divergence) -> str:
    if not divergence.parameters:
        return f"none of {', '.join(VARIANT_PARAMETERS)}"
    return "only " + " and ".join(divergence.parameters)


def resolve_divergence(
    kl_divergence: object,
    kl_alpha: object,
    kl_beta: object,
    entropy_gate: object,
    *,
    unused: Literal["raise", "warn"] = "raise",
) -> tuple[Divergence, DivergenceParams]:
    """The registered variant and its parameters (defaults filled, ranges checked).

    A parameter the variant does not read is neither checked nor used: with ``unused="warn"``
    (``distillation_loss``, as orda-kernel accepts it) it gives one :class:`IgnoredArgumentWarning`,
    with ``unused="raise"`` (the logits-level losses) a ValueError.
    """
    divergence = get_divergence(kl_divergence)
    given = dict(zip(VARIANT_PARAMETERS, (kl_alpha, kl_beta, entropy_gate)))
    for keyword, value in given.items():
        if value is None or keyword in divergence.parameters:
            continue
        if unused == "raise":
            raise ValueError(
                f"{keyword}={value!r} is not used by kl_divergence={divergence.name!r} "
                f"(it reads {list(divergence.parameters) or 'no parameters'}); leave {keyword}=None"
            )
        warnings.warn(
            f"{keyword}={value!r} is ignored: kl_divergence={divergence.name!r} reads {_reads(divergence)}; "
            f"leave {keyword}=None to silence this warning",
            IgnoredArgumentWarning,
            stacklevel=_caller_stacklevel(),
        )
        given[keyword] = None
    return divergence, divergence.resolve(*given.values())


def check_ignore_index(ignore_index: object) -> int:
    """An integer (``int`` or e.g. a NumPy integer, as orda-kernel accepts) that fits in
    torch.long, like the labels it is compared with; returned as an ``int``."""
    if not _is_int(ignore_index):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if not INT64_MIN <= int(ignore_index) <= INT64_MAX:
        raise ValueError(f"ignore_index must fit in torch.long (int64) like the labels, got {ignore_index!r}")
    return int(ignore_index)


def with_vocabulary(divergence: Divergence, params: DivergenceParams, vocab_size: int) -> DivergenceParams:
    """``params`` completed by what the variant reads of the global real vocabulary: ``log V``,
    the normalizer of ``entropy_adaptive``'s gate (which needs V ≥ 2)."""
    if divergence.name != "entropy_adaptive":
        return params
    if vocab_size < 2:
        raise ValueError(f"kl_divergence='entropy_adaptive' needs a vocabulary of at least 2 columns, got {vocab_size}")
    return DivergenceParams(params.alpha, params.beta, params.gate, math.log(vocab_size))


@dataclass(frozen=True)
class LossOptions:
    """The validated scalar keywords of a loss call (everything that does not depend on tensors)."""

    student_ce_weight: float
    teacher_ce_weight: float | None
    kl_weight: float
    kl_temperature: float
    kl_teacher_temperature: float | None
    kl_divergence: str
    kl_alpha: float | None
    kl_beta: float | None
    entropy_gate: EntropyGate | None
    ignore_index: int
    reduction: str
    config: KernelConfig
    backend: str
    gradient_materialization_scale: float | Tensor | None
    grad_scaler: GradScalerLike | None


class GradScalerLike(Protocol):
    """What the loss reads of a ``torch.amp.GradScaler``: its scale (``get_scale``)."""

    def get_scale(self) -> float: ...


def _is_grad_scaler(value: object) -> TypeGuard[GradScalerLike]:
    """A GradScaler instance (or one alike): not a class, with a callable ``get_scale``."""
    return not isinstance(value, type) and callable(getattr(value, "get_scale", None))


def check_materialization_scale(value: object) -> float | Tensor:
    """A finite real > 0, or a one-element floating-point tensor that does not require grad
    (orda-kernel's form, e.g. ``GradScaler.scale(torch.ones(()))``), used on the device as it is
    (its value is never read: that would synchronize)."""
    if not isinstance(value, Tensor):
        return check_temperature("gradient_materialization_scale", value)
    if value.numel() != 1 or not value.is_floating_point() or value.requires_grad:
        raise ValueError(
            "gradient_materialization_scale must be a finite real number > 0 or a one-element floating-point "
            f"tensor that does not require grad, got a tensor of shape {tuple(value.shape)}, dtype {value.dtype}, "
            f"requires_grad={value.requires_grad}"
        )
    return value.reshape(())


def check_precision(
    gradient_materialization_scale: object, grad_scaler: object
) -> tuple[float | Tensor | None, GradScalerLike | None]:
    """``gradient_materialization_scale`` (None or :func:`check_materialization_scale`'s forms) and
    ``grad_scaler`` (None or a GradScaler instance), checked."""
    scale = None
    if gradient_materialization_scale is not None:
        scale = check_materialization_scale(gradient_materialization_scale)
    if grad_scaler is None or _is_grad_scaler(grad_scaler):
        return scale, grad_scaler
    received = f"the class {grad_scaler.__name__}" if isinstance(grad_scaler, type) else type(grad_scaler).__name__
    raise TypeError(f"grad_scaler must be a torch.amp.GradScaler instance or None, got {received}")


def resolve_options(
    *,
    student_ce_weight: object,
    teacher_ce_weight: object,
    kl_weight: object,
    kl_temperature: object,
    kl_teacher_temperature: object,
    kl_divergence: object,
    kl_alpha: object,
    kl_beta: object,
    entropy_gate: object,
    ignore_index: object,
    reduction: object,
    profile: object,
    backend: object,
    config: object,
    gradient_materialization_scale: object,
    grad_scaler: object,
) -> LossOptions:
    """Validate the keywords; the teacher-dependent defaults are resolved in :func:`build_plan`."""
    # The variant's parameter ranges are checked here too, so that DistillationLoss(...) fails at construction.
    divergence, _ = resolve_divergence(kl_divergence, kl_alpha, kl_beta, entropy_gate, unused="warn")
    label_to_ignore = check_ignore_index(ignore_index)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {list(REDUCTIONS)}, got {reduction!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    scale, scaler = check_precision(gradient_materialization_scale, grad_scaler)
    # A parameter the variant does not read was warned about above and is dropped here; one that it
    # reads was checked by resolve_divergence (a real number, an EntropyGate).
    alpha = kl_alpha if "kl_alpha" in divergence.parameters else None
    beta = kl_beta if "kl_beta" in divergence.parameters else None
    gate = entropy_gate if "entropy_gate" in divergence.parameters else None
    assert alpha is None or isinstance(alpha, (int, float))
    assert beta is None or isinstance(beta, (int, float))
    assert gate is None or isinstance(gate, EntropyGate)
    options = LossOptions(
        student_ce_weight=check_loss_weight("student_ce_weight", student_ce_weight),
        teacher_ce_weight=None
        if teacher_ce_weight is None
        else check_loss_weight("teacher_ce_weight", teacher_ce_weight),
        kl_weight=check_loss_weight("kl_weight", kl_weight),
        kl_temperature=check_temperature("kl_temperature", kl_temperature),
        kl_teacher_temperature=None
        if kl_teacher_temperature is None
        else check_temperature("kl_teacher_temperature", kl_teacher_temperature),
        kl_divergence=divergence.name,
        kl_alpha=alpha,
        kl_beta=beta,
        entropy_gate=gate,
        ignore_index=label_to_ignore,
        reduction=reduction,
        config=resolve_config(profile, config),
        backend=backend,
        gradient_materialization_scale=scale,
        grad_scaler=scaler,
    )
    if options.kl_teacher_temperature is not None:
        _check_cotrained_temperatures(divergence, options.kl_temperature, options.kl_teacher_temperature)
    return options


def _check_cotrained_temperatures(divergence: Divergence, student: float, teacher: float) -> None:
    if divergence.cotrains_teacher and teacher != student:
        raise ValueError(
            f"kl_divergence={divergence.name!r} needs kl_teacher_temperature == kl_temperature "
            f"({student!r}), got {teacher!r}"
        )


def check_floating(name: str, value: object, shape: str = "") -> Tensor:
    """A floating-point tensor; ``shape`` (e.g. "[..., vocab]") describes it in the message."""
    if not isinstance(value, Tensor):
        described = f" of shape {shape}" if shape else ""
        raise TypeError(f"{name} must be a torch.Tensor{described}, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(
            f"{name} must be a floating-point tensor (float16, bfloat16, float32, float64), got {value.dtype}"
        )
    return value


def check_matrix(name: str, value: object, shape: str = "") -> Tensor:
    """A 2-D floating-point tensor."""
    value = check_floating(name, value, shape)
    if value.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(value.shape)}")
    return value


def check_labels(labels: object, shape: tuple[int, ...], meaning: str) -> Tensor:
    """A ``torch.long`` tensor of ``shape`` (``meaning`` explains it in the message)."""
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype != torch.long:
        raise TypeError(f"labels must have dtype torch.long (int64), got {labels.dtype}")
    _check_shape("labels", labels, shape, meaning)
    return labels


def check_same_device(owner: str, device: torch.device, named: list[tuple[str, Tensor]]) -> None:
    """Every named tensor lies on ``owner``'s ``device``."""
    for name, tensor in named:
        if tensor.device != device:
            raise ValueError(f"{name} must be on {owner}'s device {device}, got {tensor.device}")


def _check_shape(name: str, tensor: Tensor, expected: tuple[int, ...], meaning: str) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name} must have shape {expected} ({meaning}), got {tuple(tensor.shape)}")


def teacher_tensors(teacher: object) -> list[tuple[str, Tensor]]:
    """The named tensors of a teacher descriptor (TypeError for anything else)."""
    if not isinstance(teacher, (TiedTeacher, SeparateTeacher, PrecomputedTeacher)):
        raise TypeError(
            f"teacher must be a TiedTeacher, SeparateTeacher or PrecomputedTeacher, got {type(teacher).__name__}"
        )
    return [(f"teacher.{name}", tensor) for name, tensor in teacher.named_tensors()]


def check_inputs(
    student_hidden: object,
    weight: object,
    labels: object,
    teacher: object,
    *,
    sharded: bool = False,
    row_shards: int = 1,
) -> None:
    """Types, shapes and devices of the tensors of a call (no host synchronization).

    ``sharded``: the heads are vocabulary shards, whose column counts the tensor-parallel layout
    checks across ranks (so that every rank raises the same error). ``row_shards``: under
    sequence parallelism the hidden states hold ``labels.shape[0] / row_shards`` rows.
    """
    hidden = check_matrix("student_hidden", student_hidden)
    head = check_matrix("weight", weight)
    rows, width = hidden.shape
    vocab = head.shape[0]
    _check_shape("weight", head, (vocab, width), "vocab × hidden, matching student_hidden's hidden size")
    label_rows = rows * row_shards
    meaning = "one label per row of student_hidden" + (f" on each of {row_shards} ranks" if row_shards > 1 else "")
    labels = check_labels(labels, (label_rows,), meaning)
    named = teacher_tensors(teacher)

    def columns_of(tensor: Tensor, axis: int) -> int:
        return tensor.shape[axis] if sharded else vocab

    if isinstance(teacher, TiedTeacher):
        _check_shape("teacher.hidden", teacher.hidden, (rows, width), "same shape as student_hidden")
    elif isinstance(teacher, SeparateTeacher):
        depth = teacher.hidden.shape[1]
        _check_shape("teacher.hidden", teacher.hidden, (rows, depth), "one row per row of student_hidden")
        _check_shape(
            "teacher.weight", teacher.weight, (columns_of(teacher.weight, 0), depth), "the student's vocab size"
        )
    else:
        assert isinstance(teacher, PrecomputedTeacher)
        if teacher.logits is not None:
            expected = (label_rows, columns_of(teacher.logits, 1))
            _check_shape("teacher.logits", teacher.logits, expected, "one row per label × the student's vocab size")
        else:
            assert teacher.teacher_hidden is not None and teacher.teacher_weight is not None
            depth = teacher.teacher_hidden.shape[1]
            _check_shape(
                "teacher.teacher_hidden", teacher.teacher_hidden, (rows, depth), "one row per row of student_hidden"
            )
            expected = (columns_of(teacher.teacher_weight, 0), depth)
            _check_shape("teacher.teacher_weight", teacher.teacher_weight, expected, "the student's vocab size")
    check_same_device("student_hidden", hidden.device, [("weight", head), ("labels", labels), *named])


def check_label_range(labels: Tensor, vocab_size: int, ignore_index: int) -> None:
    """Every label is ``ignore_index`` or in ``[0, vocab_size)`` (synchronizes with the device)."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"labels must lie in [0, {vocab_size}) or equal ignore_index={ignore_index}; "
            f"labels[{row}] = {int(labels[row])} ({int(bad.sum())} such rows)"
        )


def non_finite_mask(tensor: Tensor, *, allow_neg_inf: bool = False) -> Tensor:
    """Where ``tensor`` holds NaN or +inf (or −inf, unless allowed)."""
    bad = torch.isnan(tensor) | (tensor == float("inf"))
    if not allow_neg_inf:
        bad |= tensor == float("-inf")
    return bad


def first_non_finite(tensor: Tensor, *, allow_neg_inf: bool = False) -> tuple[int, ...] | None:
    """Index of the first NaN/+inf (and −inf unless allowed) value, or None (synchronizes)."""
    bad = non_finite_mask(tensor, allow_neg_inf=allow_neg_inf)
    return tuple(bad.nonzero()[0].tolist()) if bool(bad.any()) else None


def check_finite(name: str, tensor: Tensor, *, allow_neg_inf: bool = False) -> None:
    """Raise if ``tensor`` holds NaN or +inf (and −inf unless allowed); names the first bad row."""
    index = first_non_finite(tensor, allow_neg_inf=allow_neg_inf)
    if index is not None:
        count = int(non_finite_mask(tensor, allow_neg_inf=allow_neg_inf).sum())
        allowed = "finite or -inf" if allow_neg_inf else "finite"
        raise ValueError(
            f"{name} must be {allowed}; row {index[0]} holds {tensor[index].item()} at index {list(index)} "
            f"({count} such values)"
        )


def _teacher_kind(teacher: TiedTeacher | SeparateTeacher | PrecomputedTeacher) -> str:
    if isinstance(teacher, TiedTeacher):
        return "tied"
    if isinstance(teacher, SeparateTeacher):
        return "separate"
    return "precomputed_logits" if teacher.logits is not None else "precomputed_hidden"


def build_plan(
    options: LossOptions, teacher: TiedTeacher | SeparateTeacher | PrecomputedTeacher, vocab_size: int
) -> LossPlan:
    """Resolve the teacher-dependent defaults and the routing (docs/variants.md §2)."""
    divergence = get_divergence(options.kl_divergence)
    kind = _teacher_kind(teacher)
    precomputed = kind.startswith("precomputed")
    if divergence.cotrains_teacher and precomputed:
        raise ValueError(
            f"kl_divergence={divergence.name!r} trains the teacher and needs a TiedTeacher or SeparateTeacher; "
            "got a PrecomputedTeacher (use a teacher-detached variant such as 'jeffreys')"
        )
    student_temperature = options.kl_temperature
    tempered = teacher.logits_temperature if isinstance(teacher, PrecomputedTeacher) else None
    if tempered is not None:
        # A cache already divided by its declared temperature is used as it is (as orda-kernel does);
        # an explicit teacher temperature must name that same temperature.
        if options.kl_teacher_temperature not in (None, tempered):
            raise ValueError(
                f"kl_teacher_temperature={options.kl_teacher_temperature!r} disagrees with "
                f"PrecomputedTeacher(logits_temperature={tempered!r}), a cache already divided by {tempered!r}; "
                "leave kl_teacher_temperature=None (the cache is used as it is), or pass the raw logits "
                "without logits_temperature"
            )
        teacher_temperature = 1.0
    elif options.kl_teacher_temperature is not None:
        teacher_temperature = options.kl_teacher_temperature
    else:
        teacher_temperature = student_temperature
    _check_cotrained_temperatures(divergence, student_temperature, teacher_temperature)
    teacher_ce_weight = options.teacher_ce_weight
    if teacher_ce_weight is None:
        teacher_ce_weight = 1.0 if kind == "tied" else 0.0
    if isinstance(teacher, PrecomputedTeacher) and teacher.logits_temperature is not None and teacher_ce_weight > 0:
        # The teacher CE is LSE(t) − t_y on raw logits; a tempered cache holds t / T only.
        raise ValueError(
            f"teacher_ce_weight={teacher_ce_weight} needs raw teacher logits, but "
            f"PrecomputedTeacher(logits_temperature={teacher.logits_temperature!r}) declares a cache already "
            "divided by that temperature, from which the teacher CE cannot be formed; pass teacher_ce_weight=0.0, "
            "or pass the raw logits without logits_temperature (the KL then divides them by kl_teacher_temperature)"
        )
    if divergence.cotrains_teacher and options.kl_weight > 0:
        role = "cotrained"
    elif teacher_ce_weight > 0:
        role = "trained"
    else:
        role = "frozen"
    if isinstance(teacher, TiedTeacher) and teacher.mode is not None and teacher.mode != role:
        raise ValueError(
            f"TiedTeacher.mode={teacher.mode!r} but the loss weights make the teacher {role!r} "
            f"(teacher_ce_weight={teacher_ce_weight}, kl_weight={options.kl_weight}, kl_divergence={divergence.name!r})"
        )
    params = with_vocabulary(
        divergence, divergence.resolve(options.kl_alpha, options.kl_beta, options.entropy_gate), vocab_size
    )
    return LossPlan(
        student_ce_weight=options.student_ce_weight,
        teacher_ce_weight=teacher_ce_weight,
        kl_weight=options.kl_weight,
        student_temperature=student_temperature,
        teacher_temperature=teacher_temperature,
        divergence=divergence,
        params=params,
        reduction=options.reduction,
        ignore_index=options.ignore_index,
        teacher_kind=kind,
        teacher_role=role,
        config=options.config,
    )


@dataclass(frozen=True)
class ParallelOptions:
    """The validated tensor-parallel keywords (docs/reference.md §1, tensor-parallel keywords)."""

    tp_group: object
    vocab_range: tuple[int, int] | None
    vocab_size: int | None
    sequence_parallel: bool | None


def resolve_parallel_options(
    *, tp_group: object, vocab_range: object, vocab_size: object, sequence_parallel: object
) -> ParallelOptions:
    """Check the types and ranges of the tensor-parallel keywords (the group itself is checked
    when the call resolves its layout)."""
    if vocab_range is not None:
        if (
            not isinstance(vocab_range, (tuple, list))
            or len(vocab_range) != 2
            or not all(_is_int(v) for v in vocab_range)
            or not 0 <= vocab_range[0] <= vocab_range[1]
        ):
            raise ValueError(
                f"vocab_range must be a pair of ints (start, stop) with 0 <= start <= stop, got {vocab_range!r}"
            )
        vocab_range = (int(vocab_range[0]), int(vocab_range[1]))
    if vocab_size is not None and (not _is_int(vocab_size) or int(vocab_size) < 1):
        raise ValueError(f"vocab_size must be a positive int or None, got {vocab_size!r}")
    if sequence_parallel is not None and not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be a bool or None, got {sequence_parallel!r}")
    return ParallelOptions(
        tp_group=tp_group,
        vocab_range=vocab_range,
        vocab_size=None if vocab_size is None else int(vocab_size),
        sequence_parallel=sequence_parallel,
    )
