"""The fused path's head: the tensors that produce this device's logits, and their logits source."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .logits import HeadLogits, LogitsSource, PairedLogits, StoredLogits, TiedLogits

__all__ = ["HeadTensors"]


@dataclass(frozen=True)
class HeadTensors:
    """The tensors that produce logits on this device, every row of the batch.

    ``weight`` (V_local, H) is the student head; the teacher reads ``teacher_weight`` when set
    (separate head, or a cached hidden + head), ``weight`` when tied, or ``teacher_logits``
    (a cache, (BT, V_local)). Local columns at or past ``columns`` are vocabulary padding: no
    logits are formed there, so they hold no probability mass and receive no gradient.
    """

    student_hidden: Tensor
    weight: Tensor
    teacher_hidden: Tensor | None
    teacher_weight: Tensor | None
    teacher_logits: Tensor | None
    columns: int

    @property
    def teacher_head(self) -> Tensor:
        return self.weight if self.teacher_weight is None else self.teacher_weight

    @property
    def tied(self) -> bool:
        """Whether teacher rows go through the student's head (one GEMM serves both sides)."""
        return self.teacher_hidden is not None and self.teacher_weight is None and self.teacher_logits is None

    def gemm_operands(self, teacher_trained: bool) -> list[Tensor]:
        """The tensors the gradient GEMMs multiply staged logit gradients with."""
        tensors: list[Tensor | None] = [self.student_hidden, self.weight]
        if teacher_trained:
            tensors += [self.teacher_hidden, self.teacher_head]
        return [t for t in tensors if t is not None]

    def logits_source(self, with_teacher: bool) -> LogitsSource:
        """The student's logits ``h_s·Wᵀ`` and, ``with_teacher``, the teacher's: through the same
        GEMM as the student's (tied), from the cache, or ``h_t·W_tᵀ``."""
        student = HeadLogits(self.student_hidden, self.weight)
        if not with_teacher:
            return PairedLogits(student, None)
        if self.tied:
            assert self.teacher_hidden is not None
            return TiedLogits(self.student_hidden, self.teacher_hidden, self.weight)
        if self.teacher_logits is not None:
            return PairedLogits(student, StoredLogits(self.teacher_logits))
        assert self.teacher_hidden is not None
        return PairedLogits(student, HeadLogits(self.teacher_hidden, self.teacher_head))
