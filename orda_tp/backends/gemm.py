"""The GEMMs of the chunked loop, with fp32 (or fp64) results.

Logits must not be rounded to bf16/fp16 before the statistics, and gradients accumulate in the
statistics dtype. fp16/bf16 operands on CUDA run on the tensor cores with an fp32 result
(``torch.mm(a, b, out_dtype)``); anything else is cast to the statistics dtype first.

For the gradient GEMMs the fp32 logit gradients are materialized in the operands' dtype: bf16 as
they are, fp16 only with a ``scale`` (``gradient_materialization_scale``, or the GradScaler's
scale) that keeps the small gradients out of fp16's subnormal range, lowered per block (on the
device, no synchronization) where it would push the largest gradient past fp16's range; the
result is divided by it. Without a scale fp16 gradient GEMMs run in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["GemmPolicy", "logits_mm"]

LOW_PRECISION = (torch.float16, torch.bfloat16)
FP16_HEADROOM = 6.0e4  # below fp16's largest finite value, 65504
_ADDMM_OUT_DTYPE = [True]  # cleared once if this torch has no addmm(..., out_dtype=...)


def _tensor_cores(a: Tensor, b: Tensor) -> bool:
    return a.is_cuda and a.dtype == b.dtype and a.dtype in LOW_PRECISION


def logits_mm(hidden: Tensor, weight_block: Tensor, dtype: torch.dtype) -> Tensor:
    """``hidden · weight_blockᵀ`` in ``dtype`` (fp32/fp64), never rounded through the inputs' dtype."""
    if _tensor_cores(hidden, weight_block) and dtype == torch.float32:
        return torch.mm(hidden, weight_block.T, torch.float32)
    return hidden.to(dtype) @ weight_block.to(dtype).T


@dataclass(frozen=True)
class GemmPolicy:
    """How logit gradients meet the gradient GEMMs: ``scale`` for fp16 materialization."""

    scale: float | None = None

    def grad_mm(self, dlogits: Tensor, operand: Tensor) -> Tensor:
        """``dlogits · operand`` in the statistics dtype of ``dlogits``."""
        dtype = dlogits.dtype
        if _tensor_cores(operand, operand) and dtype == torch.float32:
            if operand.dtype == torch.bfloat16:
                return torch.mm(dlogits.to(torch.bfloat16), operand, torch.float32)
            if self.scale is not None:
                # Lowered on the device where scale·max|gradient| would leave fp16's range.
                factor = torch.clamp(FP16_HEADROOM / dlogits.abs().amax(), max=self.scale)
                scaled = (dlogits * factor).to(torch.float16)
                return torch.mm(scaled, operand, torch.float32) / factor
        return dlogits @ operand.to(dtype)

    def accumulate(self, target: Tensor, dlogits: Tensor, operand: Tensor) -> None:
        """``target += dlogits · operand``: for bf16 operands on CUDA one GEMM that adds into the
        fp32 target in its epilogue (no separate pass over the target), else product then add."""
        if (
            _ADDMM_OUT_DTYPE[0]
            and _tensor_cores(operand, operand)
            and operand.dtype == torch.bfloat16
            and target.dtype == torch.float32
            and target.is_contiguous()
        ):
            try:
                torch.addmm(target, dlogits.to(torch.bfloat16), operand, out_dtype=torch.float32, out=target)
                return
            except (TypeError, RuntimeError):  # a torch without addmm(out_dtype=...)
                _ADDMM_OUT_DTYPE[0] = False
        target += self.grad_mm(dlogits, operand)
