"""The engine: the backends that compute a loss, and the row walk they share.

Backends: ``reference`` (full logits, the oracle: :mod:`.reference`), ``torch`` and ``triton``
(chunked: rows in chunks, columns in blocks, never a (BT, V) tensor), which differ only in their
per-block math (:mod:`.torch_math`, :mod:`.triton_math`).

- :mod:`.row_walk`: the one row walker of the fused path and the logits-level losses; it reads
  logits blocks from :mod:`.logits` and runs a chunk's statistics rounds (:mod:`.rounds`), whose
  row steps are the programs of :mod:`.row_formulas`, unpacked into :mod:`.stats`.
- :mod:`.fused`: the fused loss's autograd Function (logits from hidden states and head weights,
  :mod:`.head`), with its row groups' gradient GEMMs (:mod:`.fused_grads`, :mod:`.gemm`).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from ..kernels import unavailable_reason

if TYPE_CHECKING:
    from .block_math import BlockMath

__all__ = ["block_math_of", "select_backend"]

_warned_fallback = False


def select_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend that runs a call: ``requested``, or for "auto" the best one available.

    "auto" takes the Triton kernels on a CUDA device with fp16/bf16/fp32 inputs, and otherwise the
    chunked torch backend; on a CUDA device it says once why it fell back.
    """
    global _warned_fallback
    if requested in ("reference", "torch"):
        return requested
    reason = unavailable_reason(device, dtype)
    if requested == "triton":
        if reason is not None:
            raise ValueError(f"backend='triton' is unavailable on this machine: {reason}")
        return "triton"
    if reason is None and device.type == "cuda":
        return "triton"
    if device.type == "cuda" and not _warned_fallback:
        _warned_fallback = True
        warnings.warn(f"orda_tp: backend='auto' runs the chunked torch backend because {reason}", stacklevel=3)
    return "torch"


def block_math_of(backend: str) -> BlockMath:
    """The per-block math of a selected chunked backend ("torch" or "triton")."""
    if backend == "triton":
        from .triton_math import TritonBlockMath

        return TritonBlockMath()
    from .torch_math import TorchBlockMath

    return TorchBlockMath()
