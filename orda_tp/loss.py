"""The door of the fused loss: :func:`distillation_loss`, :class:`DistillationLoss`,
:class:`DistillationLossOutput`, :func:`is_available` (the path of a call: docs/architecture.md,
"Reading a call")."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from .arguments.config import ExecutionConfig
from .arguments.mixture_plan import mixture_plan
from .arguments.options import GradScalerLike, LossOptions, check_loss_keywords
from .arguments.plan import LossPlan
from .arguments.validation import ValueChecks, check_denominator, check_inputs, check_token_weights, runs_host_checks
from .divergences import EntropyGate
from .engine.call import agree, call_text, prepare_call, raised_on_every_rank
from .engine.fused import chunked_loss
from .engine.gradient_gemms import GemmPolicy
from .engine.logits import HeadTensors, statistics_dtype
from .engine.mixture_blocks import mixture_blocks
from .engine.reference import reference_loss
from .kernels import is_available
from .loss_op import traced_loss
from .parallel.fsdp import head_parameters, unsharded_head
from .parallel.layout import HeadShard, LocalShard
from .parallel.local_shards import LocalInputs, call_group, shard_inputs
from .teachers import SeparateTeacher, TeacherHead, TeacherMixture, TeacherSource

__all__ = ["DistillationLoss", "DistillationLossOutput", "distillation_loss", "is_available"]

TeacherArgument = TeacherSource | TeacherHead


class DistillationLossOutput(NamedTuple):
    """``loss`` (differentiable) and its unweighted components (detached): 0-d tensors for
    "mean"/"sum", (BT,) per row for "none" (0 on ignored rows). ``kl`` includes ``T_s²``, ``z_loss``
    is the rows' ``LSE(s)²``; a term of weight 0 is not computed and reads 0. ``student_entropy``
    is ``H(p) = −Σ p log p`` at ``T_s`` (``student_entropy=True``; else 0), in no loss term. The
    first four fields are orda-kernel's."""

    loss: Tensor
    student_ce: Tensor
    teacher_ce: Tensor
    kl: Tensor
    z_loss: Tensor
    student_entropy: Tensor


def _teacher_type_error(teacher: object) -> TypeError:
    return TypeError(
        "teacher must be a TiedTeacher, SeparateTeacher or PrecomputedTeacher (or a TeacherHead, or a "
        "TeacherMixture of them), "
        f"got {type(teacher).__name__}"
    )


@contextmanager
def _readable_teacher(teacher: TeacherHead | TeacherMixture, reduction: str) -> Iterator[TeacherSource]:
    """A :class:`TeacherHead` as the :class:`SeparateTeacher` of its weight and bias, gathered where
    FSDP2 shards them; a mixture with each of its ``TeacherHead`` teachers read so, for the call."""
    grad_on = torch.is_grad_enabled()
    # A "none" reduction defers the gradient: its backward recomputes the logits from the gathered weight.
    read_after_call = grad_on and reduction == "none"
    if isinstance(teacher, TeacherMixture):
        with ExitStack() as stack:
            sources: list[TeacherSource | TeacherHead] = []
            for member in teacher.teachers:
                if isinstance(member, TeacherHead):  # frozen in a mixture: no gradient reaches its head
                    weight, bias = stack.enter_context(unsharded_head(member.head, False, read_after_call))
                    member = SeparateTeacher(member.hidden, weight, bias)
                sources.append(member)
            yield replace(teacher, teachers=sources)
        return
    receives_grad = grad_on and any(p.requires_grad for p in head_parameters(teacher.head) if p is not None)
    with unsharded_head(teacher.head, receives_grad, read_after_call) as (weight, bias):
        yield SeparateTeacher(teacher.hidden, weight, bias)


def _one_device_inputs(
    options: LossOptions,
    student_hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    teacher: TeacherSource,
    num_valid_tokens: object,
    token_weights: object,
    bias: Tensor | None = None,
) -> tuple[LocalInputs, LocalShard]:
    """The checked tensors of a one-device call and its whole head (``shard_inputs``'s counterpart)."""
    # Both describe one rank's share of a tensor-parallel call: without a group they mean nothing.
    if options.vocab_range is not None:
        raise ValueError("vocab_range describes a shard of a tensor-parallel head and needs tp_group")
    if options.sequence_parallel:
        raise ValueError("sequence_parallel=True needs tp_group (or a DTensor student_hidden)")
    check_inputs(student_hidden, weight, labels, teacher, vocab_size=options.vocab_size, bias=bias)
    if isinstance(teacher, TeacherMixture):  # its weights' values read once, its form decided
        teacher = teacher.prepared(labels.shape[0])
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
        bias=bias,
        denominator=denominator,
        row_weights=row_weights,
    )
    return local, LocalShard(head=HeadShard("weight", weight, 0), labels=labels, vocab_size=options.vocab_size)


# Never traced: under torch.compile a call is one operator (loss_op), whose implementation runs this
# path, or runs it eagerly behind a graph break; its host reads, chunk loop, record exchanges and
# hand-written backward are not traceable, and gain nothing from tracing.
@torch.compiler.disable
def _run(
    options: LossOptions,
    student_hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    teacher: object,
    num_valid_tokens: object,
    token_weights: object = None,
    bias: Tensor | None = None,
) -> DistillationLossOutput:
    """The loss of one call: its tensors checked, its layout agreed, its plan, the prepared call
    (:func:`orda_tp.engine.call.prepare_call`) and the selected backend."""
    # A teacher head module: read as the SeparateTeacher of its weight, gathered if FSDP2 shards it.
    if isinstance(teacher, TeacherHead) or (isinstance(teacher, TeacherMixture) and teacher.holds_modules):
        with _readable_teacher(teacher, options.reduction) as source:
            return _run(options, student_hidden, weight, labels, source, num_valid_tokens, token_weights, bias)
    # Tensor parallelism: a group is given, or some tensor is a DTensor (whose mesh names the group).
    held = [tensor for _, tensor in teacher.named_tensors()] if isinstance(teacher, TeacherSource) else []
    given = [student_hidden, weight, labels, bias, *held]
    sharded = options.tp_group is not None or any(isinstance(tensor, DTensor) for tensor in given)
    group = call_group(weight, options.tp_group) if sharded else None
    checks = shard_inputs if sharded else _one_device_inputs
    with raised_on_every_rank(lambda: group):
        if not isinstance(teacher, TeacherSource):
            raise _teacher_type_error(teacher)
        local, shard = checks(options, student_hidden, weight, labels, teacher, num_valid_tokens, token_weights, bias)
    # On a group the handshake: every check after it decides alike on every rank.
    layout = agree(
        group,
        shard,
        options.kernel_config.host_checks,
        lambda: call_text(
            options.settings_text, teacher.settings_text(), token_weights, ("num_valid_tokens", num_valid_tokens)
        ),
    )
    build = mixture_plan if isinstance(local.teacher, TeacherMixture) else LossPlan.build
    plan = build(options, local.teacher, layout.vocab_size)
    # The teacher's hidden states, head or logits as tensors; blocks it forms itself (a top-k cache) apart.
    teacher_hidden, teacher_weight, teacher_logits, teacher_blocks, teacher_bias = local.teacher.logits_inputs(
        layout.vocab_start, layout.vocab_size
    )
    inputs = HeadTensors(
        local.student_hidden, local.weight, teacher_hidden, teacher_weight, teacher_logits, local.bias, teacher_bias
    )
    if plan.mixture is not None:  # several teachers read as one: the mixture forms the blocks
        teacher_blocks = mixture_blocks(plan.mixture, local.teacher, inputs, layout)
    finite = [("student_hidden", local.student_hidden), ("weight", local.weight)]
    finite += [] if local.bias is None else [("bias", local.bias)]
    # The teacher as given holds the recorded version counters; this rank's shards hold the values read.
    values = ValueChecks(
        teacher, local.teacher, plan.needs_teacher_logits, finite if plan.config.check_finite_inputs else []
    )
    call = prepare_call(
        plan,
        layout,
        local.labels,
        backend=options.backend,
        dtype=statistics_dtype(*inputs),
        ignore_index=options.ignore_index,
        denominator=local.denominator,
        # The plan decides alike on every rank, so the first record exchange has one width everywhere.
        values=values if plan.checks_values else None,
        row_weights=local.row_weights,
        gemms=GemmPolicy(options.gradient_scale, (plan.student_scale, plan.teacher_scale)),
        teacher_blocks=teacher_blocks,
    )
    # Statistics in fp32/fp64 whatever autocast would pick for the GEMMs; no block math: the fp64 reference.
    with torch.autocast(local.student_hidden.device.type, enabled=False):
        outputs = reference_loss(call, *inputs) if call.math is None else chunked_loss(call, *inputs)
    return DistillationLossOutput(*outputs)


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
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    profile: str = "balanced",
    backend: str = "auto",
    config: ExecutionConfig | None = None,
    gradient_materialization_scale: float | Tensor | None = None,
    grad_scaler: GradScalerLike | None = None,
    bias: Tensor | None = None,
    num_valid_tokens: float | Tensor | None = None,
    token_weights: Tensor | None = None,
    tp_group: torch.distributed.ProcessGroup | None = None,
    vocab_range: tuple[int, int] | None = None,
    vocab_size: int | None = None,
    sequence_parallel: bool | None = None,
    student_entropy: bool = False,
) -> DistillationLossOutput:
    """Student CE, teacher CE and a KL term from hidden states and LM-head weights, without
    building the (BT, V) logits (except with ``backend="reference"``).

    ``student_hidden`` (BT, H): the states that feed the LM head, batch and sequence flattened;
    ``weight`` (V, H): the head's weight as ``nn.Linear`` stores it, ``bias`` (V,) its bias or None;
    ``labels`` (BT,) ``torch.long``: each row's target, or ``ignore_index``; ``teacher``:
    ``TiedTeacher(hidden)`` (BT, H) read through ``weight`` and ``bias``, ``SeparateTeacher(hidden,
    weight, bias=None)`` (BT, H_t), (V, H_t) and (V,),
    ``TeacherHead(hidden, head_module)``, or ``PrecomputedTeacher(logits=...)`` (BT, V) /
    ``(teacher_hidden=..., teacher_weight=...)`` as a separate teacher's / ``(topk_ids=...,
    topk_logprobs=...)`` (BT, k). Every tensor on one device; hidden states, weights and logits
    fp16, bf16, fp32 or fp64, not necessarily of one dtype.

    Returns a :class:`DistillationLossOutput` ``(loss, student_ce, teacher_ce, kl, z_loss,
    student_entropy)``: ``loss`` differentiable, the unweighted components detached; 0-d tensors
    for ``reduction=`` "mean" (over the rows not ignored, or ``num_valid_tokens``) and "sum", (BT,)
    per row for "none" (0 on ignored rows). ``student_entropy=True`` reports the student's entropy
    ``H(p) = −Σ p log p`` (the KL's ``p``, with or without a KL term; TRL's "entropy"), reduced as
    the components are and never differentiated; else it reads 0.

    ``loss = student_ce_weight·CE(s) + teacher_ce_weight·CE(t) + kl_weight·T_s²·D(p, q)
    + z_loss_weight·LSE(s)²`` with ``s = cap(logit_scale·(student_hidden·weightᵀ + bias))``
    (``CE(s)`` label-smoothed by ``label_smoothing``), ``t`` alike from the teacher's head, bias and
    ``teacher_logit_scale``, ``p = softmax(s/T_s)``, ``q = softmax(t/T_t)``; ``logit_softcap=c``
    (``teacher_logit_softcap`` for a teacher read through a head) makes ``cap(z) = c·tanh(z/c)``
    (Gemma 2; else the identity), the gradient going through the scale and the cap. Every argument
    and error: docs/reference.md; the 15 divergences: docs/variants.md.

    ``gradient_materialization_scale`` (None: ``grad_scaler.get_scale()``) is the scale at which
    fp16 logit gradients are materialized for the tensor-core gradient GEMMs on CUDA; without one
    those GEMMs run in fp32 (no effect for other dtypes or on the CPU).

    Tensor parallelism: with ``tp_group`` (or a head ``weight`` DTensor sharded on dim 0), ``weight``,
    a separate teacher's weight and cached teacher logits are this rank's vocabulary shard, placed by
    ``vocab_range=(start, stop)`` (default: the shards in rank order); ``vocab_size`` marks the columns
    at or past it as padding; ``sequence_parallel``: the hidden states hold this rank's rows. Every
    rank returns the single-device result.

    ``token_weights`` (BT,): per-row weights ``w_i`` of each row's loss and components; "mean"
    still divides by the valid rows or ``num_valid_tokens``: ``loss = Σ_valid w_i·loss_i / N``.
    """
    keywords: dict[str, Any] = dict(
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
        logit_scale=logit_scale,
        teacher_logit_scale=teacher_logit_scale,
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
        student_entropy=student_entropy,
    )
    if torch.compiler.is_compiling():
        traced = traced_loss(
            _run, None, keywords, student_hidden, weight, labels, teacher, num_valid_tokens, token_weights, bias
        )
        if traced is not None:
            return DistillationLossOutput(*traced)
        # Not one operator (tensor parallelism, a mixture, a top-k cache...): eagerly, behind a graph break.
        return _eager_door(
            student_hidden,
            weight,
            labels,
            teacher,
            bias=bias,
            num_valid_tokens=num_valid_tokens,
            token_weights=token_weights,
            **keywords,
        )
    with raised_on_every_rank(lambda: call_group(weight, tp_group)):  # a bad keyword raises on every rank
        options = LossOptions(**keywords)
    return _run(options, student_hidden, weight, labels, teacher, num_valid_tokens, token_weights, bias)


# Under torch.compile, a call that is not one operator: validating the keywords warns and raises,
# which a traced frame would not keep as written.
@torch.compiler.disable
def _eager_door(*args: Any, **keywords: Any) -> DistillationLossOutput:
    """:func:`distillation_loss` run eagerly (a graph break where it is called in traced code)."""
    return distillation_loss(*args, **keywords)


class DistillationLoss(nn.Module):
    """Module form of :func:`distillation_loss`: its keywords are fixed and validated at construction
    (:class:`~orda_tp.arguments.options.LossOptions`); ``forward(student_hidden, weight, labels,
    teacher)`` takes the call's tensors, with :func:`distillation_loss`'s shapes, and returns its
    :class:`DistillationLossOutput`."""

    def __init__(self, **keywords: Any) -> None:
        super().__init__()
        check_loss_keywords(type(self).__name__, keywords)
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
        bias: Tensor | None = None,
    ) -> DistillationLossOutput:
        """The loss of the constructor's keywords; ``gradient_materialization_scale`` and
        ``grad_scaler`` given here (orda-kernel's) replace the constructor's for this call;
        ``bias``: the student head's, as :func:`distillation_loss` takes it."""
        if torch.compiler.is_compiling() and gradient_materialization_scale is None and grad_scaler is None:
            args = (student_hidden, weight, labels, teacher, num_valid_tokens, token_weights, bias)
            traced = traced_loss(_run, self.options, {}, *args)
            if traced is not None:
                return DistillationLossOutput(*traced)
        with raised_on_every_rank(lambda: call_group(weight, self.options.tp_group)):
            options = self.options.with_precision(gradient_materialization_scale, grad_scaler)
        return _run(options, student_hidden, weight, labels, teacher, num_valid_tokens, token_weights, bias)

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
