"""Triton kernels for the per-block statistics and logit gradients.

One kernel per file, each an ordinary ``@triton.jit`` function specialized by ``tl.constexpr``
switches: :mod:`.partition` (round 1 and the merge of records), :mod:`.sums` (round 2),
:mod:`.grads` (the logit gradients), :mod:`.rows` (a row step between the passes) and
:mod:`.scale`; :mod:`.block_io` holds how they walk a block. What differs between variants, and
between row steps, is generated from the expression trees (:mod:`.variant_terms`) into functions
that the kernels are passed. Nothing here knows the engine: ``orda_tp.engine.triton_math``
launches them. :func:`print_kernel` prints any kernel with the functions it is passed. They run on
CUDA devices, and on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, used by the tests).
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
