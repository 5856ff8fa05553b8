"""The resolved plan of one loss call: weights, temperatures, variant, teacher routing.

Everything here is derived from validated user arguments; backends read the plan and never
re-derive routing or defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import KernelConfig
from .divergences import Divergence, DivergenceParams
from .records import LogitFamily

__all__ = ["LossPlan", "REDUCTIONS"]

REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True)
class LossPlan:
    """What to compute for ``loss = w_s·CE_s + w_t·CE_t + w_kl·T_s²·D(p, q)``.

    ``teacher_role`` follows docs/variants.md §2: "cotrained" when a co-training variant (mutual, cojeffreys)
    has ``kl_weight > 0``; else "trained" when ``teacher_ce_weight > 0``; else "frozen".
    ``families`` lists the distinct logit families whose log-partitions round 1 computes.
    """

    student_ce_weight: float
    teacher_ce_weight: float
    kl_weight: float
    student_temperature: float
    teacher_temperature: float
    divergence: Divergence | None
    params: DivergenceParams
    reduction: str
    ignore_index: int
    teacher_kind: str  # "tied", "separate", "precomputed_logits" or "precomputed_hidden"
    teacher_role: str
    config: KernelConfig

    @property
    def computes_kl(self) -> bool:
        return self.kl_weight > 0 and self.divergence is not None

    @property
    def needs_teacher_logits(self) -> bool:
        return self.computes_kl or self.teacher_ce_weight > 0

    @property
    def teacher_receives_grad(self) -> bool:
        """Whether any gradient flows into the teacher's logits (never for a cache)."""
        if self.teacher_kind.startswith("precomputed"):
            return False
        return self.teacher_role == "cotrained" or (self.teacher_role == "trained" and self.teacher_ce_weight > 0)

    @property
    def kl_trains_teacher(self) -> bool:
        return self.teacher_role == "cotrained" and self.teacher_receives_grad

    @property
    def teacher_ce_trains_teacher(self) -> bool:
        return self.teacher_receives_grad and self.teacher_ce_weight > 0

    @property
    def logit_grad_weights(self) -> tuple[float, float, float]:
        """``(w_s, w_kl·T_s, w_kl·T_s²/T_t)``: the factors of the student's CE gradient, of
        ``∂D/∂u`` in ``∂loss/∂s`` and of ``∂D/∂v`` in ``∂loss/∂t`` (before the row scale)."""
        kl_student = self.kl_weight * self.student_temperature
        return self.student_ce_weight, kl_student, kl_student * self.student_temperature / self.teacher_temperature

    @property
    def student_receives_grad(self) -> bool:
        return self.student_ce_weight > 0 or self.computes_kl

    @property
    def ce_student_family(self) -> LogitFamily:
        return LogitFamily("student", 1.0)

    @property
    def ce_teacher_family(self) -> LogitFamily:
        return LogitFamily("teacher", 1.0)

    @property
    def kl_student_family(self) -> LogitFamily:
        return LogitFamily("student", self.student_temperature)

    @property
    def kl_teacher_family(self) -> LogitFamily:
        return LogitFamily("teacher", self.teacher_temperature)

    @property
    def families(self) -> tuple[LogitFamily, ...]:
        wanted: list[LogitFamily] = []
        if self.student_ce_weight > 0:
            wanted.append(self.ce_student_family)
        if self.teacher_ce_weight > 0:
            wanted.append(self.ce_teacher_family)
        if self.computes_kl:
            wanted += [self.kl_student_family, self.kl_teacher_family]
        return tuple(dict.fromkeys(wanted))
