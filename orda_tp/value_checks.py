"""Checks that read tensor values (and so synchronize with the device where it is not the CPU).

On one device a failed check raises at once. On a tensor-parallel shard it becomes a
:class:`LocalError` that the first record exchange shares, so that every rank raises it.
"""

from __future__ import annotations

from torch import Tensor

from .checks import check_finite, first_non_finite
from .config import KernelConfig
from .parallel.layout import VocabLayout
from .parallel.shard_exchange import LocalError, LocalErrorCode
from .plan import LossPlan
from .teachers import TeacherSource, ValueCheck

__all__ = ["check_values", "local_error"]


def _input_tensors(student_hidden: Tensor, weight: Tensor, teacher: TeacherSource) -> list[tuple[str, Tensor]]:
    """The tensors ``check_finite_inputs`` covers: the student's and a trainable teacher's."""
    return [("student_hidden", student_hidden), ("weight", weight), *teacher.trained_tensors()]


def _cache_checks(
    plan: LossPlan, config: KernelConfig, teacher: TeacherSource, on_cpu: bool, columns: int
) -> list[ValueCheck]:
    """The cached teacher values the call reads on the host: only where host checks run (see
    ``KernelConfig.host_checks``) and the teacher's logits are read at all."""
    if not (plan.needs_teacher_logits and config.runs_host_checks(on_cpu)):
        return []
    return teacher.checked_values(columns)


def check_values(
    plan: LossPlan, config: KernelConfig, student_hidden: Tensor, weight: Tensor, teacher: TeacherSource, columns: int
) -> None:
    """Single device: raise on a modified cache, a non-finite cache, or (with
    ``check_finite_inputs``) a non-finite hidden state or weight. ``columns``: the real columns
    (padding past ``vocab_size`` is not read)."""
    teacher.check_unmodified()
    for check in _cache_checks(plan, config, teacher, student_hidden.device.type == "cpu", columns):
        check_finite(check.name, check.tensor, allow_neg_inf=check.allow_neg_inf)
    if config.check_finite_inputs:
        for name, tensor in _input_tensors(student_hidden, weight, teacher):
            check_finite(name, tensor)


def local_error(
    plan: LossPlan,
    config: KernelConfig,
    student_hidden: Tensor,
    weight: Tensor,
    teacher: TeacherSource,
    original_teacher: TeacherSource,
    layout: VocabLayout,
) -> LocalError | None:
    """Tensor-parallel shard: the first failed check of :func:`check_values` on this rank's
    tensors (``teacher``; ``original_teacher`` is the descriptor as the call received it), as a
    :class:`LocalError` (global column numbers), or None.

    A descriptor that cannot stand for one vocabulary shard raises at once: that is a property of
    how the program built it, not of the shard's values, so every rank of the group built it alike
    and raises here (after the handshake, before the first record exchange)."""
    original_teacher.check_shardable()
    try:
        original_teacher.check_unmodified()
    except ValueError:
        return LocalError(LocalErrorCode.CACHE_MODIFIED)
    on_cpu = student_hidden.device.type == "cpu"
    for check in _cache_checks(plan, config, teacher, on_cpu, layout.real_local_columns):
        index = first_non_finite(check.tensor, allow_neg_inf=check.allow_neg_inf)
        if index is not None:
            # A logits cache (−inf allowed) is located by row and global column; a hidden cache is not.
            if check.allow_neg_inf:
                return LocalError(LocalErrorCode.TEACHER_LOGITS_NOT_FINITE, index[0], layout.vocab_start + index[1])
            return LocalError(LocalErrorCode.CACHE_NOT_FINITE)
    if config.check_finite_inputs:
        for _, tensor in _input_tensors(student_hidden, weight, teacher):
            index = first_non_finite(tensor)
            if index is not None:
                return LocalError(LocalErrorCode.INPUT_NOT_FINITE, index[0], index[1])
    return None
