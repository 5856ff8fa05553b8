"""Checks that read tensor values (and so synchronize with the device where it is not the CPU).

On one device a failed check raises at once. On a tensor-parallel shard it becomes a
:class:`LocalError` that the first record exchange shares, so that every rank raises it.
"""

from __future__ import annotations

from torch import Tensor

from .config import KernelConfig
from .parallel.layout import VocabLayout
from .parallel.shard_exchange import LocalError, LocalErrorCode
from .plan import LossPlan
from .teachers import PrecomputedTeacher, Teacher
from .validation import check_finite, first_non_finite

__all__ = ["check_values", "local_error"]


def _head_tensors(student_hidden: Tensor, weight: Tensor, teacher: Teacher) -> list[tuple[str, Tensor]]:
    """The tensors ``check_finite_inputs`` covers: the student's and a trainable teacher's."""
    named = [("student_hidden", student_hidden), ("weight", weight)]
    if not isinstance(teacher, PrecomputedTeacher):  # a cache has its own checks
        named += [(f"teacher {name}", tensor) for name, tensor in teacher.named_tensors()]
    return named


def check_values(
    plan: LossPlan, config: KernelConfig, student_hidden: Tensor, weight: Tensor, teacher: Teacher, vocab_size: int
) -> None:
    """Single device: raise on a modified cache, a non-finite cache (where host checks run, see
    ``KernelConfig.host_checks``), or (with ``check_finite_inputs``) a non-finite hidden state or
    weight. Padding columns (≥ ``vocab_size``) are not read."""
    if isinstance(teacher, PrecomputedTeacher):
        teacher.check_unmodified()
        if plan.needs_teacher_logits and config.runs_host_checks(student_hidden.device.type == "cpu"):
            if teacher.logits is not None:
                check_finite("teacher.logits", teacher.logits[:, :vocab_size], allow_neg_inf=True)
            else:
                for name, tensor in teacher.named_tensors():
                    check_finite(f"teacher.{name}", tensor)
    if config.check_finite_inputs:
        for name, tensor in _head_tensors(student_hidden, weight, teacher):
            check_finite(name, tensor)


def local_error(
    plan: LossPlan,
    config: KernelConfig,
    student_hidden: Tensor,
    weight: Tensor,
    teacher: Teacher,
    original_teacher: Teacher,
    layout: VocabLayout,
) -> LocalError | None:
    """Tensor-parallel shard: the first failed check of :func:`check_values` on this rank's
    tensors, as a :class:`LocalError` (global column numbers), or None.

    A cache whose rows :meth:`PrecomputedTeacher.prepare_logits` shifted by this shard's own
    maximum raises at once: that is a property of how the program built its descriptor, not of
    the shard's values, so every rank of the group built it alike and raises here (after the
    handshake, before the first record exchange)."""
    if isinstance(original_teacher, PrecomputedTeacher) and original_teacher.rows_shifted_locally:
        raise ValueError(
            "PrecomputedTeacher.prepare_logits shifted each row of this rank's teacher.logits shard by the "
            "shard's own maximum, a shift that differs between the vocabulary shards and so changes the teacher's "
            "distribution; on a tensor-parallel group cast the shard itself (PrecomputedTeacher(logits=shard.to("
            "dtype))), or call prepare_logits on a DTensor of the logits (its rows are whole)"
        )
    if isinstance(original_teacher, PrecomputedTeacher) and original_teacher.modified_tensor() is not None:
        return LocalError(LocalErrorCode.CACHE_MODIFIED)
    host_checks = config.runs_host_checks(student_hidden.device.type == "cpu")
    if isinstance(teacher, PrecomputedTeacher) and plan.needs_teacher_logits and host_checks:
        if teacher.logits is not None:
            index = first_non_finite(teacher.logits[:, : layout.real_local_columns], allow_neg_inf=True)
            if index is not None:
                return LocalError(LocalErrorCode.TEACHER_LOGITS_NOT_FINITE, index[0], layout.vocab_start + index[1])
        elif any(first_non_finite(tensor) is not None for _, tensor in teacher.named_tensors()):
            return LocalError(LocalErrorCode.CACHE_NOT_FINITE)
    if config.check_finite_inputs:
        for _, tensor in _head_tensors(student_hidden, weight, teacher):
            index = first_non_finite(tensor)
            if index is not None:
                return LocalError(LocalErrorCode.INPUT_NOT_FINITE, index[0], index[1])
    return None
