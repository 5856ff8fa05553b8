"""Turn a tensor-parallel call's arguments into local shards and an agreed :class:`VocabLayout`,
and check this rank's values (:func:`local_error`).

Inputs may be DTensors (group, vocabulary range and sequence parallelism read off their
placements) or plain local shards with an explicit ``tp_group``. Without either, the call runs on
one device (``orda_tp.api``) and the layout covers the whole head (minus padding past
``vocab_size``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

import torch.distributed as dist
from torch import Tensor

from ..checks import check_denominator, check_inputs, check_token_weights, first_non_finite, runs_host_checks
from ..options import LossOptions, setting_text
from ..plan import LossPlan
from ..teachers import TeacherSource
from ..workspace import default_workspace_mib
from .dtensor import MeshAxis, chunk_range, is_dtensor, local_shard, mesh_group, shard_axis
from .fsdp import check_not_fsdp_sharded
from .layout import HeadShard, ShardClaim, VocabLayout, failure_code, resolve_layout, text_digest
from .shard_exchange import LocalError, LocalErrorCode

__all__ = [
    "DTensorShards",
    "LocalInputs",
    "call_group",
    "can_fail_locally",
    "fail_on_every_rank",
    "local_error",
    "same_ranks",
    "shard_inputs",
]


@dataclass(frozen=True)
class LocalInputs:
    """The call's tensors as this rank holds them, and the tensor-parallel setting."""

    student_hidden: Tensor
    weight: Tensor
    labels: Tensor
    teacher: TeacherSource
    group: dist.ProcessGroup | None
    vocab_range: tuple[int, int] | None
    sequence_parallel: bool


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
) -> LocalInputs:
    """Local shards of DTensor inputs (plain tensors pass through) and the tp setting
    (``group``: the checked ``tp_group``)."""
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
        teacher=teacher.localized(DTensorShards(axis, sharded)),
        group=axis.group,
        vocab_range=derived_range,
        sequence_parallel=sharded,
    )


def _agree_layout(
    group: dist.ProcessGroup,
    inputs: LocalInputs | None,
    options: LossOptions,
    problem: Exception | None,
    replicated: Sequence[tuple[str, Tensor]],
    call_text: str,
) -> VocabLayout:
    """The layout of this call, agreed across ``group``: ``problem`` is set when this rank's own
    checks failed (``inputs`` may then be None); the handshake then makes every rank raise.
    ``replicated``: the tensors beside the labels that every rank must hold alike."""
    host_checks, vocab_size = options.kernel_config.host_checks, options.vocab_size
    if problem is not None or inputs is None:
        assert problem is not None
        return resolve_layout(group, ShardClaim(failed=failure_code(problem)), (), None, problem, host_checks)
    start, stop = inputs.vocab_range if inputs.vocab_range is not None else (-1, -1)
    teacher_columns = inputs.teacher.vocab_columns()
    claim = ShardClaim(
        local_columns=inputs.weight.shape[0],
        teacher_columns=-1 if teacher_columns is None else teacher_columns,
        range_start=start,
        range_stop=stop,
        vocab_size=-1 if vocab_size is None else vocab_size,
        label_rows=inputs.labels.shape[0],
        sequence_parallel=int(inputs.sequence_parallel),
        call_digest=text_digest(call_text),
        workspace_mib=default_workspace_mib(inputs.student_hidden.device),
    )
    tensors = [("labels", inputs.labels), *replicated, *inputs.teacher.replicated_tensors()]
    head = HeadShard("weight", inputs.weight, 0)
    return resolve_layout(group, claim, tensors, head, None, host_checks, call_text)


def fail_on_every_rank(problem: Exception, group: dist.ProcessGroup | None) -> NoReturn:
    """Raise ``problem``, a check failure found before a tensor-parallel call knew its tensors (a
    keyword), on every rank of ``group`` (the call's group, or None on one device) at once: the
    handshake carries the failure as the other ranks' checks do, so that no rank waits for this
    one in a collective."""
    if group is None:
        raise problem
    resolve_layout(group, ShardClaim(failed=failure_code(problem)), (), None, problem)
    raise AssertionError("the handshake raises for a failed rank")  # pragma: no cover


def _tp_group_of(weight: object, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The call's tensor-parallel group: ``group`` (the checked ``tp_group``), or the mesh group a
    DTensor weight is sharded over (placements are the same on every rank, so every rank decides
    alike)."""
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


def _call_checks(
    options: LossOptions, local: LocalInputs, num_valid_tokens: object, token_weights: object
) -> Tensor | None:
    """The per-call arguments of this rank: ``num_valid_tokens`` (its type and value) and the
    checked ``token_weights`` (None when not given)."""
    device = local.student_hidden.device
    check_denominator(num_valid_tokens, options.reduction, None, device)
    if token_weights is None:
        return None
    return check_token_weights(token_weights, local.labels, runs_host_checks(options.kernel_config.host_checks, device))


def shard_inputs(
    options: LossOptions,
    student_hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    teacher: TeacherSource,
    num_valid_tokens: object,
    token_weights: object,
) -> tuple[LocalInputs, VocabLayout, Tensor | None]:
    """This rank's tensors of a tensor-parallel call (a ``tp_group``, or DTensor inputs), the
    layout the group agrees on and the checked ``token_weights``. Every check that reads only this
    rank's own arguments (types, shapes, devices, the backend, the teacher descriptor,
    ``num_valid_tokens``, ``token_weights``) runs before the layout handshake, which makes every
    rank raise the same error; none waits for a rank that raised. The handshake also proves that
    the call's settings (keywords, teacher descriptor) and the tensors every rank must hold alike
    agree, so every check after it decides alike on every rank."""
    group = call_group(weight, options.tp_group)
    local, failure, row_weights = None, None, None
    try:
        # FSDP's data-parallel shards posing as vocabulary shards.
        for name, tensor in [("weight", weight), *((f"teacher.{n}", t) for n, t in teacher.named_tensors())]:
            check_not_fsdp_sharded(name, tensor)
        if options.backend == "reference":
            raise ValueError(
                "backend='reference' builds full logits on one device; with tp_group use 'torch' or 'auto'"
            )
        local = _localize(
            student_hidden, weight, labels, teacher, options.tp_group, options.vocab_range, options.sequence_parallel
        )
        row_shards = dist.get_world_size(local.group) if local.sequence_parallel else 1
        check_inputs(
            local.student_hidden, local.weight, local.labels, local.teacher, sharded=True, row_shards=row_shards
        )
        teacher.check_shardable()
        row_weights = _call_checks(options, local, num_valid_tokens, token_weights)
    except (ValueError, TypeError) as error:
        if group is None:
            raise
        failure = error  # every rank of the group raises it after the handshake
    assert group is not None  # a call without a group raised above (no DTensor weight on a 1-D mesh, no tp_group)
    call_text = "\n".join(
        [
            options.settings_text,
            teacher.settings_text(),
            f"token_weights={'<given>' if token_weights is not None else None}",
            f"num_valid_tokens={setting_text(num_valid_tokens)}",
        ]
    )
    replicated = [] if row_weights is None else [("token_weights", row_weights)]
    layout = _agree_layout(group, local, options, failure, replicated, call_text)
    assert local is not None
    return local, layout, row_weights


def can_fail_locally(plan: LossPlan, teacher: TeacherSource) -> bool:
    """Whether a check of :func:`local_error` can fail on some rank: a cached teacher's (watched
    for in-place changes, its values read where host checks run) or ``check_finite_inputs``'.
    Decided by the descriptor's kind and the keywords, alike on every rank, so every rank's first
    record exchange has the same width; when False no error travels and none is read on the host."""
    return not teacher.trainable or plan.config.check_finite_inputs


def local_error(
    plan: LossPlan, local: LocalInputs, teacher: TeacherSource, layout: VocabLayout, host_checks: bool
) -> LocalError | None:
    """The first failed value check of this rank's tensors (``local``; ``teacher`` is the
    descriptor as the call received it), as a :class:`LocalError` (global column numbers) that the
    first record exchange shares, so that every rank raises it; or None. The checks are those of
    :func:`orda_tp.checks.check_values` on one device: a cache modified in place, a non-finite
    cache where it is read (``host_checks`` run and the teacher's logits are read), and with
    ``check_finite_inputs`` a non-finite hidden state or weight.

    A descriptor that cannot stand for one vocabulary shard raised before the handshake
    (:func:`shard_inputs`)."""
    try:
        teacher.check_unmodified()
    except ValueError:
        return LocalError(LocalErrorCode.CACHE_MODIFIED)
    if plan.needs_teacher_logits and host_checks:
        # Tensors the same on every rank (a top-k cache's, like the labels): every rank raises alike.
        local.teacher.check_cache_values(layout.vocab_size)
    checks = (
        local.teacher.checked_values(layout.real_local_columns) if plan.needs_teacher_logits and host_checks else []
    )
    for check in checks:
        index = first_non_finite(check.tensor, allow_neg_inf=check.allow_neg_inf)
        if index is not None:
            # A logits cache (−inf allowed) is located by row and global column; a hidden cache is not.
            if check.allow_neg_inf:
                return LocalError(LocalErrorCode.TEACHER_LOGITS_NOT_FINITE, index[0], layout.vocab_start + index[1])
            return LocalError(LocalErrorCode.CACHE_NOT_FINITE)
    if plan.config.check_finite_inputs:
        tensors = [("student_hidden", local.student_hidden), ("weight", local.weight), *local.teacher.trained_tensors()]
        for _, tensor in tensors:
            index = first_non_finite(tensor)
            if index is not None:
                return LocalError(LocalErrorCode.INPUT_NOT_FINITE, index[0], index[1])
    return None
