"""``KDLoss``: NeMo's logits-level distillation loss, exact and memory-lean, on one device or on
vocabulary-sharded logits."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from .arguments.config import HOST_WORKSPACE_MIB, ChunkRows, ExecutionConfig
from .arguments.options import LogitsOptions
from .arguments.plan import LossPlan, check_sparse_teacher
from .arguments.validation import (
    ValueChecks,
    check_count,
    check_denominator,
    check_flag,
    check_floating,
    check_labels,
    check_same_device,
    check_token_weights,
    runs_host_checks,
)
from .divergences import EntropyGate
from .engine.call import agree, call_text, prepare_call, raised_on_every_rank
from .engine.given_logits import logits_distillation
from .engine.logits import StoredLogits, statistics_dtype
from .parallel.dtensor import MeshAxis
from .parallel.layout import HeadShard, LocalShard
from .parallel.logits_shards import local_logits, logits_call_group, logits_group
from .teachers import PrecomputedTeacher
from .teachers.source import TeacherBlocks

__all__ = ["KDLoss"]


def _check_logits(student: object, teacher: object, labels: object) -> tuple[Tensor, Tensor, Tensor]:
    """Types, shapes and devices of this rank's tensors (no value is read); returns them."""
    student = check_floating("student_logits", student, "[..., vocab]")
    teacher = check_floating("teacher_logits", teacher, "[..., vocab]")
    if student.dim() < 1:
        raise ValueError("student_logits must have shape [..., vocab], got a 0-d tensor")
    if teacher.shape != student.shape:
        raise ValueError(
            f"teacher_logits must have student_logits' shape {tuple(student.shape)} (this rank's columns under "
            f"tensor parallelism), got {tuple(teacher.shape)}"
        )
    labels = check_labels(labels, tuple(student.shape[:-1]), "student_logits' leading dimensions")
    check_same_device("student_logits", student.device, [("teacher_logits", teacher), ("labels", labels)])
    return student, teacher, labels


class _CheckedCall(NamedTuple):
    """This rank's checked ``KDLoss`` arguments: the teacher logits are the student's for a top-k
    cache (which holds no columns); labels and token weights flat."""

    student: Tensor
    teacher: Tensor
    labels: Tensor
    denominator: float | Tensor | None
    row_weights: Tensor | None


def _check_call(
    options: LogitsOptions,
    student_logits: object,
    teacher_logits: object,
    labels: object,
    num_batch_labels: object,
    token_weights: object,
    axis: MeshAxis | None,
) -> tuple[_CheckedCall, LocalShard]:
    """This rank's own arguments checked (values only where host checks run), and its share."""
    cache = teacher_logits if isinstance(teacher_logits, PrecomputedTeacher) else None
    replicated: list[tuple[str, Tensor]] = []
    # A top-k cache holds every row and no columns: the student's own shape stands in for it.
    local = local_logits(student_logits, student_logits if cache is not None else teacher_logits, labels, axis)
    local_student, local_teacher, local_labels = _check_logits(local.student, local.teacher, local.labels)
    if cache is not None:
        _check_topk_cache(cache, local_labels.numel(), options)
        # The whole cache on every rank (global ids, like the labels): the handshake compares it.
        replicated += cache.replicated_tensors()
    device = local_student.device
    denominator = check_denominator("num_batch_labels", num_batch_labels, "mean", device, "student_logits")
    row_weights = None
    if token_weights is not None:  # the labels' shape
        if isinstance(token_weights, Tensor) and token_weights.shape == local_labels.shape:
            token_weights = token_weights.reshape(-1)
        host_checks = runs_host_checks(options.config.host_checks, local_labels.device)
        row_weights = check_token_weights(token_weights, local_labels.reshape(-1), host_checks)
        # One weight per row, like the labels: alike on every rank, which the handshake compares.
        replicated.append(("token_weights", row_weights))
    flat_labels = local_labels.reshape(-1)
    checked = _CheckedCall(local_student, local_teacher, flat_labels, denominator, row_weights)
    head = HeadShard("student_logits", local_student, -1)
    shard = LocalShard(
        head=head,
        labels=flat_labels,
        vocab_range=local.vocab_range,
        workspace_mib=HOST_WORKSPACE_MIB,
        replicated=replicated,
    )
    return checked, shard


# Inside torch.compile'd code the loss runs eagerly (one graph break): its chunk loop, record
# exchanges and hand-written backward are not traceable.
@torch.compiler.disable
def _kd_loss(
    options: LogitsOptions,
    student_logits: Tensor,
    teacher_logits: Tensor | PrecomputedTeacher,
    labels: Tensor,
    num_batch_labels: float | Tensor | None,
    token_weights: object = None,
) -> Tensor:
    with raised_on_every_rank(lambda: logits_call_group(student_logits, options.tp_group)):
        group, axis = logits_group(student_logits, options.tp_group)
        checked, shard = _check_call(
            options, student_logits, teacher_logits, labels, num_batch_labels, token_weights, axis
        )
    cache = teacher_logits if isinstance(teacher_logits, PrecomputedTeacher) else None
    teacher_text = "teacher_logits=<tensor>" if cache is None else cache.settings_text()
    layout = agree(
        group,
        shard,
        options.config.host_checks,
        lambda: call_text(options.settings_text, teacher_text, token_weights, ("num_batch_labels", num_batch_labels)),
    )
    # No student CE, the mean over valid rows, a frozen teacher of given logits: NeMo's loss.
    plan = LossPlan.for_logits(options, 0.0, "mean", "precomputed_logits", layout.vocab_size, cache)
    # Any leading shape becomes rows, as the labels did.
    student = checked.student.reshape(-1, checked.student.shape[-1])
    teacher: TeacherBlocks
    if cache is None:
        # Detached: no gradient reaches the teacher's logits, whatever the variant.
        teacher = StoredLogits(checked.teacher.detach().reshape(student.shape))
        dtype = statistics_dtype(student, checked.teacher)
    else:
        blocks = cache.block_source(layout.vocab_start, layout.vocab_size)
        assert blocks is not None
        teacher, dtype = blocks, statistics_dtype(student, cache.topk_logprobs)
    call = prepare_call(
        plan,
        layout,
        checked.labels,
        backend=options.backend,
        dtype=dtype,
        ignore_index=options.ignore_index,
        reads_labels=options.divergence.needs_target,  # else a label only says whether its row counts
        denominator=checked.denominator,
        # Only a cache has values to check: unmodified since it was built, valid ids and log-probabilities.
        values=None if cache is None else ValueChecks(cache, cache, reads_teacher=True),
        row_weights=checked.row_weights,
    )
    # Statistics in fp32 (fp64 for fp64 logits), whatever autocast would pick.
    with torch.autocast(student.device.type, enabled=False):
        return logits_distillation(call, student, teacher, dtype)


def _check_topk_cache(cache: PrecomputedTeacher, rows: int, options: LogitsOptions) -> None:
    """A cache teacher: a top-k cache of one row per label, unchanged, whose tail leaves ``D`` finite."""
    if cache.topk_ids is None:
        raise TypeError(
            "KDLoss takes teacher_logits as a tensor or as PrecomputedTeacher(topk_ids=..., topk_logprobs=...); "
            f"got a PrecomputedTeacher of kind {cache.kind!r} (pass its logits as the tensor)"
        )
    # Before anything reads it: a cache changed in place since it was built raises.
    cache.check_unmodified()
    if cache.topk_ids.shape[0] != rows:
        raise ValueError(
            f"PrecomputedTeacher.topk_ids must have one row per label ({rows}), got {tuple(cache.topk_ids.shape)}"
        )
    if cache.sparse_support:  # no mass off its ids: the variants that are +inf there are refused
        check_sparse_teacher(options.divergence, options.params)


class KDLoss(nn.Module):
    """NeMo-compatible knowledge-distillation loss on logits, exact and in a bounded workspace.

    ``forward(student_logits, teacher_logits, labels, num_batch_labels=None, *, token_weights=None)``
    returns the 0-d ``Σ_valid w_i·T²·D(p_i, q_i) / N`` with ``p = softmax(s/T)``, ``q = softmax(t/T)``,
    ``D`` the variant (``"forward"``: ``KL(q‖p)``, NeMo's loss), ``N`` the valid tokens
    (``labels != ignore_index``) or ``num_batch_labels`` (e.g. those of all accumulated
    micro-batches), ``w_i`` the ``token_weights`` (the labels' shape; 1 without). Logits ``[..., V]``
    (this rank's ``[..., V_local]`` under tensor parallelism); labels ``[...]`` ``torch.long``, read
    only as ``!= ignore_index`` except by ``dkd`` (the label column). Only the student's logits
    receive a gradient. ``teacher_logits`` may be a top-k cache (``PrecomputedTeacher(topk_ids=,
    topk_logprobs=, tail=)``, one row per label, whole on every rank), for the dense teacher it stands for.

    - ``temperature``: ``T`` (finite, > 0), on both sides; the loss carries ``T²``.
    - ``fp32_upcast``: accepted for compatibility, without effect: statistics are always fp32 (fp64
      for fp64 logits) and no fp32 copy of the logits is made.
    - ``tp_group``: the group over which the logits are sharded on their last dimension (shards in
      rank order); inferred from DTensor logits sharded there. Every rank returns the single-device
      loss; each rank's gradient is its columns' slice.
    - ``chunk_size``: rows (tokens) per chunk; 0 (default): the library chooses (the whole batch
      for the Triton kernels, which read both sides in place; as many rows as fit the workspace for
      the torch backend). No path, tensor-parallel included, holds more than one chunk's fp32 logits.
    - ``kl_divergence`` and ``**variant_parameters`` (``kl_alpha``, ``kl_beta``, ``entropy_gate``):
      any of the 15 variants (``mutual``/``cojeffreys``: their value and the student's gradient). A
      keyword the variant does not read raises a ValueError, one no variant reads a TypeError.
    - ``backend``: "auto" (the Triton kernels on CUDA, else chunked torch), "torch" or "triton".
    """

    def __init__(
        self,
        ignore_index: int = -100,
        temperature: float = 1.0,
        fp32_upcast: bool = True,
        tp_group: object | None = None,
        chunk_size: int = 0,
        *,
        kl_divergence: str = "forward",
        backend: str = "auto",
        **variant_parameters: float | EntropyGate | None,
    ) -> None:
        super().__init__()
        self._fp32_upcast = check_flag("fp32_upcast", fp32_upcast)
        rows = check_count("chunk_size", chunk_size, 0)
        self.options = LogitsOptions.resolve(
            temperature=temperature,
            kl_divergence=kl_divergence,
            ignore_index=ignore_index,
            backend=backend,
            tp_group=tp_group,
            # A given chunk_size is used as it is (dynamic=False: never lowered to fit a workspace).
            config=ExecutionConfig(chunk_size=ChunkRows(nrows=rows, dynamic=False) if rows else ChunkRows()),
            **variant_parameters,
        )

    @property
    def ignore_index(self) -> int:
        return self.options.ignore_index

    @property
    def temperature(self) -> float:
        return self.options.temperature

    @property
    def fp32_upcast(self) -> bool:
        return self._fp32_upcast

    @property
    def tp_group(self) -> object | None:
        return self.options.tp_group

    @property
    def chunk_size(self) -> int:
        return self.options.config.chunk_size.nrows or 0

    def forward(
        self,
        student_logits: Tensor,
        teacher_logits: Tensor | PrecomputedTeacher,
        labels: Tensor,
        num_batch_labels: float | Tensor | None = None,
        *,
        token_weights: Tensor | None = None,
    ) -> Tensor:
        return _kd_loss(self.options, student_logits, teacher_logits, labels, num_batch_labels, token_weights)

    def extra_repr(self) -> str:
        o = self.options
        return (
            f"ignore_index={o.ignore_index}, temperature={o.temperature}, chunk_size={self.chunk_size}, "
            f"kl_divergence={o.divergence.name!r}, backend={o.backend!r}"
        )
