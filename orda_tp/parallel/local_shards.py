"""A tensor-parallel call's arguments (DTensors, or plain local shards with ``tp_group``) as this
rank's checked shards and its share for the layout handshake (:func:`shard_inputs`), and this
rank's value checks (:func:`local_error`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist
from torch import Tensor

from ..arguments.options import LossOptions
from ..arguments.validation import (
    ValueChecks,
    check_denominator,
    check_inputs,
    check_token_weights,
    first_non_finite,
    runs_host_checks,
)
from ..teachers import TeacherMixture, TeacherSource
from .dtensor import MeshAxis, chunk_range, is_dtensor, local_shard, mesh_group, shard_axis
from .fsdp import check_not_fsdp_sharded
from .layout import HeadShard, LocalShard, VocabLayout
from .shard_exchange import LocalError, LocalErrorCode

__all__ = [
    "DTensorShards",
    "LocalInputs",
    "call_group",
    "local_error",
    "same_ranks",
    "shard_inputs",
]


@dataclass(frozen=True, kw_only=True)
class LocalInputs:
    """The call's tensors as this rank holds them (``bias``: the student head's, or None), the
    tensor-parallel setting (``group`` None: one device) and, once checked, the given denominator
    of "mean" and the (rows,) token weights."""

    student_hidden: Tensor
    weight: Tensor
    labels: Tensor
    teacher: TeacherSource
    bias: Tensor | None = None
    group: dist.ProcessGroup | None = None
    vocab_range: tuple[int, int] | None = None
    sequence_parallel: bool = False
    denominator: float | Tensor | None = None
    row_weights: Tensor | None = None


def same_ranks(a: dist.ProcessGroup, b: dist.ProcessGroup) -> bool:
    return dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)


@dataclass(frozen=True)
class DTensorShards:
    """The :class:`orda_tp.teachers.ShardReader` of a call whose student weight is a DTensor
    sharded along ``axis``: DTensor teacher tensors become this rank's shards, plain ones pass."""

    axis: MeshAxis
    hidden_sharded: bool  # whether the student's hidden states are Shard(0) (sequence parallel)

    def hidden(self, tensor: Tensor, name: str) -> Tensor:
        if not is_dtensor(tensor):
            return tensor
        local, sharded = local_shard(tensor, self.axis, name, (0,))
        if sharded != self.hidden_sharded:
            raise ValueError(
                f"{name} and student_hidden must both be Shard(0) or both Replicate on the tp mesh dimension"
            )
        return local

    def head(self, tensor: Tensor, name: str) -> Tensor:
        if not is_dtensor(tensor):
            return tensor
        if shard_axis(tensor, name).dim != self.axis.dim:
            raise ValueError(f"{name} must be sharded on the same mesh dimension as the student's weight")
        return tensor.to_local()

    def logits(self, tensor: Tensor, name: str) -> Tensor:
        if not is_dtensor(tensor):
            return tensor
        local, sharded = local_shard(tensor, self.axis, name, (1, -1))
        if sharded:
            return local
        start, stop = chunk_range(local.shape[1], self.axis.size, self.axis.coordinate)
        return local[:, start:stop]  # replicated cache: keep this rank's columns


def _localize(
    student_hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    teacher: TeacherSource,
    group: dist.ProcessGroup | None,
    vocab_range: tuple[int, int] | None,
    sequence_parallel: bool | None,
    bias: Tensor | None = None,
) -> LocalInputs:
    """Local shards of DTensor inputs (plain tensors pass through) and the tp setting
    (``group``: the checked ``tp_group``); a DTensor ``bias`` is sharded like the weight's rows."""
    if not is_dtensor(weight):
        given_bias = [] if bias is None else [("bias", bias)]
        others = [("student_hidden", student_hidden), ("labels", labels), *given_bias] + [
            (f"teacher.{name}", tensor) for name, tensor in teacher.named_tensors()
        ]
        wrapped = [name for name, tensor in others if is_dtensor(tensor)]
        if wrapped:
            verb = "is a DTensor" if len(wrapped) == 1 else "are DTensors"
            raise ValueError(
                f"{', '.join(wrapped)} {verb} but weight is not: pass the head weight as a DTensor "
                "sharded on dim 0, or plain local tensors with tp_group"
            )
        return LocalInputs(
            student_hidden=student_hidden,
            weight=weight,
            labels=labels,
            teacher=teacher,
            bias=bias,
            group=group,
            vocab_range=vocab_range,
            sequence_parallel=bool(sequence_parallel),
        )
    axis = shard_axis(weight, "weight")
    if group is not None and not same_ranks(group, axis.group):
        raise ValueError("tp_group is not the process group of the mesh dimension along which weight is sharded")
    derived_range = chunk_range(weight.shape[0], axis.size, axis.coordinate)  # DTensor's torch.chunk order
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
        assert not labels_sharded  # no shard dims allowed on the tp axis: the labels are replicated there
    reader = DTensorShards(axis, sharded)
    return LocalInputs(
        student_hidden=hidden,
        weight=weight.to_local(),
        labels=local_labels,
        teacher=teacher.localized(reader),
        bias=None if bias is None else reader.head(bias, "bias"),
        group=axis.group,
        vocab_range=derived_range,
        sequence_parallel=sharded,
    )


def _tp_group_of(weight: object, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The call's tensor-parallel group: ``group`` (the checked ``tp_group``), or the mesh group a
    DTensor weight is sharded over (the same placements, and decision, on every rank)."""
    if group is None and is_dtensor(weight):
        return shard_axis(weight, "weight").group
    return group


def call_group(weight: object, tp_group: object) -> dist.ProcessGroup | None:
    """The group of a call whose keywords may not be valid yet: ``tp_group`` when it is a process
    group, else the mesh group of a DTensor ``weight`` sharded on dim 0 (None: one device, or no
    group to tell the others through)."""
    if isinstance(tp_group, dist.ProcessGroup):
        return tp_group
    try:
        return _tp_group_of(weight, None)
    except ValueError:  # a DTensor weight not sharded on dim 0
        return mesh_group(weight)


def shard_inputs(
    options: LossOptions,
    student_hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    teacher: TeacherSource,
    num_valid_tokens: object,
    token_weights: object,
    bias: Tensor | None = None,
) -> tuple[LocalInputs, LocalShard]:
    """This rank's checked tensors of a tensor-parallel call (a ``tp_group``, or DTensor inputs)
    and its share for the layout handshake. Every check that reads only this rank's own arguments
    runs here (FSDP2 shards posing as vocabulary shards, the backend, the placements, types, shapes
    and devices, the teacher descriptor, ``num_valid_tokens``, ``token_weights``) and raises a
    ValueError or TypeError."""
    # Before any collective: every data-parallel rank holds the same FSDP structure, so all raise alike.
    heads = [("weight", weight), *([] if bias is None else [("bias", bias)])]
    for name, tensor in [*heads, *((f"teacher.{n}", t) for n, t in teacher.named_tensors())]:
        check_not_fsdp_sharded(name, tensor)
    if options.backend == "reference":
        raise ValueError("backend='reference' builds full logits on one device; with tp_group use 'torch' or 'auto'")
    local = _localize(
        student_hidden, weight, labels, teacher, options.tp_group, options.vocab_range, options.sequence_parallel, bias
    )
    assert local.group is not None  # a call without one raised (no DTensor weight on a 1-D mesh, no tp_group)
    row_shards = dist.get_world_size(local.group) if local.sequence_parallel else 1  # hidden rows: BT / tp each
    check_inputs(
        local.student_hidden, local.weight, local.labels, local.teacher, sharded=True, row_shards=row_shards,
        bias=local.bias,
    )  # fmt: skip
    teacher.check_shardable()
    if isinstance(local.teacher, TeacherMixture):  # its weights' values read once, its form decided
        local = replace(local, teacher=local.teacher.prepared(local.labels.shape[0]))
    device = local.student_hidden.device
    denominator = check_denominator("num_valid_tokens", num_valid_tokens, options.reduction, device, "student_hidden")
    row_weights = None
    if token_weights is not None:
        host_checks = runs_host_checks(options.kernel_config.host_checks, device)
        row_weights = check_token_weights(token_weights, local.labels, host_checks)
    teacher_columns = local.teacher.vocab_columns()
    shard = LocalShard(
        head=HeadShard("weight", local.weight, 0),
        labels=local.labels,
        vocab_range=local.vocab_range,
        teacher_columns=teacher_columns,
        vocab_size=options.vocab_size,
        sequence_parallel=local.sequence_parallel,
        replicated=[
            *([] if row_weights is None else [("token_weights", row_weights)]),
            *local.teacher.replicated_tensors(),
        ],
    )
    return replace(local, denominator=denominator, row_weights=row_weights), shard


def local_error(values: ValueChecks, layout: VocabLayout, host_checks: bool) -> LocalError | None:
    """The first failed value check of this rank's tensors, as a :class:`LocalError` (global
    column numbers) that the first record exchange shares, so that every rank raises it; or None.
    The checks are those of :func:`orda_tp.arguments.validation.check_values` on one device."""
    # The cache's values are read on the host only where host checks run and the teacher's logits are read.
    teacher, read_cache = values.local_teacher, host_checks and values.reads_teacher
    try:
        values.teacher.check_unmodified()
    except ValueError:
        return LocalError(LocalErrorCode.CACHE_MODIFIED)
    if read_cache:
        # Tensors the same on every rank (a top-k cache's, like the labels): every rank raises alike.
        teacher.check_cache_values(layout.vocab_size)
    for check in teacher.checked_values(layout.real_local_columns) if read_cache else []:
        index = first_non_finite(check.tensor, allow_neg_inf=check.allow_neg_inf)
        if index is not None:
            # A logits cache (−inf allowed) is located by row and global column; a hidden cache is not.
            if check.allow_neg_inf:
                return LocalError(LocalErrorCode.TEACHER_LOGITS_NOT_FINITE, index[0], layout.vocab_start + index[1])
            return LocalError(LocalErrorCode.CACHE_NOT_FINITE)
    for _, tensor in [*values.inputs, *teacher.trained_tensors()] if values.inputs else []:
        index = first_non_finite(tensor)
        if index is not None:
            # A bias (1-D) is located by its row alone: column 0.
            return LocalError(LocalErrorCode.INPUT_NOT_FINITE, index[0], index[1] if len(index) > 1 else 0)
    return None
