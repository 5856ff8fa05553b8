"""The GEMMs of the chunked loop: fp32 (or fp64) logits, and the gradient GEMMs on staged
logit gradients.

Logits must not be rounded to bf16/fp16 before the statistics: fp16/bf16 operands on CUDA run on
the tensor cores with an fp32 result (``torch.mm(a, b, out_dtype)``); anything else is cast to
the statistics dtype first.

Logit gradients are staged for the gradient GEMMs in :meth:`GemmPolicy.staging_dtype`: bf16 as
they are for bf16 operands on CUDA (the kernels write them once, in bf16); otherwise in the
statistics dtype. fp16 operands then meet an fp32 staging through a ``scale``
(``gradient_materialization_scale``, or the GradScaler's scale, a number or a device tensor) that
keeps the small gradients out of fp16's subnormal range, lowered on the device where it would push
the largest gradient past fp16's range; the product is divided by it. Without a scale fp16
gradient GEMMs run in fp32.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["GemmPolicy", "full_precision_reductions", "logits_mm"]

LOW_PRECISION = (torch.float16, torch.bfloat16)
FP16_HEADROOM = 6.0e4  # below fp16's largest finite value, 65504
_ADDMM_OUT_DTYPE = [True]  # cleared once if this torch has no addmm(..., out_dtype=...)


@contextmanager
def full_precision_reductions() -> Iterator[None]:
    """Within it, cuBLAS may not reduce split-K partial sums in bf16/fp16 (torch allows that by
    default for bf16/fp16 outputs): a gradient GEMM then rounds once, to its output, as its fp32-output
    counterpart on a vocabulary shard does."""
    flags = torch.backends.cuda.matmul
    saved = (flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction)
    flags.allow_bf16_reduced_precision_reduction = False
    flags.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction = saved


def _tensor_cores(a: Tensor, b: Tensor) -> bool:
    return a.is_cuda and a.dtype == b.dtype and a.dtype in LOW_PRECISION


def logits_mm(hidden: Tensor, weight_block: Tensor, dtype: torch.dtype) -> Tensor:
    """``hidden · weight_blockᵀ`` in ``dtype`` (fp32/fp64), never rounded through the inputs' dtype."""
    if _tensor_cores(hidden, weight_block) and dtype == torch.float32:
        return torch.mm(hidden, weight_block.T, torch.float32)
    return hidden.to(dtype) @ weight_block.to(dtype).T


@dataclass(frozen=True)
class GemmPolicy:
    """How staged logit gradients meet the gradient GEMMs: ``scale`` for fp16 materialization."""

    scale: float | Tensor | None = None

    @staticmethod
    def staging_dtype(operands: Sequence[Tensor], statistics: torch.dtype) -> torch.dtype:
        """The dtype logit gradients are staged in for the gradient GEMMs with ``operands`` (the
        head weights and hidden states they meet): bf16 when every operand is a bf16 CUDA tensor,
        else the statistics dtype."""
        if statistics == torch.float32 and all(t.is_cuda and t.dtype == torch.bfloat16 for t in operands):
            return torch.bfloat16
        return statistics

    def accumulate(self, target: Tensor, staged: Tensor, operand: Tensor) -> None:
        """``target += staged · operand`` with ``staged`` in :meth:`staging_dtype`.

        bf16 on CUDA: one GEMM that adds into ``target`` in its epilogue (fp32 or bf16 target,
        fp32 accumulation inside the GEMM). fp16 with a scale: the staged fp32 gradient is scaled
        into fp16 for the tensor cores and the product unscaled. Otherwise in ``staged``'s dtype."""
        if staged.dtype == torch.bfloat16:
            if target.dtype == torch.bfloat16:
                target.addmm_(staged, operand)
                return
            if _ADDMM_OUT_DTYPE[0] and target.dtype == torch.float32 and target.is_contiguous():
                try:
                    torch.addmm(target, staged, operand, out_dtype=torch.float32, out=target)
                    return
                except TypeError:  # a torch without addmm(out_dtype=...)
                    _ADDMM_OUT_DTYPE[0] = False
            target += torch.mm(staged, operand, torch.float32).to(target.dtype)
            return
        if _tensor_cores(operand, operand) and operand.dtype == torch.float16 and self.scale is not None:
            # Lowered on the device where scale·max|gradient| would leave fp16's range.
            factor = torch.clamp(FP16_HEADROOM / staged.abs().amax(), max=self.scale)
            scaled = (staged * factor).to(torch.float16)
            target += (torch.mm(scaled, operand, torch.float32) / factor).to(target.dtype)
            return
        target += (staged @ operand.to(staged.dtype)).to(target.dtype)
