"""What a KL variant is: statistics it sums, how it finalizes, and its elementwise gradient.

Every variant works on normalized log-probabilities of one block of columns,
``log p = u − LSE(u)`` and ``log q = v − LSE(v)`` (``u = s/T_s``, ``v = t/T_t``), which exist once
the first statistics round (the log-partitions) is merged. A variant then

1. sums ``num_sums`` elementwise terms over the block's columns (:meth:`Divergence.block_sums`);
   the per-block sums of all blocks (or tensor-parallel shards) add up to the row's sums;
2. turns the merged sums into the row value ``D`` and the row constants its gradient needs
   (:meth:`Divergence.finalize`);
3. forms ``∂D/∂u`` (and ``∂D/∂v`` when it co-trains the teacher) from a block's columns and the
   row constants (:meth:`Divergence.student_grad`, :meth:`Divergence.teacher_grad`).

Tensors are (rows, cols) for blocks and (rows,) for rows; all arithmetic is in the statistics
dtype (fp32, or fp64 for fp64 inputs). Zero-support columns (p = 0 or q = 0, from −inf logits)
follow the conventions of SPEC §2: ``0·log 0 = 0`` and ``p·log(p/0) = +inf``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import EntropyGate

__all__ = [
    "BlockTerms",
    "Divergence",
    "DivergenceParams",
    "Finalized",
    "RowTargets",
    "power_gap",
    "xlogratio",
    "zero_where_both_zero",
]


@dataclass(frozen=True)
class DivergenceParams:
    """Hyper-parameters of a variant, resolved from the user's keywords and defaults.

    ``log_vocab`` is ``log V`` of the global real vocabulary (the entropy gate's normalizer).
    """

    alpha: float | None = None
    beta: float | None = None
    gate: EntropyGate | None = None
    log_vocab: float = 0.0


@dataclass(frozen=True)
class BlockTerms:
    """Normalized distributions of one block of columns for a chunk of rows."""

    logp: Tensor
    logq: Tensor
    p: Tensor
    q: Tensor
    is_target: Tensor | None = None  # (rows, cols) bool, only for variants with ``needs_target``


@dataclass(frozen=True)
class RowTargets:
    """Per-row values at the label column: ``log p_y`` and ``log q_y``."""

    logp_y: Tensor
    logq_y: Tensor


@dataclass(frozen=True)
class Finalized:
    """A row's divergence value ``D`` (before the T_s² factor) and its gradient's row constants."""

    value: Tensor
    consts: dict[str, Tensor]


class Divergence:
    """Base of the KL variants; each subclass defines one variant once."""

    name: str = ""
    parameters: tuple[str, ...] = ()
    """The keyword arguments the variant reads (``kl_alpha``, ``kl_beta``, ``entropy_gate``)."""
    cotrains_teacher: bool = False
    """True for mutual/cojeffreys: the KL also trains the teacher (no detach)."""
    needs_target: bool = False
    """True when the block sums need to know which column is the label (dkd)."""
    num_sums: int = 1

    def resolve(self, kl_alpha: float | None, kl_beta: float | None, gate: EntropyGate | None) -> DivergenceParams:
        """Fill defaults and validate the ranges of the parameters this variant uses."""
        return DivergenceParams()

    def block_sums(self, terms: BlockTerms, params: DivergenceParams) -> Tensor:
        """(rows, num_sums) partial sums over this block's columns."""
        raise NotImplementedError

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        """Row value ``D`` and gradient constants from the sums merged over all columns."""
        raise NotImplementedError

    def student_grad(self, terms: BlockTerms, consts: dict[str, Tensor], params: DivergenceParams) -> Tensor:
        """``∂D/∂u`` on the block's columns."""
        raise NotImplementedError

    def teacher_grad(self, terms: BlockTerms, consts: dict[str, Tensor], params: DivergenceParams) -> Tensor:
        """``∂D/∂v`` on the block's columns (co-training variants only)."""
        raise NotImplementedError(f"{self.name} does not train the teacher through the KL")


def xlogratio(x: Tensor, log_x: Tensor, log_y: Tensor) -> Tensor:
    """Elementwise ``x·(log x − log y)`` with ``0·(…) = 0`` where x = 0 (NaN stays NaN)."""
    return torch.where(x == 0, torch.zeros_like(x), x * (log_x - log_y))


def zero_where_both_zero(values: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """Zero the columns where both distributions vanish (padding, −inf in both)."""
    return torch.where((a == 0) & (b == 0), torch.zeros_like(values), values)


def power_gap(log_a: Tensor, log_b: Tensor, a: Tensor, b: Tensor, r: float) -> Tensor:
    """Elementwise ``a^r b^{1−r} − r·a − (1−r)·b``, whose column sum is ``Σ a^r b^{1−r} − 1``.

    Weighted AM–GM makes every term ≤ 0 for r ∈ (0,1) and ≥ 0 for r > 1, so the sum has no
    cancellation even when a ≈ b. With ``d = log a − log b``, factor out the larger of a, b:

    - d ≤ 0: ``b·(expm1(r d) − r·expm1(d))``
    - d > 0: ``a·(expm1(−(1−r) d) − (1−r)·expm1(−d))``
    """
    d = log_a - log_b
    low = b * (torch.expm1(r * d) - r * torch.expm1(d))
    high = a * (torch.expm1(-(1.0 - r) * d) - (1.0 - r) * torch.expm1(-d))
    return zero_where_both_zero(torch.where(d > 0, high, low), a, b)


def check_range(
    name: str, value: float, low: float, high: float, *, low_open: bool, high_open: bool, variant: str
) -> None:
    """Raise a ValueError naming ``name`` unless ``value`` is a finite real in the interval."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite real number for kl_divergence={variant!r}, got {value!r}")
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name} must lie in {interval} for kl_divergence={variant!r}, got {value!r}")
