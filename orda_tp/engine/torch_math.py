"""Block math on torch ops over (rows × block) tensors, fp64 included (:class:`TorchBlockMath`),
and the torch interpreter of the expression trees (:func:`evaluate`, :func:`evaluate_rows`), as
``orda_tp.kernels`` is their Triton compiler.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from ..arguments.plan import LogitFamily, LossPlan
from ..divergences.expr import Expr
from ..divergences.terms import RAW_STUDENT, RAW_TEACHER
from ..teachers.source import SparseLogits
from .logits import LogitGrads, TeacherBlock
from .records import merge_stacked_records
from .row_formulas import RowProgram
from .stats import GradRows
from .topk_rows import block_topk

__all__ = ["TorchBlockMath", "evaluate", "evaluate_rows"]

_UNARY: dict[str, Callable[[Tensor], Tensor]] = {
    "exp": torch.exp,
    "log": torch.log,
    "expm1": torch.expm1,
    "abs": torch.abs,
    "neg": torch.neg,
}
_BINARY: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "eq": torch.eq,
    "gt": torch.gt,
    "lt": torch.lt,
    "and": torch.logical_and,
    "or": torch.logical_or,
    "logaddexp": torch.logaddexp,
}


def _evaluate(
    node: Expr,
    memo: dict[int, Tensor],
    columns: Mapping[str, Tensor | None],
    rows: Mapping[str, Tensor],
    like: Tensor,
    as_columns: bool,
) -> Tensor:
    """The value of the tree ``node``: ``columns`` maps the column symbols to (rows, cols) tensors,
    ``rows`` the row constants to (rows,) tensors (read as (rows, 1) columns when ``as_columns``);
    constants are 0-d tensors of ``like``'s dtype. A subtree shared in Python (``memo``, by
    identity) is computed once."""
    key = id(node)
    if key in memo:
        return memo[key]
    if node.op == "const":
        # A 0-d CPU tensor acts as a scalar beside device tensors: no host-to-device copy.
        result = torch.tensor(node.value, dtype=like.dtype)
    elif node.op == "column":
        value = columns[str(node.value)]
        assert value is not None, f"the block has no {node.value}"
        result = value
    elif node.op == "row":
        result = rows[str(node.value)]
        result = result[:, None] if as_columns else result
    else:
        args = [_evaluate(arg, memo, columns, rows, like, as_columns) for arg in node.args]
        if node.op == "where":
            result = torch.where(args[0], args[1], args[2])
        elif node.op in _UNARY:
            result = _UNARY[node.op](args[0])
        else:
            result = _BINARY[node.op](args[0], args[1])
    memo[key] = result
    return result


def _block_symbols(
    plan: LossPlan, student: Tensor, teacher: Tensor | None, lse_u: Tensor, lse_v: Tensor, is_target: Tensor | None
) -> dict[str, Tensor | None]:
    """The column symbols of a block: normalized ``log p``, ``log q``, ``p``, ``q`` (``log q``,
    ``q`` None without a teacher), and the label mask ``is_target`` (None for a variant that does
    not read it)."""
    logp = student / plan.student_temperature - lse_u[:, None]
    logq = None if teacher is None else teacher / plan.teacher_temperature - lse_v[:, None]
    q = None if logq is None else torch.exp(logq)
    return {"logp": logp, "logq": logq, "p": torch.exp(logp), "q": q, "is_target": is_target}


def evaluate(
    exprs: Sequence[Expr], columns: Mapping[str, Tensor | None], rows: Mapping[str, Tensor], shape: str = "logp"
) -> list[Tensor]:
    """The trees ``exprs`` on a block, each as a (rows, cols) tensor like the column ``shape``:
    ``columns`` maps the column symbols to (rows, cols) tensors, ``rows`` the row constants to
    (rows,) tensors. Intermediates live only as long as this call."""
    reference = columns[shape]
    assert reference is not None
    memo: dict[int, Tensor] = {}
    values = [_evaluate(expr, memo, columns, rows, reference, True) for expr in exprs]
    return [value.to(reference.device).expand_as(reference) for value in values]


def evaluate_rows(
    program: RowProgram, values: Mapping[str, Tensor], scalars: Mapping[str, float], like: Tensor
) -> Tensor:
    """A row program on (rows,) tensors: ``values`` maps its inputs to (rows,) tensors (any dtype;
    booleans read as 0/1), ``scalars`` its scalars to floats; its outputs stacked as the columns of
    one (rows, outputs) tensor in ``like``'s dtype and device."""
    constants = {name: torch.tensor(value, dtype=like.dtype) for name, value in scalars.items()}
    rows = {**values, **constants}
    memo: dict[int, Tensor] = {}
    count = next(iter(values.values())).shape[0]
    outputs = []
    for expr in program.exprs:
        result = _evaluate(expr, memo, {}, rows, like, False)
        # A constant result (0-d, on the CPU) added into zeros on the device: no host-to-device copy.
        outputs.append(result.to(like).expand(count) if result.dim() else like.new_zeros(count).add_(result))
    return torch.stack(outputs, dim=1)


class TorchBlockMath:
    """Torch ops on (rows × block) tensors: the records merged as :mod:`.records` says, the trees
    interpreted here."""

    reads_stored_cache = False
    applies_softcap = False  # its blocks arrive capped (engine.logits.softcapped)
    whole_blocks = False  # each block's temporaries are (rows × block) tensors
    merge_stacked = staticmethod(merge_stacked_records)
    topk = staticmethod(block_topk)
    rows = staticmethod(evaluate_rows)

    def partition(
        self,
        student: Tensor,
        teacher: TeacherBlock | None,
        labels: Tensor,
        col_start: int,
        families: Sequence[LogitFamily],
        column_sums: tuple[Expr, ...] = (),
        caps: tuple[float | None, float | None] = (None, None),
    ) -> Tensor:
        """The protocol's packed round-1 record; ``student``/``teacher``: (rows, cols) logits in the
        statistics dtype, already capped (``caps`` unused)."""
        assert not isinstance(teacher, SparseLogits)  # reads_stored_cache is False: blocks arrive dense
        sides = {"student": student, "teacher": teacher}
        maxes, sumexps = [], []
        for family in families:
            logits = sides[family.side]
            assert logits is not None, f"family {family} needs {family.side} logits"
            x = logits if family.temperature == 1.0 else logits / family.temperature
            row_max = x.amax(dim=1)
            # An all −inf row is shifted by 0: x − (−inf) would be NaN; its sum is Σ e^{−inf} = 0.
            shift = torch.where(row_max == float("-inf"), 0.0, row_max)
            maxes.append(row_max)
            sumexps.append(torch.exp(x - shift[:, None]).sum(dim=1))
        local_labels = labels - col_start
        owned = (local_labels >= 0) & (local_labels < student.shape[1])
        # A label outside the block is read at column 0 and zeroed: it is never used as an index.
        index = torch.where(owned, local_labels, 0)[:, None]
        target_student = torch.where(owned, student.gather(1, index).squeeze(1), 0.0)
        if teacher is None:
            target_teacher = torch.zeros_like(target_student)
        else:
            target_teacher = torch.where(owned, teacher.gather(1, index).squeeze(1), 0.0)
        record = torch.stack([*maxes, *sumexps, target_student, target_teacher, owned.to(student.dtype)], dim=1)
        if not column_sums:
            return record
        raw = {str(RAW_STUDENT.value): student, str(RAW_TEACHER.value): teacher}
        terms = evaluate(column_sums, raw, {}, shape=str(RAW_STUDENT.value))
        return torch.cat([record, torch.stack([term.sum(1) for term in terms], dim=1)], dim=1)

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
        """(rows, len(plan.round_two_terms)) column sums of the plan's round-2 terms over the block."""
        assert not isinstance(teacher, SparseLogits)  # reads_stored_cache is False: blocks arrive dense
        is_target = None
        if plan.computes_kl and plan.divergence is not None and plan.divergence.needs_target:
            is_target = torch.arange(student.shape[1], device=student.device)[None, :] == (labels - col_start)[:, None]
        symbols = _block_symbols(plan, student, teacher, lse_u, lse_v, is_target)
        return torch.stack([value.sum(1) for value in evaluate(plan.round_two_terms, symbols, {})], dim=1)

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
        """The protocol's logit gradients of the block, written (with ``accumulate``, the student's
        added) into ``out``; with ``sums_out``, the block's round-2 sums from the same column values
        added into it."""
        assert not isinstance(teacher, SparseLogits)  # reads_stored_cache is False: blocks arrive dense
        # A label outside the block matches none of its columns.
        is_target = torch.arange(student.shape[1], device=student.device)[None, :] == (labels - col_start)[:, None]
        row_scale = rows.scale
        student_grad = torch.zeros_like(student)
        teacher_grad = torch.zeros_like(teacher) if plan.teacher_receives_grad and teacher is not None else None
        w_kl_s, w_kl_t = plan.kl_grad_weights
        if rows.lse_s is not None:
            assert rows.c_p is not None and rows.c_y is not None and rows.c_u is not None
            softmax, one_hot = torch.exp(student - rows.lse_s[:, None]), is_target.to(student.dtype)
            terms = softmax * rows.c_p[:, None] - one_hot * rows.c_y[:, None] - rows.c_u[:, None]
            student_grad += terms * row_scale[:, None]
        if teacher_grad is not None and rows.lse_t is not None and rows.c_ce_t is not None:
            assert teacher is not None  # c_ce_t·(softmax(t) − onehot)
            softmax, one_hot = torch.exp(teacher - rows.lse_t[:, None]), is_target.to(teacher.dtype)
            teacher_grad += softmax * rows.c_ce_t[:, None] - one_hot * rows.c_ce_t[:, None]
        if plan.computes_kl:
            divergence, formulas = plan.divergence, plan.formulas
            assert divergence is not None and formulas is not None and teacher is not None
            assert rows.lse_u is not None and rows.lse_v is not None and rows.keep is not None
            keep, consts = rows.keep[:, None] > 0, dict(rows.consts)
            target = is_target if divergence.needs_target else None
            symbols = _block_symbols(plan, student, teacher, rows.lse_u, rows.lse_v, target)
            sum_terms = plan.round_two_terms if sums_out is not None else ()
            student_kl, *column_terms = evaluate([formulas.student_grad, *sum_terms], symbols, consts)
            # A where, then ·keep (1, or a mixture's weight w_i): on a row not kept ∂D may be inf or NaN,
            # and 0·inf is NaN.
            weighted = torch.where(keep, student_kl, 0.0) * rows.keep[:, None]
            student_grad += (w_kl_s * row_scale)[:, None] * weighted
            if teacher_grad is not None and plan.kl_trains_teacher:
                assert formulas.teacher_grad is not None
                (teacher_kl,) = evaluate([formulas.teacher_grad], symbols, consts)
                teacher_grad += (w_kl_t * row_scale)[:, None] * torch.where(keep, teacher_kl, 0.0) * rows.keep[:, None]
            if sums_out is not None:  # in place: the chunk's round-2 sums, block after block
                sums_out += torch.stack([term.sum(1) for term in column_terms], dim=1)
        if plan.student_softcap is not None:  # through s = c·tanh(z/c): ∂s/∂z = 1 − (s/c)²
            student_grad *= 1.0 - (student / plan.student_softcap) ** 2
        if teacher_grad is not None and plan.teacher_softcap is not None:
            assert teacher is not None
            teacher_grad *= 1.0 - (teacher / plan.teacher_softcap) ** 2
        # An ignored row (scale 0) gets exactly 0 whatever its terms hold; a NaN scale (unowned) stays NaN.
        active = row_scale[:, None] != 0
        # Written into the destination's view (the staging, or the logits' gradient), in its dtype.
        student_grad = torch.where(active, student_grad, 0.0)
        out.student.add_(student_grad) if accumulate else out.student.copy_(student_grad)
        if out.teacher is not None:
            assert teacher_grad is not None
            out.teacher.copy_(torch.where(active, teacher_grad, 0.0))
