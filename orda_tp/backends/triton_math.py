"""Block math on generated Triton kernels (``orda_tp.kernels``): one pass over the block per
statistics round and one for the logit gradients."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..kernels import ops
from ..plan import LossPlan
from ..statistics import LogitFamily, PartitionRecord
from .chunk_stats import RowStats

__all__ = ["TritonBlockMath"]


class TritonBlockMath:
    reads_stored_cache = True

    def block_columns(self, configured: int, local_columns: int) -> int:
        return max(local_columns, 1)  # the kernels tile the columns themselves: one block per chunk

    def partition(
        self, student: Tensor, teacher: Tensor | None, labels: Tensor, col_start: int, families: Sequence[LogitFamily]
    ) -> PartitionRecord:
        return ops.partition_record(student, teacher, labels, col_start, families)

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

    def stage_logit_grads(
        self,
        plan: LossPlan,
        stats: RowStats,
        student: Tensor,
        teacher: Tensor | None,
        labels: Tensor,
        col_start: int,
        row_scale: Tensor,
        out: tuple[Tensor, Tensor | None],
    ) -> None:
        values: dict[str, Tensor] = {"scale": row_scale, **stats.kl_consts}
        if plan.student_ce_weight > 0:
            values["lse_s"] = stats.lse(plan, plan.ce_student_family)
        if plan.teacher_ce_trains_teacher:
            values["lse_t"], values["c_ce_t"] = stats.teacher_ce_terms(plan, row_scale)
        if plan.computes_kl:
            assert stats.kl_log_partitions is not None and stats.keep_kl_grad is not None
            values["lse_u"], values["lse_v"] = stats.kl_log_partitions
            values["keep"] = stats.keep_kl_grad.to(row_scale.dtype)
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
            values,
            temperatures,
            plan.logit_grad_weights,
            out,
        )
