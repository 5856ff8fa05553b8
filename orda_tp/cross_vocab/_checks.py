"""Argument checks of the cross-vocabulary tools: a TypeError or ValueError naming the argument, expected, got."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "check_choice",
    "check_floating_tensor",
    "check_positive_int",
    "check_real",
    "check_same_shapes",
]


def check_real(value: object, name: str, *, positive: bool = False) -> float:
    """``value`` as a float; it must be a finite real ``>= 0`` (``> 0`` when ``positive``)."""
    bound = "> 0" if positive else ">= 0"
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
    ):
        raise ValueError(f"{name} must be a finite real number {bound}, got {value!r}")
    return float(value)


def check_positive_int(value: object, name: str) -> int:
    """``value`` as an int; it must be an ``int`` (not a bool) ``> 0``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def check_choice(value: object, name: str, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def check_floating_tensor(value: object, name: str) -> torch.Tensor:
    """``value`` if it is a floating-point tensor with at least one dimension."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")
    if value.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension (..., vocab), got a 0-d tensor")
    return value


def check_same_shapes(tensors: Sequence[torch.Tensor], name: str) -> None:
    """Raise unless all ``tensors`` share the shape and device of the first one."""
    first = tensors[0]
    for k, tensor in enumerate(tensors[1:], start=1):
        if tensor.shape != first.shape:
            raise ValueError(
                f"{name}[{k}] must have the shape of {name}[0], {tuple(first.shape)}, got {tuple(tensor.shape)}"
            )
        if tensor.device != first.device:
            raise ValueError(f"{name}[{k}] must be on the device of {name}[0], {first.device}, got {tensor.device}")
