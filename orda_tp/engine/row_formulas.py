"""The per-row steps of a chunk, written once as row formulas (:mod:`orda_tp.divergences.expr`).

Between the column passes of a chunk, every row turns its merged statistics into the numbers the
next pass reads. The steps are elementwise over rows; each is one formula program, run as one
torch evaluation (torch backend) or one generated Triton row kernel, instead of a few dozen
small tensor ops per chunk.

- :func:`partition_step`, after round 1, from the merged record's ``(m_f, z_f)``, label logits
  ``s_y``, ``t_y``, label-owner count and the student terms' column sums: ``LSE_f = m_f + log
  z_f`` (``−inf`` for an all ``−inf`` row), ``owned`` (exactly one column owns the label),
  ``absent`` (the teacher's logits are all ``−inf``), each registered student term's value
  (:mod:`orda_tp.divergences.terms`: ``student_ce``, ``z_loss``), ``CE_t = LSE(t) − t_y`` (0 on
  absent rows) and, with a KL term, ``LSE(u)``, ``LSE(v)`` (0 on absent rows), ``log p_y = s_y/T_s −
  LSE(u)``, ``log q_y =
  t_y/T_t − LSE(v)`` and ``present`` (the teacher is not absent, and no ``UNSUPPORTED`` column
  where round 1 counts them: the gradient's ``keep`` when round 2 is summed in the gradient pass,
  ``LossPlan.kl_sums_in_gradient_pass``). The loss components are NaN on rows whose label no
  column owns.
- :func:`finish_step`, after round 2 and the variant's finalize: the row's divergence
  ``max(D, 0)`` and ``KL = T_s²·max(D, 0)`` (both 0 on absent rows, NaN on unowned ones) and
  ``keep``, whether the row's KL gradient is formed (teacher present and ``D ≠ +inf``).
- :func:`grad_step`, before a gradient pass: the row constants of the gradient kernel
  (:class:`.stats.GradRows` says what each holds, and their order), each formed where the call has
  its term: the student terms' coefficients summed with their weights, ``c_p = Σ_k w_k·c_p,k``;
  the teacher CE's coefficient ``w_t·scale``; the KL's and the variant's constants passed through.

Flags are stored as 1.0/0.0 and read back with :func:`is_set`. Values that change between calls
(temperatures, weights) are runtime scalars, so a program depends only on the call's structure.
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
    """Round 1's per-row values (see the module docstring) from the merged record's columns
    (:func:`.records.packed_columns`); outputs ``lse0 … lse{F−1}`` first."""
    count = key.num_families
    lse = []
    for f in range(count):
        m = row(f"m{f}")
        lse.append(where(equal(m, NEG_INF), 0.0, m) + log(row(f"z{f}")))
    owned = equal(row("hits"), 1.0)
    nan_elsewhere = where(owned, 0.0, NAN)  # added to every per-row value
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
    if key.kl_student is not None:
        assert absent is not None and key.kl_teacher is not None
        lse_u = lse[key.kl_student]
        lse_v = where(absent, 0.0, lse[key.kl_teacher])
        outputs["lse_u"], outputs["lse_v"] = lse_u, lse_v
        outputs["logp_y"] = row("s_y") / row("t_s") - lse_u
        outputs["logq_y"] = row("t_y") / row("t_t") - lse_v
        present = where(absent, 0.0, 1.0)
        if key.unsupported_sum is not None:
            present = where(greater(row(f"sum{key.unsupported_sum}"), 0.0), 0.0, present)
        outputs["present"] = present
    else:
        outputs["kl"] = nan_elsewhere
    scalars = ["t_s", "t_t", *_term_scalars(key.student_terms)]
    return _program(list(packed_columns(count, key.num_column_sums)), scalars, outputs)


@cache
def finish_step() -> RowProgram:
    """The row's divergence ``max(D, 0)`` (0 on absent rows, NaN on unowned ones; the max keeps
    NaN), the KL component ``T_s²·`` that, and its gradient flag, from the variant's value ``D``
    (see the module docstring)."""
    value, absent = row("value"), is_set(row("absent"))
    clamped = where(less(value, 0.0), 0.0, value)
    divergence = where(absent, 0.0, clamped) + where(is_set(row("owned")), 0.0, NAN)
    keep = where(logical_or(absent, equal(value, float("inf"))), 0.0, 1.0)
    outputs = {"divergence": divergence, "kl": divergence * row("t_s_squared"), "keep": keep}
    return _program(["value", "absent", "owned"], ["t_s_squared"], outputs)


@cache
def grad_step(key: StepKey) -> RowProgram:
    """The gradient kernel's row constants, in :data:`.stats.GRAD_ROW_CONSTANTS` order, then the
    variant's (``key.variant_constants``): those of the call's terms (see the module docstring),
    each student term's coefficients times its weight ``w_<name>``."""
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
        formulas.update(
            lse_t=where(absent, 0.0, row(f"lse{key.ce_teacher}")), c_ce_t=where(absent, 0.0, row("w_t") * scale)
        )
    # The KL's row statistics and the variant's constants, passed through as they are.
    passed = ["lse_u", "lse_v", "keep", *key.variant_constants] if key.kl_student is not None else []
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
