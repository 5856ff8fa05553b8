"""Block math on generated Triton kernels (``orda_tp.kernels``): one pass over the block per
statistics round and one for the logit gradients, one launch per row step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor

from ..kernels import ops
from ..plan import LossPlan
from ..records import LogitFamily, PartitionRecord
from .logits import LogitGrads
from .row_formulas import RowProgram
from .stats import GradRows

__all__ = ["TritonBlockMath"]


class TritonBlockMath:
    """The kernels of :mod:`orda_tp.kernels.ops` on whole chunks (they tile the columns themselves)."""

    reads_stored_cache = True

    def block_columns(self, configured: int, local_columns: int) -> int:
        return max(local_columns, 1)  # the kernels tile the columns themselves: one block per chunk

    def partition(
        self, student: Tensor, teacher: Tensor | None, labels: Tensor, col_start: int, families: Sequence[LogitFamily]
    ) -> PartitionRecord:
        return ops.partition_record(student, teacher, labels, col_start, families)

    def merge_stacked(self, stacked: Tensor, num_families: int) -> PartitionRecord:
        return ops.merge_stacked_records(stacked, num_families)

    def kl_sums(
        self,
        plan: LossPlan,
        student: Tensor,
        teacher: Tensor,
        labels: Tensor,
        col_start: int,
        lse_u: Tensor,
        lse_v: Tensor,
    ) -> Tensor:
        assert plan.divergence is not None
        temperatures = (plan.student_temperature, plan.teacher_temperature)
        return ops.variant_sums(
            plan.divergence, plan.params, student, teacher, labels, col_start, lse_u, lse_v, temperatures
        )

    def rows(
        self, program: RowProgram, values: Mapping[str, Tensor], scalars: Mapping[str, float], like: Tensor
    ) -> Tensor:
        return ops.row_program(program.inputs, program.scalars, program.exprs, values, scalars, like)

    def stage_logit_grads(
        self,
        plan: LossPlan,
        rows: GradRows,
        student: Tensor,
        teacher: Tensor | None,
        labels: Tensor,
        col_start: int,
        out: LogitGrads,
    ) -> None:
        terms = ops.GradTerms(
            student_ce=plan.student_ce_weight > 0,
            student_kl=plan.computes_kl,
            teacher_ce=plan.teacher_ce_trains_teacher,
            teacher_kl=plan.kl_trains_teacher,
            has_teacher=teacher is not None,
        )
        temperatures = (plan.student_temperature, plan.teacher_temperature)
        ops.logit_grads(
            plan.divergence,
            plan.params,
            terms,
            student,
            teacher,
            labels,
            col_start,
            rows.packed,
            rows.names,
            temperatures,
            plan.logit_grad_weights,
            (out.student, out.teacher),
        )
