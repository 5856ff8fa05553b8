"""Public entry points: :func:`distillation_loss`, :class:`DistillationLoss`, :func:`is_available`."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor, nn

from .config import EntropyGate, KernelConfig, apply_loss_overrides
from .engine import block_math_of, select_backend
from .engine.fused import ChunkedProblem, chunked_loss
from .engine.fused_grads import GradNeeds
from .engine.gemm import GemmPolicy
from .engine.logits import statistics_dtype
from .engine.reference import reference_loss
from .exchange import LocalExchange, RecordExchange
from .kernels import is_available
from .parallel.fsdp import check_not_fsdp_sharded, head_weight, unsharded_head_weight
from .parallel.inputs import LocalInputs, agree_layout, localize, tp_group_of
from .parallel.layout import VocabLayout
from .parallel.shard_exchange import ShardExchange
from .plan import LossPlan
from .teachers import SeparateTeacher, Teacher, TeacherHead
from .validation import (
    LossOptions,
    ParallelOptions,
    build_plan,
    check_inputs,
    check_label_range,
    check_precision,
    resolve_options,
    resolve_parallel_options,
    teacher_tensors,
)
from .value_checks import check_values, local_error

__all__ = ["DistillationLoss", "DistillationLossOutput", "distillation_loss", "is_available"]

TeacherArgument = Teacher | TeacherHead


class DistillationLossOutput(NamedTuple):
    """``loss`` (differentiable) and its unweighted components (detached).

    0-d tensors for "mean"/"sum", (BT,) per-row tensors for "none" (0 on ignored rows).
    ``kl`` includes the ``T_s²`` factor; a term whose weight is 0 is not computed and reads 0.
    """

    loss: Tensor
    student_ce: Tensor
    teacher_ce: Tensor
    kl: Tensor


def _denominator(
    num_valid_tokens: object, reduction: str, valid: Tensor | None, device: torch.device
) -> float | Tensor:
    """N of "mean": ``num_valid_tokens`` when given, else the count of ``valid`` rows, a device
    tensor (at least 1, so that an all-ignored batch gives 0 and no gradient). A tensor's value is
    never read (that would synchronize with the device): it must be > 0."""
    if num_valid_tokens is None:
        return 1.0 if valid is None else valid.sum().clamp_min(1)
    if reduction != "mean":
        raise ValueError(f"num_valid_tokens is the denominator of reduction='mean'; got reduction={reduction!r}")
    if isinstance(num_valid_tokens, Tensor):
        if num_valid_tokens.numel() != 1 or num_valid_tokens.is_complex() or num_valid_tokens.dtype == torch.bool:
            raise ValueError(
                f"num_valid_tokens must be a real scalar tensor, got shape {tuple(num_valid_tokens.shape)} "
                f"and dtype {num_valid_tokens.dtype}"
            )
        if num_valid_tokens.device != device:
            raise ValueError(
                f"num_valid_tokens must be on student_hidden's device {device}, got {num_valid_tokens.device}"
            )
        return num_valid_tokens.reshape(())
    if isinstance(num_valid_tokens, bool) or not isinstance(num_valid_tokens, (int, float)):
        raise TypeError(
            f"num_valid_tokens must be a number, a scalar tensor or None, got {type(num_valid_tokens).__name__}"
        )
    if not math.isfinite(num_valid_tokens) or num_valid_tokens <= 0:
        raise ValueError(f"num_valid_tokens must be finite and > 0, got {num_valid_tokens!r}")
    return float(num_valid_tokens)


def _gradient_needs(plan: LossPlan, tensors: tuple[Tensor | None, ...]) -> tuple[bool, bool, bool, bool]:
    """Which of (student_hidden, weight, teacher_hidden, teacher_weight) receive a gradient."""
    grad_on = torch.is_grad_enabled()

    def wants(tensor: Tensor | None) -> bool:
        return grad_on and tensor is not None and tensor.requires_grad

    student_hidden, weight, teacher_hidden, teacher_weight = tensors
    teacher_trains = plan.teacher_receives_grad
    tied_teacher_trains = plan.teacher_kind == "tied" and teacher_trains
    return (
        wants(student_hidden) and plan.student_receives_grad,
        wants(weight) and (plan.student_receives_grad or tied_teacher_trains),
        wants(teacher_hidden) and teacher_trains,
        wants(teacher_weight) and teacher_trains,
    )


def _exchange(
    plan: LossPlan, options: LossOptions, local: LocalInputs, teacher: Teacher, layout: VocabLayout
) -> RecordExchange:
    """The record exchange of this call; value checks raise here on one device, and travel with
    the first record exchange on a tensor-parallel shard."""
    if local.group is None:
        check_values(plan, options.config, local.student_hidden, local.weight, local.teacher, layout.vocab_size)
        return LocalExchange()
    error = local_error(plan, options.config, local.student_hidden, local.weight, local.teacher, teacher, layout)
    return ShardExchange(local.group, layout.sequence_parallel, error)


def _gradient_scale(options: LossOptions) -> float | Tensor | None:
    """The scale at which fp16 logit gradients are materialized for the gradient GEMMs: a number,
    or the GradScaler's scale tensor (left on the device, never read)."""
    if options.gradient_materialization_scale is not None:
        return options.gradient_materialization_scale
    scaler = options.grad_scaler
    if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
        return None
    scale = getattr(scaler, "_scale", None)
    if isinstance(scale, Tensor):
        return scale.reshape(())
    return float(scaler.get_scale())  # not yet initialized: its init scale


def _local_inputs(
    options: LossOptions,
    parallel: ParallelOptions,
    student_hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    teacher: Teacher,
) -> LocalInputs:
    """This rank's tensors, checked (types, shapes, devices); no collective."""
    local = localize(
        student_hidden, weight, labels, teacher, parallel.tp_group, parallel.vocab_range, parallel.sequence_parallel
    )
    row_shards = torch.distributed.get_world_size(local.group) if local.sequence_parallel else 1
    check_inputs(
        local.student_hidden,
        local.weight,
        local.labels,
        local.teacher,
        sharded=local.group is not None,
        row_shards=row_shards,
    )
    if local.group is not None and options.backend == "reference":
        raise ValueError("backend='reference' builds full logits on one device; with tp_group use 'torch' or 'auto'")
    return local


@contextmanager
def _readable_teacher(teacher: TeacherArgument, reduction: str) -> Iterator[Teacher]:
    """The teacher as a descriptor of tensors: a :class:`TeacherHead` becomes the
    :class:`SeparateTeacher` of its module's weight, gathered for the call if FSDP2 shards it
    (kept past the call when a "none" reduction's backward recomputes the logits)."""
    if not isinstance(teacher, TeacherHead):
        yield teacher
        return
    grad_on = torch.is_grad_enabled()
    receives_grad = grad_on and head_weight(teacher.head).requires_grad
    read_after_call = grad_on and reduction == "none"
    with unsharded_head_weight(teacher.head, receives_grad, read_after_call) as weight:
        yield SeparateTeacher(teacher.hidden, weight)


# Inside torch.compile'd code the loss runs eagerly (one graph break): its chunk loop, record
# exchanges and hand-written backward are not traceable, and gain nothing from tracing.
@torch.compiler.disable
def _run(
    options: LossOptions,
    parallel: ParallelOptions,
    student_hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    teacher: TeacherArgument,
    num_valid_tokens: object,
) -> DistillationLossOutput:
    with _readable_teacher(teacher, options.reduction) as readable:
        return _run_on_tensors(options, parallel, student_hidden, weight, labels, readable, num_valid_tokens)


def _run_on_tensors(
    options: LossOptions,
    parallel: ParallelOptions,
    student_hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    teacher: Teacher,
    num_valid_tokens: object,
) -> DistillationLossOutput:
    # Checked before any collective (every rank decides alike): a TypeError for anything but a
    # teacher descriptor, a ValueError for FSDP's data-parallel shards posing as vocabulary shards.
    for name, tensor in [("weight", weight), *teacher_tensors(teacher)]:
        check_not_fsdp_sharded(name, tensor)
    group = tp_group_of(weight, parallel.tp_group)
    local, failure = None, None
    try:
        local = _local_inputs(options, parallel, student_hidden, weight, labels, teacher)
        # checked before any collective
        _denominator(num_valid_tokens, options.reduction, None, local.student_hidden.device)
    except (ValueError, TypeError) as error:
        if group is None:
            raise
        failure = error  # every rank of the group raises it after the handshake
    layout = agree_layout(group, local, parallel.vocab_size, failure)
    assert local is not None
    plan = build_plan(options, local.teacher, layout.vocab_size)
    device = local.student_hidden.device
    if not options.config.assume_valid_labels and options.config.runs_host_checks(local.labels.device.type == "cpu"):
        check_label_range(local.labels, layout.vocab_size, options.ignore_index)
    exchange = _exchange(plan, options, local, teacher, layout)
    valid = local.labels != options.ignore_index
    denominator = _denominator(num_valid_tokens, options.reduction, valid, device)
    teacher_hidden, teacher_weight, teacher_logits = local.teacher.head_inputs()
    inputs = (local.student_hidden, local.weight, teacher_hidden, teacher_weight, teacher_logits)
    backend = select_backend(options.backend, device, statistics_dtype(*inputs))
    # Statistics are computed in fp32/fp64 whatever autocast would pick for the GEMMs.
    with torch.autocast(device.type, enabled=False):
        if backend == "reference":
            outputs = reference_loss(plan, local.labels, denominator, *inputs, vocab_size=layout.vocab_size)
        else:
            problem = ChunkedProblem(
                plan=plan,
                labels=local.labels,
                valid=valid,
                denominator=denominator,
                grad_needs=GradNeeds(*_gradient_needs(plan, inputs[:4])),
                exchange=exchange,
                layout=layout,
                math=block_math_of(backend),
                gemms=GemmPolicy(_gradient_scale(options)),
            )
            outputs = chunked_loss(problem, *inputs)
    return DistillationLossOutput(*outputs)


_PARALLEL_KEYWORDS = ("tp_group", "vocab_range", "vocab_size", "sequence_parallel")


def _resolve_keywords(keywords: dict[str, object]) -> tuple[LossOptions, ParallelOptions]:
    """Validate the keywords of :func:`distillation_loss` / :class:`DistillationLoss` (one path, so
    both raise the same error for the same keywords)."""
    keywords = apply_loss_overrides(keywords, _KEYWORD_DEFAULTS)  # orda-kernel: a config's loss keywords win
    parallel = {name: keywords.pop(name) for name in _PARALLEL_KEYWORDS}
    return resolve_options(**keywords), resolve_parallel_options(**parallel)


# Inside torch.compile'd code the call runs eagerly behind one graph break (its keyword handling
# reads ``locals()``, which a traced frame does not keep as written).
@torch.compiler.disable
def distillation_loss(
    student_hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    teacher: TeacherArgument,
    *,
    student_ce_weight: float = 1.0,
    teacher_ce_weight: float | None = None,
    kl_weight: float = 0.0,
    kl_temperature: float = 1.0,
    kl_teacher_temperature: float | None = None,
    kl_divergence: str = "forward",
    kl_alpha: float | None = None,
    kl_beta: float | None = None,
    entropy_gate: EntropyGate | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    profile: str = "balanced",
    backend: str = "auto",
    config: KernelConfig | None = None,
    gradient_materialization_scale: float | Tensor | None = None,
    grad_scaler: object | None = None,
    num_valid_tokens: float | Tensor | None = None,
    tp_group: object | None = None,
    vocab_range: tuple[int, int] | None = None,
    vocab_size: int | None = None,
    sequence_parallel: bool | None = None,
) -> DistillationLossOutput:
    """Student CE, teacher CE and a KL term from hidden states and LM-head weights, without
    building the (BT, V) logits (except with ``backend="reference"``).

    ``loss = student_ce_weight·CE(s) + teacher_ce_weight·CE(t) + kl_weight·T_s²·D(p, q)`` with
    ``s = student_hidden·weightᵀ``, ``p = softmax(s/T_s)``, ``q = softmax(t/T_t)``. See
    docs/reference.md for every argument and error, docs/variants.md for the 15 divergences.

    ``gradient_materialization_scale`` (or, when None, ``grad_scaler.get_scale()``) is the scale at
    which fp16 logit gradients are materialized for the tensor-core gradient GEMMs on CUDA; without
    one those GEMMs run in fp32. It has no effect for other dtypes or on the CPU.

    Tensor parallelism: with ``tp_group`` (or a head ``weight`` DTensor sharded on dim 0),
    ``weight`` — and a separate teacher's weight, and cached teacher logits — are this rank's
    vocabulary shard; ``vocab_range=(start, stop)`` places it (default: the shards in rank order);
    ``vocab_size`` marks the columns at or past it as padding; ``sequence_parallel`` says the
    hidden states hold this rank's rows of the batch. Every rank returns the single-device result.
    """
    keywords = dict(locals())
    for argument in ("student_hidden", "weight", "labels", "teacher", "num_valid_tokens"):
        del keywords[argument]
    options, parallel = _resolve_keywords(keywords)
    return _run(options, parallel, student_hidden, weight, labels, teacher, num_valid_tokens)


_KEYWORD_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(distillation_loss).parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY
}


class DistillationLoss(nn.Module):
    """Module form of :func:`distillation_loss`: the keywords are fixed (and validated) at
    construction; ``forward(student_hidden, weight, labels, teacher, gradient_materialization_scale=None,
    grad_scaler=None, *, num_valid_tokens=None)``."""

    def __init__(
        self,
        *,
        student_ce_weight: float = 1.0,
        teacher_ce_weight: float | None = None,
        kl_weight: float = 0.0,
        kl_temperature: float = 1.0,
        kl_teacher_temperature: float | None = None,
        kl_divergence: str = "forward",
        kl_alpha: float | None = None,
        kl_beta: float | None = None,
        entropy_gate: EntropyGate | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        profile: str = "balanced",
        backend: str = "auto",
        config: KernelConfig | None = None,
        gradient_materialization_scale: float | Tensor | None = None,
        grad_scaler: object | None = None,
        tp_group: object | None = None,
        vocab_range: tuple[int, int] | None = None,
        vocab_size: int | None = None,
        sequence_parallel: bool | None = None,
    ) -> None:
        keywords = {name: value for name, value in locals().items() if name not in ("self", "__class__")}
        super().__init__()
        self.options, self.parallel = _resolve_keywords(keywords)

    def forward(
        self,
        student_hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        teacher: TeacherArgument,
        gradient_materialization_scale: float | Tensor | None = None,
        grad_scaler: object | None = None,
        *,
        num_valid_tokens: float | Tensor | None = None,
    ) -> DistillationLossOutput:
        """The loss of the constructor's keywords; ``gradient_materialization_scale`` and
        ``grad_scaler`` given here (orda-kernel's ``forward`` arguments) replace the constructor's
        for this call."""
        options = self.options
        if gradient_materialization_scale is not None or grad_scaler is not None:
            scale, scaler = check_precision(gradient_materialization_scale, grad_scaler)
            options = replace(options, gradient_materialization_scale=scale, grad_scaler=scaler)
        return _run(options, self.parallel, student_hidden, weight, labels, teacher, num_valid_tokens)

    def extra_repr(self) -> str:
        o = self.options
        return (
            f"kl_divergence={o.kl_divergence!r}, student_ce_weight={o.student_ce_weight}, "
            f"teacher_ce_weight={o.teacher_ce_weight}, kl_weight={o.kl_weight}, kl_temperature={o.kl_temperature}, "
            f"reduction={o.reduction!r}, backend={o.backend!r}"
        )
