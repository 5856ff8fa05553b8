"""The per-row steps of a chunk, written once as row formulas (:mod:`orda_tp.divergences.expr`).

Between the column passes of a chunk, every row turns its merged statistics into the numbers the
next pass reads. The steps are elementwise over rows; each is one formula program, run as one
torch evaluation (torch backend) or one generated Triton row kernel, instead of a few dozen
small tensor ops per chunk.

- :func:`partition_step`, after round 1, from the merged record's ``(m_f, z_f)``, label logits
  ``s_y``, ``t_y`` and label-owner count: ``LSE_f = m_f + log z_f`` (``−inf`` for an all ``−inf``
  row), ``owned`` (exactly one column owns the label), ``absent`` (the teacher's logits are all
  ``−inf``), ``CE_s = LSE(s) − s_y``, ``CE_t = LSE(t) − t_y`` (0 on absent rows) and, with a KL
  term, ``LSE(u)``, ``LSE(v)`` (0 on absent rows), ``log p_y = s_y/T_s − LSE(u)``, ``log q_y =
  t_y/T_t − LSE(v)``. The loss components are NaN on rows whose label no column owns.
- :func:`finish_step`, after round 2 and the variant's finalize: the row's divergence
  ``max(D, 0)`` and ``KL = T_s²·max(D, 0)`` (both 0 on absent rows, NaN on unowned ones) and
  ``keep``, whether the row's KL gradient is formed (teacher present and ``D ≠ +inf``).
- :func:`grad_step`, before a gradient pass: the row constants of the gradient kernel, in
  :func:`grad_row_names` order: ``scale`` = the upstream gradient (0 on ignored rows, NaN on
  unowned ones), the teacher CE's ``LSE(t)`` and coefficient ``c_ce_t = w_t·scale`` (both 0 on
  absent rows), the KL's log-partitions and ``keep``, and the variant's finalize constants.

Flags are stored as 1.0/0.0 and read back with :func:`is_set`. Values that change between calls
(temperatures, weights) are runtime scalars, so a program depends only on the call's structure.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from torch import Tensor

from ..divergences import Divergence, DivergenceParams
from ..divergences.expr import Expr, equal, greater, less, log, logical_or, row, row_names, where
from ..plan import LossPlan
from ..records import LogitFamily, PartitionRecord

__all__ = [
    "RowProgram",
    "StepKey",
    "divergence_row_names",
    "finish_step",
    "grad_row_names",
    "grad_step",
    "is_set",
    "partition_inputs",
    "partition_scalars",
    "partition_step",
]

NEG_INF = float("-inf")
NAN = float("nan")


@dataclass(frozen=True, eq=False)
class RowProgram:
    """Row formulas: ``exprs[i]`` computes output ``outputs[i]`` from the (rows,) tensors named
    ``inputs`` and the runtime floats named ``scalars``. Identity is the cache key of its kernel."""

    inputs: tuple[str, ...]
    scalars: tuple[str, ...]
    outputs: tuple[str, ...]
    exprs: tuple[Expr, ...]

    def columns(self, packed: Tensor) -> dict[str, Tensor]:
        """The program's (rows, outputs) result as each output's (rows,) view, by name."""
        return {name: packed[:, j] for j, name in enumerate(self.outputs)}


def is_set(flag: Expr) -> Expr:
    """A stored 1.0/0.0 flag (or a boolean input) as a condition."""
    return greater(flag, 0.5)


def _program(inputs: list[str], scalars: list[str], outputs: dict[str, Expr]) -> RowProgram:
    return RowProgram(tuple(inputs), tuple(scalars), tuple(outputs), tuple(outputs.values()))


def record_inputs(num_families: int) -> list[str]:
    """Names of the packed record's columns (:meth:`PartitionRecord.pack` order)."""
    f = num_families
    return [f"m{i}" for i in range(f)] + [f"z{i}" for i in range(f)] + ["s_y", "t_y", "hits"]


def partition_inputs(record: PartitionRecord) -> dict[str, Tensor]:
    """The merged record's columns as the inputs of :func:`partition_step`, by name (views)."""
    columns = [record.maxes, record.sumexps, record.target_logits, record.label_hits[:, None]]
    names = iter(record_inputs(record.maxes.shape[1]))
    return {next(names): column[:, j] for column in columns for j in range(column.shape[1])}


@dataclass(frozen=True)
class StepKey:
    """What a call's row programs depend on: its structure, never its weights or temperatures."""

    num_families: int
    student_ce: bool
    teacher_ce: bool
    computes_kl: bool
    ce_student: int | None  # family indices
    ce_teacher: int | None
    kl_student: int | None
    kl_teacher: int | None
    teacher_family: int | None

    @staticmethod
    def of(plan: LossPlan) -> StepKey:
        families = plan.families

        def index(wanted: bool, family: LogitFamily) -> int | None:
            return families.index(family) if wanted else None

        teacher = next((i for i, family in enumerate(families) if family.side == "teacher"), None)
        kl = plan.computes_kl
        return StepKey(
            num_families=len(families),
            student_ce=plan.student_ce_weight > 0,
            teacher_ce=plan.teacher_ce_weight > 0,
            computes_kl=kl,
            ce_student=index(plan.student_ce_weight > 0, plan.ce_student_family),
            ce_teacher=index(plan.teacher_ce_weight > 0, plan.ce_teacher_family),
            kl_student=index(kl, plan.kl_student_family),
            kl_teacher=index(kl, plan.kl_teacher_family),
            teacher_family=teacher,
        )


def partition_scalars(plan: LossPlan) -> dict[str, float]:
    return {"t_s": plan.student_temperature, "t_t": plan.teacher_temperature}


@cache
def partition_step(key: StepKey) -> RowProgram:
    """Round 1's per-row values (see the module docstring); outputs ``lse0 … lse{F−1}`` first."""
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
    outputs["student_ce"] = nan_elsewhere
    if key.ce_student is not None:
        outputs["student_ce"] = lse[key.ce_student] - row("s_y") + nan_elsewhere
    outputs["teacher_ce"] = nan_elsewhere
    if key.ce_teacher is not None:
        assert absent is not None
        outputs["teacher_ce"] = where(absent, 0.0, lse[key.ce_teacher] - row("t_y")) + nan_elsewhere
    if key.computes_kl:
        assert absent is not None and key.kl_student is not None and key.kl_teacher is not None
        lse_u = lse[key.kl_student]
        lse_v = where(absent, 0.0, lse[key.kl_teacher])
        outputs["lse_u"], outputs["lse_v"] = lse_u, lse_v
        outputs["logp_y"] = row("s_y") / row("t_s") - lse_u
        outputs["logq_y"] = row("t_y") / row("t_t") - lse_v
    else:
        outputs["kl"] = nan_elsewhere
    return _program(record_inputs(count), ["t_s", "t_t"], outputs)


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


def grad_row_names(plan: LossPlan) -> tuple[str, ...]:
    """The gradient kernel's row constants, in the order it reads them: ``scale``, then
    ``lse_s`` (student CE), ``lse_t``, ``c_ce_t`` (teacher CE training the teacher), ``lse_u``,
    ``lse_v``, ``keep`` and the variant's constants (KL)."""
    names = ["scale"]
    if plan.student_ce_weight > 0:
        names.append("lse_s")
    if plan.teacher_ce_trains_teacher:
        names += ["lse_t", "c_ce_t"]
    if plan.computes_kl:
        names += ["lse_u", "lse_v", "keep"]
        names += [name for name in divergence_row_names(plan.divergence, plan.params) if name not in names]
    return tuple(names)


@cache
def grad_step(key: StepKey, names: tuple[str, ...]) -> RowProgram:
    """The gradient kernel's row constants ``names`` (see :func:`grad_row_names`)."""
    scale = where(is_set(row("valid")), where(is_set(row("owned")), row("upstream"), NAN), 0.0)
    formulas: dict[str, Expr] = {"scale": scale}
    if key.ce_student is not None:
        formulas["lse_s"] = row(f"lse{key.ce_student}")
    if key.ce_teacher is not None:
        absent = is_set(row("absent"))
        formulas["lse_t"] = where(absent, 0.0, row(f"lse{key.ce_teacher}"))
        formulas["c_ce_t"] = where(absent, 0.0, row("w_t") * scale)
    outputs = {name: formulas.get(name, row(name)) for name in names}
    inputs = ["upstream", "valid", "owned"]
    inputs += [name for name in names if name not in formulas]  # the passed-through constants
    if key.ce_student is not None:
        inputs.append(f"lse{key.ce_student}")
    if "lse_t" in names:
        inputs += ["absent", f"lse{key.ce_teacher}"]
    return _program(inputs, ["w_t"], outputs)


@cache
def divergence_row_names(divergence: Divergence | None, params: DivergenceParams) -> tuple[str, ...]:
    """The row constants of the variant's gradient formulas (its finalize constants); the
    variants are registry singletons and their parameters frozen, so this is built once each."""
    if divergence is None:
        return ()
    exprs = [divergence.student_grad_expr(params)]
    if divergence.cotrains_teacher:
        exprs.append(divergence.teacher_grad_expr(params))
    return tuple(row_names(exprs))
