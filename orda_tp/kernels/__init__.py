"""Triton kernels for the per-block statistics and logit gradients, one job per file; what differs
between variants and row steps is generated from the expression trees (:mod:`.variant_terms`).
They know nothing of the engine, which launches them, and run on CUDA devices or under Triton's CPU
interpreter (``TRITON_INTERPRET=1``); docs/architecture.md, "The Triton backend: kernel design".
"""

from __future__ import annotations

import importlib.util
import os

import torch

from .source import kernel_source, print_kernel

__all__ = ["is_available", "kernel_source", "print_kernel", "unavailable_reason"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreted() -> bool:
    """Whether Triton kernels run under its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def unavailable_reason(device: torch.device | None = None, dtype: torch.dtype | None = None) -> str | None:
    """Why the Triton kernels cannot run for inputs on ``device`` with ``dtype``, or None."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install triton, or pip install -e '.[gpu]' from the clone)"
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        return f"the Triton kernels take float16, bfloat16 or float32 inputs, not {dtype} (use backend='torch')"
    if device is None:
        return None if torch.cuda.is_available() or interpreted() else "no CUDA device"
    if device.type == "cuda" or (device.type == "cpu" and interpreted()):
        return None
    return f"the Triton kernels need a CUDA device (or TRITON_INTERPRET=1), got {device.type} tensors"


def is_available() -> bool:
    """True when the Triton kernels can run on this machine's CUDA device."""
    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()
