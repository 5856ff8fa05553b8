"""What a KL variant is: statistics it sums, how it finalizes, and its elementwise gradient.

Every variant works on normalized log-probabilities of one block of columns,
``log p = u − LSE(u)`` and ``log q = v − LSE(v)`` (``u = s/T_s``, ``v = t/T_t``), which exist once
the first statistics round (the log-partitions) is merged. A variant then

1. sums ``num_sums`` elementwise terms over the block's columns (:meth:`Divergence.column_terms`,
   written as :mod:`expr` trees that every backend evaluates or compiles: the torch backend's
   interpreter is ``orda_tp.engine.torch_math``, the Triton backend's compiler ``orda_tp.kernels``);
   the per-block sums of all blocks (or tensor-parallel shards) add up to the row's sums;
2. turns the merged sums into the row value ``D`` and the row constants its gradient needs
   (:meth:`Divergence.finalize`);
3. forms ``∂D/∂u`` (and ``∂D/∂v`` when it co-trains the teacher) from a block's columns and the
   row constants (:meth:`Divergence.student_grad_expr`, :meth:`Divergence.teacher_grad_expr`).

The trees of a variant and its parameters are built once (:func:`formulas_of`) and reused by every
call.

Tensors are (rows, cols) for blocks and (rows,) for rows; all arithmetic is in the statistics
dtype (fp32, or fp64 for fp64 inputs). Zero-support columns (p = 0 or q = 0, from −inf logits)
follow the conventions of docs/variants.md, "Notation": ``0·log 0 = 0`` and ``p·log(p/0) = +inf``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache

from torch import Tensor

from .expr import Expr, equal, expm1, greater, logical_and, row_names, where

__all__ = [
    "LOG_VOCAB",
    "Divergence",
    "DivergenceParams",
    "EntropyGate",
    "Finalized",
    "Parameter",
    "Real",
    "RowTargets",
    "VariantFormulas",
    "formulas_of",
    "power_gap",
    "xlogratio",
    "zero_where_both_zero",
]


@dataclass(frozen=True)
class EntropyGate:
    """Teacher-entropy gate of ``entropy_adaptive``.

    ``γ = alpha_min + (alpha_max − alpha_min) · σ((H(q)/log V − tau) / scale)``: a confident
    teacher (low normalized entropy) leans on the reverse KL, an uncertain one on the forward KL.
    """

    alpha_min: float = 0.0
    alpha_max: float = 1.0
    tau: float = 0.5
    scale: float = 0.1

    def __post_init__(self) -> None:
        for name in ("alpha_min", "alpha_max", "tau", "scale"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)):
                raise ValueError(f"EntropyGate.{name} must be a finite real number, got {value!r}")
        if not 0.0 <= self.alpha_min <= self.alpha_max <= 1.0:
            raise ValueError(
                "EntropyGate needs 0 <= alpha_min <= alpha_max <= 1, got "
                f"alpha_min={self.alpha_min!r}, alpha_max={self.alpha_max!r}"
            )
        if not self.scale > 0:
            raise ValueError(f"EntropyGate.scale must be > 0, got {self.scale!r}")


LOG_VOCAB = "log_vocab"
"""The key of ``log V`` (the global real vocabulary) in the parameters of a variant that reads it
(:attr:`Divergence.reads_log_vocab`); the plan adds it (:meth:`Divergence.with_log_vocab`)."""


@dataclass(frozen=True)
class DivergenceParams(Mapping[str, Hashable]):
    """A variant's parameters by keyword (``"kl_alpha"``, …), resolved by :meth:`Divergence.resolve`
    (defaults filled, values checked), in the variant's order, and :data:`LOG_VOCAB` where the
    variant reads it. Frozen and hashable: a variant's trees are cached per parameters."""

    entries: tuple[tuple[str, Hashable], ...] = ()

    def __getitem__(self, keyword: str) -> Hashable:
        for name, value in self.entries:
            if name == keyword:
                return value
        raise KeyError(keyword)

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def real(self, keyword: str) -> float:
        """The number under ``keyword`` (one of the variant's ``Real`` parameters, or ``log_vocab``)."""
        value = self[keyword]
        assert isinstance(value, float), (keyword, value)
        return value

    def with_entry(self, keyword: str, value: Hashable) -> DivergenceParams:
        """These parameters with ``keyword`` set to ``value``."""
        return DivergenceParams(tuple({**dict(self.entries), keyword: value}.items()))


@dataclass(frozen=True)
class Parameter:
    """A keyword argument of the loss that a variant reads: ``keyword``, the value a call that
    leaves it None gets (``default``) and :meth:`check` (the value as given → the value used)."""

    keyword: str
    default: Hashable

    def check(self, value: object, variant: str) -> Hashable:
        """``value`` as the variant ``variant`` uses it; raises naming the keyword and the variant."""
        raise NotImplementedError

    def resolve(self, value: object, variant: str) -> Hashable:
        return self.check(self.default if value is None else value, variant)


@dataclass(frozen=True)
class Real(Parameter):
    """A finite real number from ``low`` to ``high`` (each bound open or closed), used as a float."""

    low: float
    high: float
    low_open: bool
    high_open: bool

    def check(self, value: object, variant: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(
                f"{self.keyword} must be a finite real number for kl_divergence={variant!r}, got {value!r}"
            )
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        if not (above and below):
            interval = f"{'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"
            raise ValueError(f"{self.keyword} must lie in {interval} for kl_divergence={variant!r}, got {value!r}")
        return float(value)


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
    parameters: tuple[Parameter, ...] = ()
    """The keyword arguments the variant reads (``kl_alpha``, ``kl_beta``, ``entropy_gate``), in
    the order they are checked, each with its default and its check."""
    reads_log_vocab: bool = False
    """True when ``finalize`` reads ``params[LOG_VOCAB]`` (entropy_adaptive's gate)."""
    cotrains_teacher: bool = False
    """True for mutual/cojeffreys: the KL also trains the teacher (no detach)."""
    needs_target: bool = False
    """True when the block sums need to know which column is the label (dkd)."""
    num_sums: int = 1

    @property
    def keywords(self) -> tuple[str, ...]:
        """The keywords of :attr:`parameters`."""
        return tuple(parameter.keyword for parameter in self.parameters)

    def resolve(self, given: Mapping[str, object]) -> DivergenceParams:
        """The parameters this variant reads, from the call's keywords ``given`` (absent or None:
        the default), each checked (a bad type raises like a bad range); other keywords unread."""
        return DivergenceParams(tuple((p.keyword, p.resolve(given.get(p.keyword), self.name)) for p in self.parameters))

    def with_log_vocab(self, params: DivergenceParams, vocab_size: int) -> DivergenceParams:
        """``params`` completed by ``log V`` of the global real vocabulary, for a variant that
        :attr:`reads_log_vocab` (a normalizer: V ≥ 2)."""
        if vocab_size < 2:
            raise ValueError(f"kl_divergence={self.name!r} needs a vocabulary of at least 2 columns, got {vocab_size}")
        return params.with_entry(LOG_VOCAB, math.log(vocab_size))

    def column_terms(self, params: DivergenceParams) -> tuple[Expr, ...]:
        """The ``num_sums`` elementwise terms whose column sums round 2 collects."""
        raise NotImplementedError

    def finalize(self, sums: Tensor, targets: RowTargets, params: DivergenceParams) -> Finalized:
        """Row value ``D`` and gradient constants from the sums merged over all columns."""
        raise NotImplementedError

    def student_grad_expr(self, params: DivergenceParams) -> Expr:
        """``∂D/∂u`` on a column, over the block symbols and the finalize constants."""
        raise NotImplementedError

    def teacher_grad_expr(self, params: DivergenceParams) -> Expr:
        """``∂D/∂v`` on a column (co-training variants only)."""
        raise NotImplementedError(f"{self.name} does not train the teacher through the KL")

    def infinite_without_support(self, params: DivergenceParams) -> bool:
        """Whether ``D`` is ``+inf`` as soon as the teacher has no mass on a column where the
        student has some (``p·log(p/0)``; the last column of docs/variants.md's "Summary")."""
        return False


@dataclass(frozen=True)
class VariantFormulas:
    """A variant's trees for one set of parameters: ``column_terms`` (the ``num_sums`` terms that
    round 2 sums over the columns), ``student_grad`` (``∂D/∂u``), ``teacher_grad`` (``∂D/∂v``, for
    the co-training variants, else None) and ``row_names``, the finalize constants that the
    gradients read, in first-use order."""

    column_terms: tuple[Expr, ...]
    student_grad: Expr
    teacher_grad: Expr | None
    row_names: tuple[str, ...]


@cache
def formulas_of(divergence: Divergence, params: DivergenceParams) -> VariantFormulas:
    """The trees of ``divergence`` with ``params``, built once: the variants are registry
    singletons and their parameters frozen, so every later call reads the same trees."""
    student = divergence.student_grad_expr(params)
    teacher = divergence.teacher_grad_expr(params) if divergence.cotrains_teacher else None
    gradients = [student] if teacher is None else [student, teacher]
    return VariantFormulas(tuple(divergence.column_terms(params)), student, teacher, tuple(row_names(gradients)))


def xlogratio(x: Expr, log_x: Expr, log_y: Expr) -> Expr:
    """Elementwise ``x·(log x − log y)`` with ``0·(…) = 0`` where x = 0 (NaN stays NaN)."""
    return where(equal(x, 0.0), 0.0, x * (log_x - log_y))


def zero_where_both_zero(values: Expr, a: Expr, b: Expr) -> Expr:
    """Zero the columns where both distributions vanish (padding, −inf in both)."""
    return where(logical_and(equal(a, 0.0), equal(b, 0.0)), 0.0, values)


def power_gap(log_a: Expr, log_b: Expr, a: Expr, b: Expr, r: float) -> Expr:
    """Elementwise ``a^r b^{1−r} − r·a − (1−r)·b``, whose column sum is ``Σ a^r b^{1−r} − 1``.

    Weighted AM–GM makes every term ≤ 0 for r ∈ (0,1) and ≥ 0 for r > 1, so the sum has no
    cancellation even when a ≈ b. With ``d = log a − log b``, factor out the larger of a, b:

    - d ≤ 0: ``b·(expm1(r d) − r·expm1(d))``
    - d > 0: ``a·(expm1(−(1−r) d) − (1−r)·expm1(−d))``
    """
    d = log_a - log_b
    low = b * (expm1(r * d) - r * expm1(d))
    high = a * (expm1(-(1.0 - r) * d) - (1.0 - r) * expm1(-d))
    return zero_where_both_zero(where(greater(d, 0.0), high, low), a, b)
