"""The per-block math of a row walk (:class:`BlockMath`, the seam between the backends: torch ops
or Triton kernels) and the one backend table (:func:`select_backend`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
from torch import Tensor

from ..arguments.plan import LogitFamily, LossPlan
from ..arguments.validation import caller_stacklevel
from ..divergences.expr import Expr
from ..kernels import unavailable_reason
from .logits import LogitGrads, TeacherBlock
from .row_formulas import RowProgram
from .stats import GradRows
from .topk_rows import TopKRows
from .torch_math import TorchBlockMath

__all__ = ["BlockMath", "select_backend"]


class BlockMath(Protocol):
    #: Whether stored logits (a teacher cache, the logits-level losses' inputs) may arrive as
    #: stored (bf16/fp16 views) instead of converted to the statistics dtype.
    reads_stored_cache: bool
    #: Whether it applies the plan's soft-caps to the raw blocks it reads (the Triton kernels, as
    #: they load a tile); else it is handed blocks already capped by the logits source.
    applies_softcap: bool
    #: Whether a chunk's local columns form one block (the kernels tile the columns themselves),
    #: else blocks of ``KernelConfig.vocab_block`` columns (each block's temporaries are tensors).
    whole_blocks: bool

    def partition(
        self,
        student: Tensor,
        teacher: TeacherBlock | None,
        labels: Tensor,
        col_start: int,
        families: Sequence[LogitFamily],
        column_sums: tuple[Expr, ...],
        caps: tuple[float | None, float | None] = (None, None),
    ) -> Tensor:
        """The packed round-1 record (:mod:`.records`) of a block whose first column is global column
        ``col_start``: per family ``x = side/T`` the partial ``(max x, Σ e^{x − max x})`` (``(−inf,
        0)`` for an all −inf row), the raw logits at the label where the block holds it (else 0) and
        whether it does, and the row sums of ``column_sums`` (trees over the raw logits); ``caps``:
        the two sides' soft-caps, where the block math applies them (``applies_softcap``)."""
        ...

    def merge_stacked(self, stacked: Tensor, num_families: int) -> Tensor:
        """Merge an (S, rows, K₁) stack of contiguous packed records (a chunk's blocks, the shards'
        gathered records) into one (rows, K₁) record."""
        ...

    def topk(self, logits: Tensor, k: int, first_id: int, temperature: float, cap: float | None) -> TopKRows:
        """The best ``k`` columns of a block of logits scaled to ``cap(logits)/temperature``, whose
        column 0 is global id ``first_id``, and the block's log-partition (the top-k extraction's
        step; ``logits`` is read, never written)."""
        ...

    def kl_sums(
        self,
        plan: LossPlan,
        student: Tensor,
        teacher: TeacherBlock | None,
        labels: Tensor,
        col_start: int,
        lse_u: Tensor,
        lse_v: Tensor,
    ) -> Tensor:
        """(rows, len(plan.round_two_terms)) round-2 sums over the block's columns of the plan's
        column terms (the variant's, then the student entropy's) of ``log p = s/T_s − LSE(u)``,
        ``log q = t/T_t − LSE(v)``, ``p`` and ``q`` (``teacher`` None: no KL term, only the entropy's)."""
        ...

    def rows(
        self, program: RowProgram, values: Mapping[str, Tensor], scalars: Mapping[str, float], like: Tensor
    ) -> Tensor:
        """Run a row program: ``values`` maps its inputs to (rows,) tensors (any stride),
        ``scalars`` its scalars to floats; (rows, outputs) in ``like``'s dtype."""
        ...

    def stage_logit_grads(
        self,
        plan: LossPlan,
        rows: GradRows,
        student: Tensor,
        teacher: TeacherBlock | None,
        labels: Tensor,
        col_start: int,
        out: LogitGrads,
        sums_out: Tensor | None = None,
        accumulate: bool = False,
    ) -> None:
        """Write ``∂loss/∂s`` (and ``∂loss/∂t`` where ``out.teacher`` is not None) of the block
        into the views ``out``, in their dtype, from the chunk's gradient row constants
        (:class:`~orda_tp.engine.stats.GradRows`)::

            ∂loss/∂s = scale·(c_p·softmax(s) − c_y·onehot_y − c_u + w_kl_s·keep·∂D/∂u)
            ∂loss/∂t = scale·w_kl_t·keep·∂D/∂v + c_ce_t·(softmax(t) − onehot_y)

        (``w_kl_s, w_kl_t = plan.kl_grad_weights``; ``∂D/∂u``, ``∂D/∂v`` the variant's), exactly 0
        on rows whose ``scale`` is 0; a soft-capped side (``s = cap·tanh(z/cap)``) multiplies its
        gradient by ``∂s/∂z = 1 − (s/cap)²``. With
        ``sums_out`` (``plan.kl_sums_in_gradient_pass``) also add the block's round-2 sums into it,
        as :meth:`kl_sums` gives them; with ``accumulate``, add ``∂loss/∂s`` to what ``out.student``
        holds (a teacher mixture's later views; no teacher gradient then). ``keep`` is a weight: 1, or
        a mixture's ``w_i`` (0: no KL gradient, whatever ∂D holds)."""
        ...


# Cached per combination: the fallback's warning comes once, and every call's decision is the same.
@functools.cache
def select_backend(
    requested: str, device_type: str, dtype: torch.dtype, refused: str | None = None
) -> BlockMath | None:
    """The block math of the chunked backend that runs a call on ``device_type`` tensors whose
    statistics are ``dtype`` (None: the "reference" backend), for every door.

    "auto" takes the Triton kernels on a CUDA device with fp16/bf16/fp32 inputs, and otherwise the
    chunked torch backend, with a warning on a CUDA device; ``refused``: why the kernels cannot run
    this call although they run here, which "auto" also falls back on. An explicit "triton" that
    cannot run raises a ValueError.
    """
    if requested == "reference":
        return None
    if requested == "torch":
        return TorchBlockMath()
    unavailable = unavailable_reason(torch.device(device_type), dtype)
    if requested == "triton" and unavailable is not None:
        raise ValueError(f"backend='triton' is unavailable on this machine: {unavailable}")
    if requested == "triton" and refused is not None:
        raise ValueError(f"backend='triton' cannot run this call: {refused}")
    reason = unavailable or refused
    if reason is None and (requested == "triton" or device_type == "cuda"):
        from .triton_math import TritonBlockMath  # imports triton: only where it runs

        return TritonBlockMath()
    if device_type == "cuda":
        message = f"orda_tp: backend='auto' runs the chunked torch backend because {reason}"
        warnings.warn(message, stacklevel=caller_stacklevel())
    return TorchBlockMath()
