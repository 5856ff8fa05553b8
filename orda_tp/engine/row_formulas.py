"""The per-row steps of a chunk between its column passes, written once as row formulas
(:mod:`orda_tp.divergences.expr`) and each run as one evaluation (docs/architecture.md, "The row
steps and the elementwise gradient"). Flags are stored as 1.0/0.0; temperatures and weights are
runtime scalars, so a program depends only on the call's structure (its :class:`StepKey`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from ..arguments.plan import StepKey
from ..divergences.expr import Expr, equal, greater, less, log, logical_or, row, where, wrap
from ..divergences.terms import STUDENT_TERMS, RowSymbols, StudentTerm
from .records import packed_columns
from .stats import GRAD_ROW_CONSTANTS

__all__ = ["RowProgram", "finish_step", "grad_step", "is_set", "partition_step"]

NEG_INF = float("-inf")
NAN = float("nan")


@dataclass(frozen=True, eq=False)
class RowProgram:
    """Row formulas: ``exprs[i]`` computes output ``outputs[i]`` from the (rows,) tensors named
    ``inputs`` and the runtime floats named ``scalars``; a run returns them as the columns of one
    (rows, len(outputs)) tensor. Identity is the cache key of its kernel, and every program is
    built once (the functions below are cached), so a call builds nothing."""

    inputs: tuple[str, ...]
    scalars: tuple[str, ...]
    outputs: tuple[str, ...]
    exprs: tuple[Expr, ...]


def is_set(flag: Expr) -> Expr:
    """A stored 1.0/0.0 flag (or a boolean input) as a condition."""
    return greater(flag, 0.5)


def _program(inputs: list[str], scalars: list[str], outputs: dict[str, Expr]) -> RowProgram:
    return RowProgram(tuple(inputs), tuple(scalars), tuple(outputs), tuple(outputs.values()))


def _term_scalars(terms: tuple[StudentTerm, ...]) -> list[str]:
    """The runtime scalars the terms' formulas read: their nonzero parameters, then ``inv_vocab``."""
    return [*sorted({name for term in terms for name in term.given}), "inv_vocab"]


def _term_values(terms: tuple[StudentTerm, ...], lse: Expr) -> dict[str, Expr]:
    """Each term's row value, its column sums read from the record's ``sum<k>`` columns."""
    values, first = {}, 0
    for term in terms:
        count = len(term.column_sums())
        sums = tuple(row(f"sum{k}") for k in range(first, first + count))
        values[term.name] = term.value(RowSymbols(lse, row("s_y"), sums))
        first += count
    return values


@cache
def partition_step(key: StepKey) -> RowProgram:
    """Round 1's per-row values from the merged record's columns (:func:`.records.packed_columns`):
    ``lse0 … lse{F−1}`` (``LSE_f = m_f + log z_f``) first, ``owned``, ``absent``, each registered
    student term's value, ``teacher_ce``, ``student_entropy`` (0: round 2 adds its sum), ``lse_u``
    with a KL term or the entropy, and with a KL term ``lse_v`` (0 on absent rows), ``logp_y``,
    ``logq_y`` and ``present`` (the teacher not absent, and no ``UNSUPPORTED`` column where round 1
    counts them), else ``kl``; each loss component NaN on unowned rows."""
    count = key.num_families
    lse = []
    for f in range(count):
        m = row(f"m{f}")
        lse.append(where(equal(m, NEG_INF), 0.0, m) + log(row(f"z{f}")))
    owned = equal(row("hits"), 1.0)
    # Added to every loss component: a label that no block owns makes its row NaN, never another class.
    nan_elsewhere = where(owned, 0.0, NAN)
    outputs: dict[str, Expr] = {f"lse{f}": lse[f] for f in range(count)}
    outputs["owned"] = where(owned, 1.0, 0.0)
    absent = None
    if key.teacher_family is not None:
        absent = equal(row(f"m{key.teacher_family}"), NEG_INF)
        outputs["absent"] = where(absent, 1.0, 0.0)
    values = {} if key.terms_family is None else _term_values(key.student_terms, lse[key.terms_family])
    for term in STUDENT_TERMS:  # an inactive term reads 0
        outputs[term.name] = values.get(term.name, wrap(0.0)) + nan_elsewhere
    outputs["teacher_ce"] = nan_elsewhere
    if key.ce_teacher is not None:
        assert absent is not None
        outputs["teacher_ce"] = where(absent, 0.0, lse[key.ce_teacher] - row("t_y")) + nan_elsewhere
    outputs["student_entropy"] = nan_elsewhere
    if key.kl_student is not None:  # the KL's student family, or the entropy's
        outputs["lse_u"] = lse[key.kl_student]
    if key.kl_teacher is not None:
        assert absent is not None
        # An absent teacher's LSE is −inf: 0 keeps its log q = −inf, not −inf − (−inf) = NaN.
        outputs["lse_v"] = lse_v = where(absent, 0.0, lse[key.kl_teacher])
        outputs["logp_y"] = row("s_y") / row("t_s") - outputs["lse_u"]
        outputs["logq_y"] = row("t_y") / row("t_t") - lse_v
        present = where(absent, 0.0, 1.0)
        if key.unsupported_sum is not None:
            # A column with s = −inf < t makes D infinite: that row's KL gradient is dropped.
            present = where(greater(row(f"sum{key.unsupported_sum}"), 0.0), 0.0, present)
        outputs["present"] = present
    else:
        outputs["kl"] = nan_elsewhere
    scalars = ["t_s", "t_t", *_term_scalars(key.student_terms)]
    return _program(list(packed_columns(count, key.num_column_sums)), scalars, outputs)


@cache
def finish_step() -> RowProgram:
    """From the variant's value ``D``: the row's ``divergence`` ``max(D, 0)`` and ``kl`` (times
    ``T_s²``), both 0 on absent rows and NaN on unowned ones, and ``keep``, whether the row's KL
    gradient is formed (teacher present and ``D ≠ +inf``)."""
    value, absent = row("value"), is_set(row("absent"))
    # Rounding can take D below 0; a where, not a max, keeps a NaN D NaN.
    clamped = where(less(value, 0.0), 0.0, value)
    divergence = where(absent, 0.0, clamped) + where(is_set(row("owned")), 0.0, NAN)
    # No gradient where the teacher is absent or D = +inf: there ∂D is inf or NaN.
    keep = where(logical_or(absent, equal(value, float("inf"))), 0.0, 1.0)
    outputs = {"divergence": divergence, "kl": divergence * row("t_s_squared"), "keep": keep}
    return _program(["value", "absent", "owned"], ["t_s_squared"], outputs)


@cache
def grad_step(key: StepKey) -> RowProgram:
    """The gradient kernel's row constants (:class:`.stats.GradRows`), in
    :data:`.stats.GRAD_ROW_CONSTANTS` order, then the variant's (``key.variant_constants``): those
    of the call's terms, the student terms' coefficients summed with their weights ``w_<name>``."""
    # 0 on ignored rows (their gradients exactly 0), NaN on a row whose label no block owns.
    scale = where(is_set(row("valid")), where(is_set(row("owned")), row("upstream"), NAN), 0.0)
    formulas: dict[str, Expr] = dict(scale=scale)
    scalars = ["w_t"]
    if key.terms_family is not None:
        lse_s = row(f"lse{key.terms_family}")
        grads = [(row(f"w_{term.name}"), term.grad(lse_s)) for term in key.student_terms]
        formulas.update(
            lse_s=lse_s,
            c_p=_total([weight * grad.softmax for weight, grad in grads]),
            c_y=_total([weight * grad.label for weight, grad in grads]),
            c_u=_total([weight * grad.uniform for weight, grad in grads]),
        )
        scalars += [f"w_{term.name}" for term in key.student_terms]
        scalars += _term_scalars(key.student_terms)
    if key.teacher_ce_trains:
        absent = is_set(row("absent"))
        # An absent teacher's row trains nothing; LSE 0, not −inf, keeps its t − LSE at −inf, not NaN.
        formulas.update(
            lse_t=where(absent, 0.0, row(f"lse{key.ce_teacher}")), c_ce_t=where(absent, 0.0, row("w_t") * scale)
        )
    # The KL's row statistics and the variant's constants, passed through as they are.
    passed = ["lse_u", "lse_v", "keep", *key.variant_constants] if key.kl_teacher is not None else []
    passed = [name for name in dict.fromkeys(passed) if name not in formulas]
    formulas.update({name: row(name) for name in passed})
    outputs = {name: formulas[name] for name in GRAD_ROW_CONSTANTS if name in formulas}
    outputs.update(formulas)  # the variant's constants after the engine's
    inputs = ["upstream", "valid", "owned", *passed]
    if key.terms_family is not None:
        inputs.append(f"lse{key.terms_family}")
    if key.teacher_ce_trains:
        inputs += ["absent", f"lse{key.ce_teacher}"]
    return _program(inputs, scalars, outputs)


def _total(terms: list[Expr]) -> Expr:
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total
