"""Turn a call's arguments into local shards and an agreed :class:`VocabLayout`.

Inputs may be DTensors (group, vocabulary range and sequence parallelism read off their
placements) or plain local shards with an explicit ``tp_group``. Without either, the call runs on
one device and the layout covers the whole head (minus padding past ``vocab_size``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist
from torch import Tensor

from ..teachers import PrecomputedTeacher, SeparateTeacher, Teacher, TiedTeacher
from .dtensor import MeshAxis, chunk_range, is_dtensor, local_shard, shard_axis
from .layout import HeadShard, ShardClaim, VocabLayout, resolve_layout

__all__ = ["LocalInputs", "agree_layout", "check_group", "localize", "same_ranks", "tp_group_of"]


@dataclass(frozen=True)
class LocalInputs:
    """The call's tensors as this rank holds them, and the tensor-parallel setting."""

    student_hidden: Tensor
    weight: Tensor
    labels: Tensor
    teacher: Teacher
    group: dist.ProcessGroup | None
    vocab_range: tuple[int, int] | None
    sequence_parallel: bool


def check_group(group: object) -> dist.ProcessGroup | None:
    if group is None:
        return None
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"tp_group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    return group


def same_ranks(a: dist.ProcessGroup, b: dist.ProcessGroup) -> bool:
    return dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)


def _local_teacher(teacher: Teacher, axis: MeshAxis, hidden_sharded: bool) -> Teacher:
    def hidden(tensor: Tensor, name: str) -> Tensor:
        if not is_dtensor(tensor):
            return tensor
        local, sharded = local_shard(tensor, axis, name, (0,))
        if sharded != hidden_sharded:
            raise ValueError(
                f"{name} and student_hidden must both be Shard(0) or both Replicate on the tp mesh dimension"
            )
        return local

    def head(tensor: Tensor, name: str) -> Tensor:
        if not is_dtensor(tensor):
            return tensor
        if shard_axis(tensor, name).dim != axis.dim:
            raise ValueError(f"{name} must be sharded on the same mesh dimension as the student's weight")
        return tensor.to_local()

    if isinstance(teacher, TiedTeacher):
        return TiedTeacher(hidden(teacher.hidden, "teacher.hidden"), teacher.mode)
    if isinstance(teacher, SeparateTeacher):
        return SeparateTeacher(hidden(teacher.hidden, "teacher.hidden"), head(teacher.weight, "teacher.weight"))
    if teacher.logits is not None:
        logits = teacher.logits
        if is_dtensor(logits):
            logits, sharded = local_shard(logits, axis, "teacher.logits", (1, -1))
            if not sharded:  # replicated cache: keep this rank's columns
                start, stop = chunk_range(logits.shape[1], axis.size, axis.coordinate)
                logits = logits[:, start:stop]
        return replace(teacher, logits=logits)
    assert teacher.teacher_hidden is not None and teacher.teacher_weight is not None
    return replace(
        teacher,
        teacher_hidden=hidden(teacher.teacher_hidden, "teacher.teacher_hidden"),
        teacher_weight=head(teacher.teacher_weight, "teacher.teacher_weight"),
    )


def localize(
    student_hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    teacher: Teacher,
    tp_group: object,
    vocab_range: tuple[int, int] | None,
    sequence_parallel: bool | None,
) -> LocalInputs:
    """Local shards of DTensor inputs (plain tensors pass through) and the tp setting."""
    group = check_group(tp_group)
    if not is_dtensor(weight):
        others = [("student_hidden", student_hidden), ("labels", labels)] + [
            (f"teacher.{name}", tensor) for name, tensor in teacher.named_tensors()
        ]
        wrapped = [name for name, tensor in others if is_dtensor(tensor)]
        if wrapped:
            verb = "is a DTensor" if len(wrapped) == 1 else "are DTensors"
            raise ValueError(
                f"{', '.join(wrapped)} {verb} but weight is not: pass the head weight as a DTensor "
                "sharded on dim 0, or plain local tensors with tp_group"
            )
        if sequence_parallel and group is None:
            raise ValueError("sequence_parallel=True needs tp_group (or a DTensor student_hidden)")
        return LocalInputs(student_hidden, weight, labels, teacher, group, vocab_range, bool(sequence_parallel))
    axis = shard_axis(weight, "weight")
    if group is not None and not same_ranks(group, axis.group):
        raise ValueError("tp_group is not the process group of the mesh dimension along which weight is sharded")
    derived_range = chunk_range(weight.shape[0], axis.size, axis.coordinate)
    if vocab_range is not None and tuple(vocab_range) != derived_range:
        raise ValueError(
            f"vocab_range={tuple(vocab_range)} disagrees with the DTensor weight's shard {derived_range} "
            "(torch.chunk order); leave vocab_range=None"
        )
    hidden, sharded = student_hidden, bool(sequence_parallel)
    if is_dtensor(student_hidden):
        hidden, sharded = local_shard(student_hidden, axis, "student_hidden", (0,))
        if sequence_parallel is not None and bool(sequence_parallel) != sharded:
            raise ValueError(
                f"sequence_parallel={sequence_parallel} disagrees with student_hidden's placement on the tp mesh "
                f"dimension ({'Shard(0)' if sharded else 'Replicate'})"
            )
    local_labels = labels
    if is_dtensor(labels):
        local_labels, labels_sharded = local_shard(labels, axis, "labels", ())
        assert not labels_sharded
    return LocalInputs(
        student_hidden=hidden,
        weight=weight.to_local(),
        labels=local_labels,
        teacher=_local_teacher(teacher, axis, sharded),
        group=axis.group,
        vocab_range=derived_range,
        sequence_parallel=sharded,
    )


def _teacher_columns(teacher: Teacher) -> int:
    if isinstance(teacher, SeparateTeacher):
        return teacher.weight.shape[0]
    if isinstance(teacher, PrecomputedTeacher):
        if teacher.logits is not None:
            return teacher.logits.shape[1]
        assert teacher.teacher_weight is not None  # a cache holds logits, or hidden states and a head
        return teacher.teacher_weight.shape[0]
    return -1


def agree_layout(
    group: dist.ProcessGroup | None, inputs: LocalInputs | None, vocab_size: int | None, problem: Exception | None
) -> VocabLayout:
    """The layout of this call: the whole head on one device, or agreed across ``group``.

    On a group, ``inputs`` is None and ``problem`` set when this rank's own checks failed; the
    handshake then makes every rank raise.
    """
    if group is None:
        assert inputs is not None
        if inputs.vocab_range is not None:
            raise ValueError("vocab_range describes a shard of a tensor-parallel head and needs tp_group")
        return VocabLayout.single_device(inputs.weight.shape[0], vocab_size)
    if inputs is None:
        return resolve_layout(group, ShardClaim(failed=1), None, None, problem)
    start, stop = inputs.vocab_range if inputs.vocab_range is not None else (-1, -1)
    claim = ShardClaim(
        local_columns=inputs.weight.shape[0],
        teacher_columns=_teacher_columns(inputs.teacher),
        range_start=start,
        range_stop=stop,
        vocab_size=-1 if vocab_size is None else vocab_size,
        label_rows=inputs.labels.shape[0],
        hidden_rows=inputs.student_hidden.shape[0],
        sequence_parallel=int(inputs.sequence_parallel),
    )
    return resolve_layout(group, claim, inputs.labels, HeadShard("weight", inputs.weight, 0), problem)


def tp_group_of(weight: object, tp_group: object) -> dist.ProcessGroup | None:
    """The call's tensor-parallel group: ``tp_group``, or the mesh group a DTensor weight is
    sharded over (placements are the same on every rank, so every rank decides alike)."""
    group = check_group(tp_group)
    if group is None and is_dtensor(weight):
        return shard_axis(weight, "weight").group
    return group
