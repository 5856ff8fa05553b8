"""The Megatron-core modules' side of the adapter (:mod:`orda_tp.integrations.megatron`): the output
layer that returns its inputs, the models whose forward runs up to it, the per-token loss from them."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from orda_tp import DistillationLoss, DistillationLossOutput, PrecomputedTeacher, SeparateTeacher, TiedTeacher
from orda_tp.engine.call import raised_on_every_rank
from orda_tp.parallel.layout import agree_checks

try:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import ColumnParallelLinear
except ImportError as error:  # an optional extra: say how to install it
    raise ImportError("orda_tp.integrations.megatron needs megatron-core: pip install 'orda_tp[megatron]'") from error

__all__ = [
    "DistillationModel",
    "DistillationSetup",
    "HeadInputs",
    "HeadInputsModel",
    "HeadInputsOutputLayer",
    "per_token_loss",
]

# Label of the rows with loss_mask == 0 (Megatron's labels never hold it).
IGNORE_INDEX = -100

if TYPE_CHECKING:
    # The mixins below only ever join these classes (:func:`_swap_class`): typed as their
    # subclasses, their ``super()`` calls and attributes are checked against Megatron's.
    _OutputLayerBase = ColumnParallelLinear
    _ModelBase = GPTModel
else:
    _OutputLayerBase = _ModelBase = object


@dataclass(frozen=True)
class HeadInputs:
    """What GPTModel passed its output layer."""

    hidden: Tensor  # [s, b, h] ([s/tp, b, h] under sequence parallelism)
    weight: Tensor  # [V_padded/tp, h]: the shard the layer multiplies with (the embeddings' when tied)


class HeadInputsOutputLayer(_OutputLayerBase):
    """Mixin for GPTModel's ``ColumnParallelLinear`` output layer: inside :meth:`returning_head_inputs`
    ``forward`` returns ``(HeadInputs(input_, weight), None)``, no logits; else it is Megatron's."""

    returns_head_inputs: bool = False

    def forward(
        self, input_: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None
    ) -> tuple[Any, Tensor | None]:
        if not self.returns_head_inputs:
            return super().forward(input_, weight, runtime_gather_output)
        # The weight GPTModel passes (the tied embeddings'), else the layer's own: as Megatron's forward picks it.
        return HeadInputs(input_, self.weight if weight is None else weight), None

    @contextmanager
    def returning_head_inputs(self) -> Iterator[None]:
        previous = self.returns_head_inputs  # restored on exit, also after an exception
        self.returns_head_inputs = True
        try:
            yield
        finally:
            self.returns_head_inputs = previous


class HeadInputsModel(_ModelBase):
    """Mixin for GPTModel: :meth:`head_inputs` runs the model up to its output layer."""

    def megatron_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> inspect.BoundArguments:
        """``args``, ``kwargs`` bound to GPTModel.forward's parameters (a TypeError as Megatron's)."""
        return inspect.signature(super().forward).bind(*args, **kwargs)

    def head_inputs(self, *args: Any, **kwargs: Any) -> HeadInputs:
        """GPTModel.forward(*args, **kwargs), which must have ``labels``, with the output layer
        returning its inputs: the ``[s, b, h]`` hidden states and the weight, no logits."""
        if self.megatron_arguments(args, kwargs).arguments.get("labels") is None:
            raise ValueError("head_inputs needs labels=...: without them GPTModel returns logits")
        layer = self.output_layer
        assert isinstance(layer, HeadInputsOutputLayer)  # installed with this mixin
        with layer.returning_head_inputs():
            result = super().forward(*args, **kwargs)
        # The Megatron behaviour this adapter relies on, checked here and nowhere else.
        if not isinstance(result, HeadInputs):
            raise RuntimeError(
                "megatron-core's GPTModel.forward no longer returns compute_language_model_loss(labels, "
                "output_layer(...)[0]) unchanged (as GPTModel._postprocess does in megatron-core 0.16.1); "
                f"it returned {type(result).__name__}. orda_tp.integrations.megatron does not support this "
                "megatron-core version"
            )
        return result

    def compute_language_model_loss(self, labels: Tensor, logits: Any) -> Any:
        """Megatron's per-token cross entropy, except that :class:`HeadInputs` pass through."""
        if isinstance(logits, HeadInputs):
            return logits
        return super().compute_language_model_loss(labels, logits)


@dataclass(frozen=True)
class DistillationSetup:
    """What :func:`install_distillation_head` fixed: the loss (``reduction="none"``, the output layer's
    group and sequence parallelism, the real vocabulary) and the frozen teacher GPTModel, if any."""

    loss: DistillationLoss
    teacher: HeadInputsModel | None
    sequence_parallel: bool
    tp_size: int

    @property
    def needs_teacher(self) -> bool:
        options = self.loss.options
        return options.kl_weight > 0 or (options.teacher_ce_weight or 0.0) > 0


class DistillationModel(HeadInputsModel):
    """Mixin for the student GPTModel: ``forward`` with labels returns the distillation loss."""

    orda_distillation: DistillationSetup

    def forward(
        self, *args: Any, teacher_logits: Tensor | None = None, return_components: bool = False, **kwargs: Any
    ) -> Any:
        """GPTModel.forward's arguments, plus ``teacher_logits`` (a cached teacher ``[b, s, V_padded/tp]``,
        this rank's shard in GPTModel's output layout) and ``return_components`` (an
        :class:`orda_tp.DistillationLossOutput` of ``[b, s]`` tensors instead of the loss). With
        ``labels`` it returns ``[b, s]`` per-token losses; without, GPTModel's output."""
        call = self.megatron_arguments(args, kwargs)
        labels = call.arguments.get("labels")
        if labels is None:
            if teacher_logits is not None or return_components:
                raise ValueError(
                    "teacher_logits= and return_components= need labels=...; without labels the model returns logits"
                )
            return super().forward(*args, **kwargs)
        setup = self.orda_distillation
        group = setup.loss.options.tp_group
        # On a group a failed check is held, not raised, until every rank has said whether its own failed.
        problem = None
        try:
            check_teacher_choice(setup, teacher_logits, call.arguments.get("decoder_input"))
        except (ValueError, TypeError) as error:
            if group is None:
                raise
            problem = error
        if group is not None:  # before the model's own collectives: every rank raises, or none
            agree_checks(group, problem)
        student = self.head_inputs(*args, **kwargs)
        teacher = teacher_logits if setup.teacher is None else frozen_head_inputs(setup.teacher, args, kwargs)
        out = per_token_loss(setup, student, labels, call.arguments.get("loss_mask"), teacher)
        return out if return_components else out.loss


def check_teacher_choice(setup: DistillationSetup, teacher_logits: Tensor | None, decoder_input: object) -> None:
    """One teacher per call: the installed GPTModel, or ``teacher_logits``, or none when the loss
    weights need no teacher. Raised before the model runs (every rank passes the same)."""
    if teacher_logits is not None and not isinstance(teacher_logits, Tensor):
        raise TypeError(f"teacher_logits must be a tensor [b, s, V_padded/tp], got {type(teacher_logits).__name__}")
    if setup.teacher is not None:
        if teacher_logits is not None:
            raise ValueError(
                "the distillation head was installed with teacher=<GPTModel>; teacher_logits= would be a second "
                "teacher (install without teacher= to pass cached logits)"
            )
        if decoder_input is not None:
            raise ValueError(
                "decoder_input= is the student's own embedding output; a teacher GPTModel cannot run on it "
                "(pass input_ids, or install without teacher= and pass teacher_logits=)"
            )
    elif teacher_logits is None and setup.needs_teacher:
        options = setup.loss.options
        raise ValueError(
            f"kl_weight={options.kl_weight}, teacher_ce_weight={options.teacher_ce_weight} need a teacher: install the "
            "distillation head with teacher=<GPTModel>, or pass teacher_logits=[b, s, V_padded/tp] to the forward"
        )


def frozen_head_inputs(teacher: HeadInputsModel, args: tuple[Any, ...], kwargs: dict[str, Any]) -> HeadInputs:
    """The teacher's output-layer inputs on the student's arguments, under ``torch.no_grad()``."""
    with torch.no_grad():
        head = teacher.head_inputs(*args, **kwargs)
    # Detached: the teacher's parameters may keep requires_grad, and get no gradient.
    return HeadInputs(head.hidden, head.weight.detach())


@dataclass(frozen=True)
class RowOrder:
    """How the ``[b, s]`` positions become the loss's rows: sequence-major (row ``i_s·b + i_b``) or
    batch-major (row ``i_b·s + i_s``)."""

    batch_major: bool

    def hidden_rows(self, hidden: Tensor) -> Tensor:
        """``[s, b, h]`` → ``(rows, h)``."""
        if self.batch_major:
            hidden = hidden.transpose(0, 1)
        return hidden.reshape(-1, hidden.shape[-1])

    def position_rows(self, values: Tensor) -> Tensor:
        """``[b, s, ...]`` → ``(rows, ...)``."""
        if not self.batch_major:
            values = values.transpose(0, 1)
        return values.reshape(-1, *values.shape[2:])

    def positions(self, rows: Tensor, batch: int, seq: int) -> Tensor:
        """``(rows,)`` → ``[b, s]`` (contiguous, as Megatron's ``loss_func`` views it)."""
        if self.batch_major:
            return rows.reshape(batch, seq)
        return rows.reshape(seq, batch).transpose(0, 1).contiguous()


def check_layouts(
    setup: DistillationSetup, student: HeadInputs, labels: Tensor, loss_mask: Tensor | None, teacher: object
) -> None:
    """Megatron's layouts: labels and loss_mask ``[b, s]``, hidden states ``[s, b, h]`` (``[s/tp,
    b, h]`` under sequence parallelism), cached logits ``[b, s, V/tp]``."""
    # A transposed tensor has as many elements, so the loss alone would not notice it.
    if not isinstance(labels, Tensor) or labels.dim() != 2:
        raise ValueError(f"labels must be Megatron's [b, s] tensor, got {shape_text(labels)}")
    batch, seq = labels.shape
    if loss_mask is not None and (not isinstance(loss_mask, Tensor) or loss_mask.shape != labels.shape):
        raise ValueError(
            f"loss_mask must have labels' shape [b, s] = {list(labels.shape)}, got {shape_text(loss_mask)}"
        )
    rows = seq // setup.tp_size if setup.sequence_parallel else seq
    sides = [("the student's", student.hidden)]
    if isinstance(teacher, HeadInputs):
        sides.append(("the teacher's", teacher.hidden))
    for side, hidden in sides:
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != (rows, batch):
            layout = "[s/tp, b, h] (sequence parallel)" if setup.sequence_parallel else "[s, b, h]"
            raise ValueError(
                f"{side} output layer received hidden states of shape {list(hidden.shape)}; with labels [b, s] = "
                f"{[batch, seq]} they must be {layout} = {[rows, batch]} + [h]"
            )
    if isinstance(teacher, Tensor) and (teacher.dim() != 3 or tuple(teacher.shape[:2]) != (batch, seq)):
        raise ValueError(
            f"teacher_logits must be [b, s, V_padded/tp] = {[batch, seq]} + [V_padded/tp] (GPTModel's output "
            f"layout: batch first, this rank's vocabulary shard), got {list(teacher.shape)}"
        )


def per_token_loss(
    setup: DistillationSetup,
    student: HeadInputs,
    labels: Tensor,
    loss_mask: Tensor | None,
    teacher: HeadInputs | Tensor | None,
) -> DistillationLossOutput:
    """``setup.loss`` on Megatron's tensors, each field ``[b, s]``, 0 where ``loss_mask == 0``;
    ``teacher``: a teacher's output-layer inputs, cached logits ``[b, s, V_padded/tp]``, or None when
    the loss needs no teacher (``kl_weight == teacher_ce_weight == 0``)."""
    # Sequence-major rows are [s, b, h] as a view, and under sequence parallelism each rank's [s/tp, b, h] is the
    # contiguous block of rows the loss expects. Batch-major only for a cache without it: the [b, s, V/tp] cache
    # is read in place and the hidden states (h ≪ V/tp) are copied instead.
    order = RowOrder(batch_major=isinstance(teacher, Tensor) and not setup.sequence_parallel)
    with raised_on_every_rank(lambda: setup.loss.options.tp_group):  # through the loss's handshake
        check_layouts(setup, student, labels, loss_mask, teacher)
        if loss_mask is not None:  # a masked position is an ignored row: loss 0, no gradient, label never read
            labels = labels.masked_fill(loss_mask == 0, IGNORE_INDEX)
        hidden = order.hidden_rows(student.hidden)
        descriptor = _teacher_descriptor(setup, order, hidden, teacher)
    out = setup.loss(hidden, student.weight, order.position_rows(labels), descriptor)
    batch, seq = labels.shape
    return DistillationLossOutput(*(order.positions(value, batch, seq) for value in out))


def _teacher_descriptor(
    setup: DistillationSetup, order: RowOrder, hidden: Tensor, teacher: object
) -> TiedTeacher | SeparateTeacher | PrecomputedTeacher:
    """The loss's teacher for ``teacher`` (see :func:`per_token_loss`), rows in ``order``."""
    if isinstance(teacher, HeadInputs):
        return SeparateTeacher(order.hidden_rows(teacher.hidden), teacher.weight)
    if isinstance(teacher, Tensor):
        return PrecomputedTeacher(logits=order.position_rows(teacher))
    if teacher is None and not setup.needs_teacher:  # a placeholder the loss never reads
        return TiedTeacher(hidden.detach())
    raise TypeError(f"teacher must be HeadInputs, a logits tensor or None (no KL), got {type(teacher).__name__}")


# ---------------------------------------------------------------------------------- installation


def shape_text(value: object) -> str:
    return str(list(value.shape)) if isinstance(value, Tensor) else type(value).__name__
