"""Checks of a call's arguments: scalars; tensors' types, shapes and devices (no host read); values
(a host read, where it costs nothing or is asked for). Every bad input raises a ValueError or
TypeError naming the argument, what was expected and what was received; nothing is clamped."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral, Real
from types import FrameType
from typing import TypeGuard

import torch
from torch import Tensor

# Its one import of orda_tp (the descriptors whose shapes and values it checks): any other module may use this one.
from ..teachers import TeacherSource

__all__ = [
    "IgnoredArgumentWarning",
    "caller_stacklevel",
    "check_choice",
    "check_count",
    "check_denominator",
    "check_finite",
    "check_flag",
    "check_floating",
    "check_ignore_index",
    "check_inputs",
    "check_label_range",
    "check_labels",
    "check_number",
    "check_same_device",
    "check_shape",
    "runs_host_checks",
    "check_values",
    "ValueChecks",
    "first_non_finite",
    "is_int",
]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class IgnoredArgumentWarning(UserWarning):
    """A keyword that has no effect on this call was given, and is ignored: e.g. ``kl_alpha`` with
    a variant that reads no ``kl_alpha``."""


def is_int(value: object) -> TypeGuard[Integral]:
    """An integer (``int`` or e.g. a NumPy integer), not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_number(name: str, value: object, *, positive: bool) -> float:
    """A finite real ≥ 0 (a loss weight), or > 0 when ``positive`` (a temperature, a scale), as a
    float."""
    real = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(float(value))
    if not real or float(value) < 0 or (positive and float(value) == 0):  # type: ignore[arg-type]
        raise ValueError(f"{name} must be a finite real number {'>' if positive else '>='} 0, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def check_flag(name: str, value: object) -> bool:
    """A real bool: a truthy string such as "no" must not read as True."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_count(name: str, value: object, minimum: int) -> int:
    """An int (not a bool) ≥ ``minimum``."""
    if not is_int(value) or int(value) < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    """One of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def check_ignore_index(ignore_index: object) -> int:
    """An integer that fits in torch.long, like the labels it is compared with, as an ``int``."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, Integral):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if not INT64_MIN <= int(ignore_index) <= INT64_MAX:
        raise ValueError(f"ignore_index must fit in torch.long (int64) like the labels, got {ignore_index!r}")
    return int(ignore_index)


# Frames of these directories sit between a user's call and a warning (torch's are the
# torch.compiler.disable wrappers around the public entry points).
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(path)) + os.sep for path in (__file__, torch.__file__))


def _in_library(frame: FrameType) -> bool:
    """A frame of orda_tp or torch: by file, or by module for code without a file of its own (a
    dataclass's generated ``__init__``)."""
    module = str(frame.f_globals.get("__name__", ""))
    return frame.f_code.co_filename.startswith(_LIBRARY_DIRS) or module.split(".")[0] == "orda_tp"


def caller_stacklevel() -> int:
    """``stacklevel`` for a ``warnings.warn`` in the calling function that names the first frame outside
    orda_tp and torch: the user's line, so that Python's default filter shows it once per call site."""
    level = 1
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and _in_library(frame):
        level, frame = level + 1, frame.f_back
    return level


def check_floating(name: str, value: object, shape: str = "", *, dims: int | None = None) -> Tensor:
    """A floating-point tensor, with ``dims`` dimensions when given (2: a matrix); ``shape``
    (e.g. "[..., vocab]") describes it in the message."""
    if not isinstance(value, Tensor):
        described = f" of shape {shape}" if shape else ""
        raise TypeError(f"{name} must be a torch.Tensor{described}, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(
            f"{name} must be a floating-point tensor (float16, bfloat16, float32, float64), got {value.dtype}"
        )
    if dims is not None and value.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(value.shape)}")
    return value


def check_labels(labels: object, shape: tuple[int, ...], meaning: str) -> Tensor:
    """A ``torch.long`` tensor of ``shape`` (``meaning`` explains it in the message)."""
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype != torch.long:
        raise TypeError(f"labels must have dtype torch.long (int64), got {labels.dtype}")
    check_shape("labels", labels, shape, meaning)
    return labels


def check_same_device(owner: str, device: torch.device, named: list[tuple[str, Tensor]]) -> None:
    """Every named tensor lies on ``owner``'s ``device``."""
    for name, tensor in named:
        if tensor.device != device:
            raise ValueError(f"{name} must be on {owner}'s device {device}, got {tensor.device}")


def check_shape(name: str, tensor: Tensor, expected: tuple[int, ...], meaning: str) -> None:
    """``tensor`` has shape ``expected`` (``meaning`` explains it in the message)."""
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name} must have shape {expected} ({meaning}), got {tuple(tensor.shape)}")


def check_inputs(
    student_hidden: object,
    weight: object,
    labels: object,
    teacher: TeacherSource,
    *,
    sharded: bool = False,
    row_shards: int = 1,
    vocab_size: int | None = None,
    bias: object = None,
) -> None:
    """Types, shapes and devices of the tensors of a call (no host synchronization). ``sharded``: the
    heads are vocabulary shards, whose column counts the layout handshake compares across ranks.
    ``row_shards``: under sequence parallelism the hidden states hold ``labels.shape[0] / row_shards``
    rows. ``vocab_size`` (one device): the real vocabulary, at most the head's rows. ``bias``: the
    head's bias (None: none), one entry per row of ``weight``."""
    hidden = check_floating("student_hidden", student_hidden, dims=2)
    head = check_floating("weight", weight, dims=2)
    rows, width = hidden.shape
    # A (hidden × vocab) weight would fail the shape check below too; this message says what to pass.
    if head.shape[1] != width and head.shape[0] == width:
        raise ValueError(
            f"weight must have shape (vocab, {width}) (vocab × hidden, matching student_hidden's hidden size), got "
            f"{tuple(head.shape)}: it looks transposed (hidden × vocab); pass the LM head's weight as nn.Linear "
            "stores it (vocab rows), e.g. weight.T"
        )
    check_shape("weight", head, (head.shape[0], width), "vocab × hidden, matching student_hidden's hidden size")
    label_rows = rows * row_shards
    meaning = "one label per row of student_hidden" + (f" on each of {row_shards} ranks" if row_shards > 1 else "")
    labels = check_labels(labels, (label_rows,), meaning)
    for expected in teacher.expected_shapes(rows, width, label_rows, None if sharded else head.shape[0]):
        check_shape(expected.name, expected.tensor, expected.shape, expected.meaning)
    named = [(f"teacher.{name}", tensor) for name, tensor in teacher.named_tensors()]
    if bias is not None:
        named.append(("bias", check_floating("bias", bias, dims=1)))
        check_shape("bias", named[-1][1], (head.shape[0],), "one entry per row of weight")
    check_same_device("student_hidden", hidden.device, [("weight", head), ("labels", labels), *named])
    if vocab_size is not None and vocab_size > head.shape[0]:
        raise ValueError(f"vocab_size must be <= the head's {head.shape[0]} rows, got {vocab_size}")


@dataclass(frozen=True)
class ValueChecks:
    """The checks of a call's values, where one can fail (``LossPlan.checks_values``)."""

    teacher: TeacherSource  # as the call received it, whose cached tensors' versions were recorded
    local_teacher: TeacherSource  # the same over this rank's shards
    reads_teacher: bool  # the call reads the teacher's logits, so a cache's values are read
    inputs: Sequence[tuple[str, Tensor]] = ()  # with check_finite_inputs, the other tensors it covers


def check_values(values: ValueChecks, columns: int, host_checks: bool) -> None:
    """One device: raise on a cache modified in place; where host checks run and the teacher's logits
    are read, on a non-finite or invalid cache value (``columns``: the real columns, the padding is
    not read); with ``values.inputs`` (``check_finite_inputs``), on a non-finite input or trainable
    teacher tensor. Tensor parallelism: :func:`orda_tp.parallel.local_shards.local_error`."""
    teacher, read_cache = values.local_teacher, host_checks and values.reads_teacher
    if not teacher.trainable:  # a cache: unchanged since it was built, and valid where it is read
        values.teacher.check_unmodified()
        for check in teacher.checked_values(columns) if read_cache else []:
            check_finite(check.name, check.tensor, allow_neg_inf=check.allow_neg_inf)
        if read_cache:
            teacher.check_cache_values(columns)
    if values.inputs:
        for name, tensor in [*values.inputs, *teacher.trained_tensors()]:
            check_finite(name, tensor)


def check_token_weights(token_weights: object, labels: Tensor, host_checks: bool) -> Tensor:
    """``token_weights``, a (rows,) real floating-point tensor on the labels' device, one weight
    per label, that does not require grad (no gradient reaches it); finite where ``host_checks``
    run (which reads the values)."""
    if not isinstance(token_weights, Tensor) or not token_weights.is_floating_point():
        given = f"dtype {token_weights.dtype}" if isinstance(token_weights, Tensor) else type(token_weights).__name__
        raise TypeError(f"token_weights must be a floating-point tensor or None, got {given}")
    rows = labels.shape[0]
    if token_weights.shape != (rows,):
        shape = tuple(token_weights.shape)
        raise ValueError(f"token_weights must have shape ({rows},), one weight per label, got {shape}")
    if token_weights.device != labels.device:
        raise ValueError(f"token_weights must be on the labels' device {labels.device}, got {token_weights.device}")
    if token_weights.requires_grad:
        raise ValueError("token_weights must not require grad (no gradient reaches them); pass token_weights.detach()")
    if host_checks:
        check_finite("token_weights", token_weights)
    return token_weights


def check_denominator(
    name: str, value: object, reduction: str, device: torch.device, owner: str
) -> float | Tensor | None:
    """A given denominator N of "mean" (``num_valid_tokens``, ``num_batch_labels``): None when not
    given (the caller counts the valid rows), a finite real > 0 as a float, or a real one-element
    tensor on ``owner``'s ``device``, as a 0-d tensor whose value is never read on the host."""
    if value is None:
        return None
    if reduction != "mean":
        raise ValueError(f"{name} is the denominator of reduction='mean'; got reduction={reduction!r}")
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(
                f"{name} must be a real one-element tensor, got shape {tuple(value.shape)} and dtype {value.dtype}"
            )
        if value.device != device:
            raise ValueError(f"{name} must be on {owner}'s device {device}, got {value.device}")
        # Used on the device as it is: reading it (a finiteness check) would synchronize with the device.
        return value.reshape(())
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a number, a one-element tensor or None, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return float(value)


def runs_host_checks(setting: bool | None, device: torch.device) -> bool:
    """Whether the checks that read tensor values on the host run for tensors on ``device``:
    ``setting`` (``KernelConfig.host_checks``) when given, else for CPU tensors only (on CUDA a
    read would synchronize with the device)."""
    return device.type == "cpu" if setting is None else setting


def check_label_range(labels: Tensor, vocab_size: int, ignore_index: int | None, *, one_device: bool = False) -> None:
    """Every label is ``ignore_index`` (None: none is) or in ``[0, vocab_size)`` (synchronizes with
    the device). ``one_device``: a call without tensor parallelism, whose head may be a shard passed
    without its ``tp_group`` (the message then says so)."""
    bad = (labels < 0) | (labels >= vocab_size)
    if ignore_index is not None:
        bad &= labels != ignore_index
    # The one host read of a passing check; the rest runs only to word the error.
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        hint = ""
        # A label past the head's rows on one device: perhaps a global id, and the head a shard without its group.
        if one_device and bool((labels[bad] >= vocab_size).any()):
            hint = (
                f"; if the head (or the logits) is one rank's vocabulary shard of a larger vocabulary ({vocab_size} "
                "of its entries here), pass tp_group= (or a DTensor sharded along the vocabulary) so that labels "
                "are read as global ids"
            )
        ignored = "" if ignore_index is None else f" or equal ignore_index={ignore_index}"
        raise ValueError(
            f"labels must lie in [0, {vocab_size}){ignored}; labels[{row}] = {int(labels[row])} ({int(bad.sum())} "
            f"such rows){hint}"
        )


def non_finite_mask(tensor: Tensor, *, allow_neg_inf: bool = False) -> Tensor:
    """Where ``tensor`` holds NaN or +inf (or −inf, unless allowed)."""
    bad = torch.isnan(tensor) | (tensor == float("inf"))
    # −inf is allowed where it means no mass (a logits cache's impossible token); NaN and +inf never are.
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
