"""What a KL variant is (:class:`Divergence`): the column terms round 2 sums, the row value ``D`` and
gradient constants from the merged sums, and ``∂D/∂u`` (``∂D/∂v`` for co-training) per column, over
``log p = u − LSE(u)``, ``log q = v − LSE(v)`` of a block of columns (docs/variants.md). Blocks are
(rows, cols), rows (rows,), in the statistics dtype; zero-support columns follow docs/variants.md,
"Zero-support conventions": ``0·log 0 = 0``, ``p·log(p/0) = +inf``.
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
    (defaults filled, values checked), in the variant's order, and :data:`LOG_VOCAB` where it reads it."""

    # Pairs, not a dict: frozen and hashable, so that formulas_of caches a variant's trees per parameters.
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
        if vocab_size < 2:  # log V normalizes H(q): log 1 = 0 would divide by 0
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
    """A variant's trees for one set of parameters (:func:`formulas_of`)."""

    column_terms: tuple[Expr, ...]  # the num_sums terms that round 2 sums over the columns
    student_grad: Expr  # ∂D/∂u
    teacher_grad: Expr | None  # ∂D/∂v, for the co-training variants
    # The finalize constants the gradients read, in first-use order (none: a condition of round 2 in the grad pass).
    row_names: tuple[str, ...]


@cache
def formulas_of(divergence: Divergence, params: DivergenceParams) -> VariantFormulas:
    """The trees of ``divergence`` with ``params``, built once: the variants are registry
    singletons and their parameters frozen, so every later call reads the same trees."""
    student = divergence.student_grad_expr(params)
    # Only a co-training variant has ∂D/∂v: for the others teacher_grad_expr raises.
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
    """Elementwise ``a^r b^{1−r} − r·a − (1−r)·b``, whose column sum is ``Σ a^r b^{1−r} − 1``: by
    weighted AM–GM every term is ≤ 0 for r ∈ (0,1) and ≥ 0 for r > 1, so the sum does not cancel,
    even where a ≈ b (0 where both vanish)."""
    d = log_a - log_b
    # The larger of a, b factored out, the bracket in expm1 (exact where a ≈ b): b for d ≤ 0, a for d > 0.
    low = b * (expm1(r * d) - r * expm1(d))
    high = a * (expm1(-(1.0 - r) * d) - (1.0 - r) * expm1(-d))
    return zero_where_both_zero(where(greater(d, 0.0), high, low), a, b)
