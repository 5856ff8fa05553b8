"""The logits doors' tensor-parallel inputs: logits sharded along their last dimension, as plain
local tensors with ``tp_group`` (the shards in rank order) or DTensors ``Shard(-1)`` on one mesh
dimension (``torch.chunk`` order; other mesh dimensions ``Replicate`` or row shards), unwrapped to
this rank's parts (docs/architecture.md, "Logits-level losses").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from ..arguments.options import check_group
from .dtensor import MeshAxis, chunk_range, is_dtensor, mesh_group, placement_text, shard_axis
from .local_shards import same_ranks

try:
    from torch.distributed.tensor import Replicate, Shard
except ImportError:  # torch without DTensor: is_dtensor is always False
    Replicate = Shard = None  # type: ignore[assignment, misc]  # the fallback binding; mypy reads the installed torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "LocalLogits",
    "local_companion",
    "local_head_weight",
    "local_logits",
    "local_student",
    "logits_call_group",
    "logits_group",
]


def _vocab_axis(logits: DTensor, name: str) -> MeshAxis | None:
    """The mesh dimension along which a logits DTensor is sharded on its last dimension (None when
    the vocabulary is not sharded); placements other than Replicate and row shards raise."""
    last = logits.ndim - 1
    vocab_dims = []
    for mesh_dim, placement in enumerate(logits.placements):
        if isinstance(placement, Shard) and placement.dim % logits.ndim == last:  # Shard(-1) is Shard(ndim − 1)
            vocab_dims.append(mesh_dim)
        elif not isinstance(placement, (Replicate, Shard)):
            raise ValueError(f"{name} has a DTensor placement this loss cannot handle: {placement_text(logits)}")
    if len(vocab_dims) > 1:
        raise ValueError(
            f"{name} is sharded on its last (vocabulary) dimension over {len(vocab_dims)} mesh dimensions; this "
            f"loss handles one: {placement_text(logits)}"
        )
    if not vocab_dims:
        return None
    mesh = logits.device_mesh
    dim = vocab_dims[0]
    return MeshAxis(mesh.get_group(dim), dim, mesh.size(dim), mesh.get_local_rank(dim), mesh)


def logits_group(student_logits: object, tp_group: object) -> tuple[dist.ProcessGroup | None, MeshAxis | None]:
    """The call's group and, for a DTensor sharded on its last dimension, its mesh axis, from the
    keyword and the placements alone."""
    # The placements are the same on every rank: every rank decides (and raises) alike, before any collective.
    tp_group = check_group(tp_group)
    if not is_dtensor(student_logits):
        return tp_group, None
    axis = _vocab_axis(student_logits, "student_logits")
    if axis is None:
        if tp_group is not None:
            raise ValueError(
                "tp_group is given but student_logits is a DTensor whose last (vocabulary) dimension is not "
                f"sharded: {placement_text(student_logits)}"
            )
        return None, None
    if tp_group is not None and not same_ranks(tp_group, axis.group):
        raise ValueError(
            "tp_group is not the process group of the mesh dimension along which student_logits is sharded"
        )
    return axis.group, axis


def logits_call_group(student_logits: object, tp_group: object) -> dist.ProcessGroup | None:
    """The group of a call whose keywords may not be valid yet: ``tp_group`` when it is a process
    group, else that of DTensor ``student_logits`` sharded on the last dimension (None: one
    device, or no group to tell the others through)."""
    if isinstance(tp_group, dist.ProcessGroup):
        return tp_group
    try:
        return logits_group(student_logits, None)[0]
    except ValueError:  # a placement this loss cannot handle
        return mesh_group(student_logits)


@dataclass(frozen=True)
class LocalLogits:
    """This rank's parts of the arguments (not checked yet: anything but a DTensor passes through
    as given) and its global columns ``[start, stop)`` when a DTensor says so (None: the shards lie
    in rank order)."""

    student: object
    teacher: object
    labels: object
    vocab_range: tuple[int, int] | None


def local_companion(tensor: object, student: object, axis: MeshAxis | None, name: str, vocabulary: bool) -> object:
    """The local part of a tensor that accompanies ``student_logits`` (plain tensors pass through):
    a DTensor on the student's mesh with its placements, except on the vocabulary's mesh dimension:
    Replicate, or for ``vocabulary`` tensors (teacher logits) Shard(-1) too."""
    if not is_dtensor(tensor):
        return tensor
    if not is_dtensor(student):
        raise ValueError(
            f"{name} is a DTensor but student_logits is not: pass both as DTensors, or plain local tensors "
            "with tp_group"
        )
    placements = list(tensor.placements)
    expected = list(student.placements)
    replicated = axis is not None and (not vocabulary or isinstance(placements[axis.dim], Replicate))
    if replicated:
        assert axis is not None
        expected[axis.dim] = Replicate()
    if tensor.device_mesh != student.device_mesh or placements != expected:
        allowed = "Shard(-1) or Replicate" if vocabulary else "Replicate"
        raise ValueError(
            f"{name} as a DTensor must live on student_logits' mesh with its placements ({allowed} on the "
            f"vocabulary's mesh dimension), got {placement_text(tensor)} next to student_logits' "
            f"{placement_text(student)}"
        )
    local = tensor.to_local()
    if replicated and vocabulary:
        assert axis is not None
        start, stop = chunk_range(local.shape[-1], axis.size, axis.coordinate)
        local = local[..., start:stop]  # a replicated teacher: this rank's columns, in torch.chunk order
    return local


def local_head_weight(weight: object, axis: MeshAxis | None, name: str) -> object:
    """A head weight's local rows: a DTensor must be Shard(0) on the vocabulary's mesh dimension
    of ``student_logits`` and Replicate on the others (plain tensors pass through)."""
    if not is_dtensor(weight):
        return weight
    weight_axis = shard_axis(weight, name)
    if axis is None or weight_axis.mesh != axis.mesh or weight_axis.dim != axis.dim:
        raise ValueError(
            f"{name} as a DTensor must be sharded on the mesh dimension along which student_logits is sharded "
            f"on its last dimension, got {placement_text(weight)}"
        )
    return weight.to_local()


def local_student(student_logits: object, axis: MeshAxis | None) -> tuple[object, tuple[int, int] | None]:
    """``student_logits``' local part and, for a DTensor sharded on its last dimension, this rank's
    global columns (``torch.chunk`` order); plain tensors pass through."""
    if not is_dtensor(student_logits):
        return student_logits, None
    vocab_range = None
    if axis is not None:
        vocab_range = chunk_range(student_logits.shape[-1], axis.size, axis.coordinate)
    return student_logits.to_local(), vocab_range


def local_logits(student_logits: object, teacher_logits: object, labels: object, axis: MeshAxis | None) -> LocalLogits:
    """Local shards of DTensor inputs (plain tensors pass through: they are this rank's shards)."""
    teacher = local_companion(teacher_logits, student_logits, axis, "teacher_logits", vocabulary=True)
    local_labels = local_companion(labels, student_logits, axis, "labels", vocabulary=False)
    student, vocab_range = local_student(student_logits, axis)
    return LocalLogits(student, teacher, local_labels, vocab_range)
