"""Checks of scalar arguments, and the warning for arguments that have no effect.

Every check raises a ValueError/TypeError that names the argument, what was expected and what
was received; nothing is clamped or reinterpreted. This module imports nothing of orda_tp, so
that every other module may use it.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from numbers import Integral, Real
from types import FrameType
from typing import TypeGuard

import torch

__all__ = [
    "IgnoredArgumentWarning",
    "caller_stacklevel",
    "check_choice",
    "check_count",
    "check_flag",
    "check_ignore_index",
    "check_loss_weight",
    "check_temperature",
    "is_int",
    "is_real",
]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class IgnoredArgumentWarning(UserWarning):
    """A keyword that has no effect on this call was given, and is ignored (orda-kernel accepts
    it silently): e.g. ``kl_alpha`` with a variant that reads no ``kl_alpha``."""


def is_real(value: object) -> TypeGuard[Real]:
    """A real number (``int``, ``float``, a NumPy scalar …), not a bool."""
    return isinstance(value, Real) and not isinstance(value, bool)


def is_int(value: object) -> TypeGuard[Integral]:
    """An integer (``int`` or e.g. a NumPy integer), not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_loss_weight(name: str, value: object) -> float:
    """A finite real ≥ 0, as a float."""
    if not is_real(value) or not math.isfinite(float(value)) or float(value) < 0:
        raise ValueError(f"{name} must be a finite real number >= 0, got {value!r}")
    return float(value)


def check_temperature(name: str, value: object) -> float:
    """A finite real > 0, as a float."""
    if not is_real(value) or not math.isfinite(float(value)) or float(value) <= 0:
        raise ValueError(f"{name} must be a finite real number > 0, got {value!r}")
    return float(value)


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
    if not is_int(ignore_index):
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
    """``stacklevel`` for a ``warnings.warn`` in the calling function that names the first frame
    outside orda_tp and torch: the user's line, so that Python's default filter shows the warning
    once per call site."""
    level = 1
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and _in_library(frame):
        level, frame = level + 1, frame.f_back
    return level
