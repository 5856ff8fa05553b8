"""Public entry points: :func:`distillation_loss`, :class:`DistillationLoss`, :func:`is_available`.

A call reads top to bottom: the keywords become one :class:`~orda_tp.arguments.options.LossOptions`; the
tensors are checked (on one device here, on a tensor-parallel group by
:func:`orda_tp.parallel.local_shards.shard_inputs`, whose handshake agrees on the layout); the
:class:`~orda_tp.arguments.plan.LossPlan` says what to compute; the backend runs it: the fp64 reference, or
the chunked engine (:func:`orda_tp.engine.fused.chunked_loss`) with the torch or Triton block math.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from .arguments.config import ExecutionConfig
from .arguments.options import GradScalerLike, LossOptions, setting_text
from .arguments.plan import LossPlan
from .arguments.validation import (
    check_denominator,
    check_inputs,
    check_label_range,
    check_token_weights,
    check_values,
    runs_host_checks,
)
from .divergences import EntropyGate
from .engine.block_math import select_backend
from .engine.fused import ChunkedProblem, chunked_loss
from .engine.gradient_gemms import GemmPolicy
from .engine.logits import statistics_dtype
from .engine.reference import reference_loss
from .engine.row_walk import RowWalk
from .engine.workspace import default_workspace_mib
from .kernels import is_available
from .parallel.fsdp import head_weight, unsharded_head_weight
from .parallel.layout import HeadShard, LocalShard, VocabLayout, agree_layout, fail_on_every_rank
from .parallel.local_shards import LocalInputs, call_group, local_error, shard_inputs
from .parallel.shard_exchange import ShardExchange
from .teachers import SeparateTeacher, TeacherHead, TeacherSource

__all__ = [
    "DistillationLoss",
    "DistillationLossOutput",
    "agreed_call",
    "call_text",
    "distillation_loss",
    "is_available",
]

TeacherArgument = TeacherSource | TeacherHead
Checked = TypeVar("Checked")  # what a front door's checks return beside its share of the call


class DistillationLossOutput(NamedTuple):
    """``loss`` (differentiable) and its unweighted components (detached).

    0-d tensors for "mean"/"sum", (BT,) per-row tensors for "none" (0 on ignored rows).
    ``kl`` includes the ``T_s²`` factor; ``z_loss`` is the rows' ``LSE(s)²``; a term whose weight
    is 0 is not computed and reads 0. The first four fields are orda-kernel's.
    """

    loss: Tensor
    student_ce: Tensor
    teacher_ce: Tensor
    kl: Tensor
    z_loss: Tensor


def _teacher_type_error(teacher: object) -> TypeError:
    return TypeError(
        "teacher must be a TiedTeacher, SeparateTeacher or PrecomputedTeacher (or a TeacherHead), "
        f"got {type(teacher).__name__}"
    )


@contextmanager
def _readable_teacher(teacher: TeacherHead, reduction: str) -> Iterator[TeacherSource]:
    """A :class:`TeacherHead` as the :class:`SeparateTeacher` of its module's weight, gathered for
    the call if FSDP2 shards it (kept past the call when a "none" reduction's backward recomputes
    the logits)."""
    grad_on = torch.is_grad_enabled()
    receives_grad = grad_on and head_weight(teacher.head).requires_grad
    read_after_call = grad_on and reduction == "none"
    with unsharded_head_weight(teacher.head, receives_grad, read_after_call) as weight:
        yield SeparateTeacher(teacher.hidden, weight)


def agreed_call(
    group: dist.ProcessGroup | None,
    checks: Callable[[], tuple[Checked, LocalShard]],
    host_checks: bool | None,
    call_text: Callable[[], str],
) -> tuple[Checked, VocabLayout]:
    """The one orchestration of every loss's tensors: this rank's ``checks`` (its arguments, and
    its share of the call), then the call's layout. On one device a failed check raises and the
    layout is the whole head. On a tensor-parallel ``group`` a failed check waits for the
    handshake, which makes every rank raise it; the handshake also proves that the ranks' settings
    (``call_text``, ``name=value`` lines) and the tensors they must hold alike agree, so that every
    check after it decides alike on every rank."""
    try:
        checked, shard = checks()
    except (ValueError, TypeError) as error:
        fail_on_every_rank(error, group)
    device = shard.head.tensor.device
    workspace_mib = default_workspace_mib(device) if shard.workspace_mib is None else shard.workspace_mib
    if group is not None:
        return checked, agree_layout(group, shard, workspace_mib, host_checks, call_text())
    columns = shard.head.tensor.shape[shard.head.vocab_dim]
    vocab_size = columns if shard.vocab_size is None else shard.vocab_size
    layout = VocabLayout(
        vocab_start=0,
        vocab_stop=columns,
        total_columns=columns,
        vocab_size=vocab_size,
        max_local_columns=columns,
        local_columns=columns,
        real_local_columns=vocab_size,
        workspace_mib=workspace_mib,
    )
    return checked, layout


def _one_device_inputs(
    options: LossOptions,
    student_hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    teacher: TeacherSource,
    num_valid_tokens: object,
    token_weights: object,
) -> tuple[LocalInputs, LocalShard]:
    """The checked tensors of a call on one device (:func:`orda_tp.parallel.local_shards.shard_inputs`
    is the tensor-parallel counterpart) and its whole head."""
    if options.vocab_range is not None:
        raise ValueError("vocab_range describes a shard of a tensor-parallel head and needs tp_group")
    if options.sequence_parallel:
        raise ValueError("sequence_parallel=True needs tp_group (or a DTensor student_hidden)")
    check_inputs(student_hidden, weight, labels, teacher, vocab_size=options.vocab_size)
    device = student_hidden.device
    denominator = check_denominator("num_valid_tokens", num_valid_tokens, options.reduction, device, "student_hidden")
    row_weights = None
    if token_weights is not None:
        host_checks = runs_host_checks(options.kernel_config.host_checks, device)
        row_weights = check_token_weights(token_weights, labels, host_checks)
    local = LocalInputs(
        student_hidden=student_hidden,
        weight=weight,
        labels=labels,
        teacher=teacher,
        denominator=denominator,
        row_weights=row_weights,
    )
    return local, LocalShard(head=HeadShard("weight", weight, 0), labels=labels, vocab_size=options.vocab_size)


def call_text(settings: str, teacher: str, token_weights: object, denominator: tuple[str, object]) -> str:
    """A tensor-parallel call's settings, which every rank must share, as ``name=value`` lines: its
    keywords' ``settings``, its ``teacher``'s, whether ``token_weights`` were given, and its given
    denominator ``(name, value)`` (a tensor by its presence: it is never read)."""
    name, value = denominator
    weights = f"token_weights={'<given>' if token_weights is not None else None}"
    return "\n".join([settings, teacher, weights, f"{name}={setting_text(value)}"])


# Inside torch.compile'd code the loss runs eagerly (one graph break): its chunk loop, record
# exchanges and hand-written backward are not traceable, and gain nothing from tracing.
@torch.compiler.disable
def _run(
    options: LossOptions,
    student_hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    teacher: object,
    num_valid_tokens: object,
    token_weights: object = None,
) -> DistillationLossOutput:
    """The loss of one call: its tensors checked and its layout agreed (:func:`agreed_call`), its
    plan, the value checks (on a tensor-parallel group they travel with the first record exchange,
    so that every rank raises them), and the selected backend run with autocast off (statistics
    are fp32/fp64 whatever autocast would pick for the GEMMs)."""
    if not isinstance(teacher, TeacherSource):
        if not isinstance(teacher, TeacherHead):
            fail_on_every_rank(_teacher_type_error(teacher), call_group(weight, options.tp_group))
        with _readable_teacher(teacher, options.reduction) as source:
            return _run(options, student_hidden, weight, labels, source, num_valid_tokens, token_weights)
    tensors = [student_hidden, weight, labels, *(tensor for _, tensor in teacher.named_tensors())]
    sharded = options.tp_group is not None or any(isinstance(tensor, DTensor) for tensor in tensors)
    checks = shard_inputs if sharded else _one_device_inputs
    local, layout = agreed_call(
        call_group(weight, options.tp_group) if sharded else None,
        lambda: checks(options, student_hidden, weight, labels, teacher, num_valid_tokens, token_weights),
        options.kernel_config.host_checks,
        lambda: call_text(
            options.settings_text, teacher.settings_text(), token_weights, ("num_valid_tokens", num_valid_tokens)
        ),
    )
    plan = LossPlan.build(options, local.teacher, layout.vocab_size)
    config, device = plan.config, local.student_hidden.device
    host_checks = runs_host_checks(config.host_checks, device)
    if not config.assume_valid_labels and host_checks:
        check_label_range(local.labels, layout.vocab_size, options.ignore_index, one_device=local.group is None)
    exchange = None
    if local.group is not None:  # the value checks travel with the first record exchange
        error = local_error(plan, local, teacher, layout, host_checks) if plan.checks_values else None
        exchange = ShardExchange(local.group, layout.sequence_parallel, error, plan.checks_values, layout.inconsistent)
    elif plan.checks_values:
        read_cache, finite_inputs = host_checks and plan.needs_teacher_logits, config.check_finite_inputs
        check_values(local.student_hidden, local.weight, teacher, layout.real_local_columns, read_cache, finite_inputs)
    valid = local.labels != options.ignore_index
    denominator = valid.sum().clamp_min(1) if local.denominator is None else local.denominator
    teacher_hidden, teacher_weight, teacher_logits, teacher_blocks = local.teacher.logits_inputs(
        layout.vocab_start, layout.vocab_size
    )
    inputs = (local.student_hidden, local.weight, teacher_hidden, teacher_weight, teacher_logits)
    block_math = select_backend(options.backend, device.type, statistics_dtype(*inputs))
    with torch.autocast(device.type, enabled=False):
        if block_math is None:
            vocab, row_weights = layout.vocab_size, local.row_weights
            outputs = reference_loss(plan, local.labels, denominator, *inputs, teacher_blocks, vocab, row_weights)
        else:
            walk = RowWalk(plan, local.labels, valid, exchange, layout, block_math)
            gemms = GemmPolicy(options.gradient_scale)
            problem = ChunkedProblem(walk, denominator, gemms, teacher_blocks, local.row_weights)
            outputs = chunked_loss(problem, *inputs)
    return DistillationLossOutput(*outputs)


# Inside torch.compile'd code the call runs eagerly behind one graph break (validating the options
# warns and raises, which a traced frame would not keep as written).
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
    label_smoothing: float = 0.0,
    z_loss_weight: float = 0.0,
    logit_softcap: float | None = None,
    teacher_logit_softcap: float | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    profile: str = "balanced",
    backend: str = "auto",
    config: ExecutionConfig | None = None,
    gradient_materialization_scale: float | Tensor | None = None,
    grad_scaler: GradScalerLike | None = None,
    num_valid_tokens: float | Tensor | None = None,
    token_weights: Tensor | None = None,
    tp_group: torch.distributed.ProcessGroup | None = None,
    vocab_range: tuple[int, int] | None = None,
    vocab_size: int | None = None,
    sequence_parallel: bool | None = None,
) -> DistillationLossOutput:
    """Student CE, teacher CE and a KL term from hidden states and LM-head weights, without
    building the (BT, V) logits (except with ``backend="reference"``).

    ``loss = student_ce_weight·CE(s) + teacher_ce_weight·CE(t) + kl_weight·T_s²·D(p, q)
    + z_loss_weight·LSE(s)²`` with ``s = student_hidden·weightᵀ`` (``CE(s)`` label-smoothed by
    ``label_smoothing``), ``p = softmax(s/T_s)``, ``q = softmax(t/T_t)``; ``logit_softcap=c``
    (``teacher_logit_softcap`` for a teacher read through a head) makes that side's logits
    ``c·tanh(z/c)`` before every term, the gradient going through the cap (Gemma 2). See
    docs/reference.md for every argument and error, docs/variants.md for the 15 divergences. The
    keywords (all but ``num_valid_tokens`` and ``token_weights``) are those of
    :class:`orda_tp.arguments.options.LossOptions`, which validates them.

    ``gradient_materialization_scale`` (or, when None, ``grad_scaler.get_scale()``) is the scale at
    which fp16 logit gradients are materialized for the tensor-core gradient GEMMs on CUDA; without
    one those GEMMs run in fp32. It has no effect for other dtypes or on the CPU.

    Tensor parallelism: with ``tp_group`` (or a head ``weight`` DTensor sharded on dim 0),
    ``weight`` — and a separate teacher's weight, and cached teacher logits — are this rank's
    vocabulary shard; ``vocab_range=(start, stop)`` places it (default: the shards in rank order);
    ``vocab_size`` marks the columns at or past it as padding; ``sequence_parallel`` says the
    hidden states hold this rank's rows of the batch. Every rank returns the single-device result.

    ``token_weights`` (BT,): per-row weights ``w_i`` that multiply each row's loss and components
    (RL-style per-token weighting); the normalizer of "mean" stays the valid-row count or
    ``num_valid_tokens``: ``loss = Σ_valid w_i·loss_i / N``.
    """
    try:
        options = LossOptions(
            tp_group=tp_group,
            student_ce_weight=student_ce_weight,
            teacher_ce_weight=teacher_ce_weight,
            kl_weight=kl_weight,
            kl_temperature=kl_temperature,
            kl_teacher_temperature=kl_teacher_temperature,
            kl_divergence=kl_divergence,
            kl_alpha=kl_alpha,
            kl_beta=kl_beta,
            entropy_gate=entropy_gate,
            label_smoothing=label_smoothing,
            z_loss_weight=z_loss_weight,
            logit_softcap=logit_softcap,
            teacher_logit_softcap=teacher_logit_softcap,
            ignore_index=ignore_index,
            reduction=reduction,
            profile=profile,
            backend=backend,
            config=config,
            gradient_materialization_scale=gradient_materialization_scale,
            grad_scaler=grad_scaler,
            vocab_range=vocab_range,
            vocab_size=vocab_size,
            sequence_parallel=sequence_parallel,
        )
    except (ValueError, TypeError) as error:  # a bad keyword raises on every rank of a tensor-parallel call
        fail_on_every_rank(error, call_group(weight, tp_group))
    return _run(options, student_hidden, weight, labels, teacher, num_valid_tokens, token_weights)


class DistillationLoss(nn.Module):
    """Module form of :func:`distillation_loss`: its keywords (:class:`orda_tp.arguments.options.LossOptions`)
    are fixed, and validated, at construction; ``forward(student_hidden, weight, labels, teacher,
    gradient_materialization_scale=None, grad_scaler=None, *, num_valid_tokens=None)``."""

    def __init__(self, **keywords: Any) -> None:
        super().__init__()
        self.options = LossOptions(**keywords)

    def forward(
        self,
        student_hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        teacher: TeacherArgument,
        gradient_materialization_scale: float | Tensor | None = None,
        grad_scaler: GradScalerLike | None = None,
        *,
        num_valid_tokens: float | Tensor | None = None,
        token_weights: Tensor | None = None,
    ) -> DistillationLossOutput:
        """The loss of the constructor's keywords; ``gradient_materialization_scale`` and
        ``grad_scaler`` given here (orda-kernel's ``forward`` arguments) replace the constructor's
        for this call."""
        try:
            options = self.options.with_precision(gradient_materialization_scale, grad_scaler)
        except (ValueError, TypeError) as error:
            fail_on_every_rank(error, call_group(weight, self.options.tp_group))
        return _run(options, student_hidden, weight, labels, teacher, num_valid_tokens, token_weights)

    def extra_repr(self) -> str:
        o = self.options
        return (
            f"kl_divergence={o.kl_divergence!r}, student_ce_weight={o.student_ce_weight}, "
            f"teacher_ce_weight={o.teacher_ce_weight}, kl_weight={o.kl_weight}, kl_temperature={o.kl_temperature}, "
            f"reduction={o.reduction!r}, backend={o.backend!r}"
            + "".join(
                f", {name}={getattr(o, name)}" for name in ("label_smoothing", "z_loss_weight") if getattr(o, name)
            )
        )
