"""Megatron-core adapter: a ``GPTModel`` whose forward with ``labels`` returns orda_tp's loss.

One step, right after building the model (in ``model_provider``)::

    install_distillation_head(model, vocab_size=tokenizer_vocab_size, teacher=teacher,
                              kl_weight=1.0, kl_temperature=2.0)

Afterwards ``model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)``
returns Megatron's ``[b, s]`` per-token losses (what ``loss_func`` multiplies by ``loss_mask`` and
sums), computed by :func:`orda_tp.distillation_loss` with ``reduction="none"`` from the hidden
states GPTModel feeds its output layer and the weight it passes it, without building the logits::

    loss[b, s] = w_s·CE(s) + w_t·CE(t) + w_kl·T_s²·D(p, q)     (0 where loss_mask == 0, no gradient)

Without ``labels`` the model returns its logits as before (evaluation, generation).

Mechanism. Nothing private of Megatron is overridden; two instances change class, to a subclass
of their own class created once per class (the pattern of FSDP2's ``fully_shard``), so their
parameters, buffers, state-dict keys, hooks and checkpoints stay as they were:

- the output layer (a ``ColumnParallelLinear``) gets :class:`HeadInputsOutputLayer`: inside
  ``returning_head_inputs()`` its ``forward`` returns ``(HeadInputs(input, weight), None)``, its
  inputs, instead of ``(logits, bias)``;
- the model gets :class:`DistillationModel`: ``forward`` with labels runs GPTModel's forward in
  that mode (:meth:`HeadInputsModel.head_inputs`), then the loss; ``compute_language_model_loss``
  passes :class:`HeadInputs` through. A teacher GPTModel gets :class:`HeadInputsModel` only (its
  forward is unchanged).

The one Megatron behaviour relied on (megatron-core 0.16.1, ``GPTModel._postprocess``): given
labels, GPTModel's forward returns ``compute_language_model_loss(labels, output_layer(hidden,
weight=...)[0])`` as it is. :meth:`HeadInputsModel.head_inputs` raises ``RuntimeError`` when that
stops holding.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import ColumnParallelLinear
from torch import Tensor, nn

from orda_tp import DistillationLoss, DistillationLossOutput, PrecomputedTeacher, SeparateTeacher, TiedTeacher

__all__ = [
    "DistillationModel",
    "DistillationSetup",
    "HeadInputs",
    "HeadInputsModel",
    "HeadInputsOutputLayer",
    "install_distillation_head",
    "per_token_loss",
]

# Label of the rows with loss_mask == 0 (Megatron's labels never hold it).
IGNORE_INDEX = -100
# Keywords of orda_tp.distillation_loss that the adapter sets itself.
ADAPTER_KEYWORDS = (
    "reduction", "ignore_index", "tp_group", "vocab_range", "vocab_size", "sequence_parallel", "num_valid_tokens",
)  # fmt: skip
# Variants that train the teacher; a teacher GPTModel runs under torch.no_grad().
COTRAINING_VARIANTS = ("mutual", "cojeffreys")

if TYPE_CHECKING:
    # The mixins below only ever join these classes (:func:`_swap_class`): typed as their
    # subclasses, their ``super()`` calls and attributes are checked against Megatron's.
    _OutputLayerBase = ColumnParallelLinear
    _ModelBase = GPTModel
else:
    _OutputLayerBase = _ModelBase = object


@dataclass(frozen=True)
class HeadInputs:
    """What GPTModel passed its output layer: ``hidden`` ``[s, b, h]`` (``[s/tp, b, h]`` under
    sequence parallelism) and ``weight`` ``[V_padded/tp, h]``, the vocabulary shard the layer
    multiplies with (the word embeddings' when they are tied to the output layer)."""

    hidden: Tensor
    weight: Tensor


class HeadInputsOutputLayer(_OutputLayerBase):
    """Mixin for GPTModel's ``ColumnParallelLinear`` output layer: inside
    :meth:`returning_head_inputs`, ``forward`` returns ``(HeadInputs(input_, weight), None)``
    without running the logits GEMM; otherwise it is ``ColumnParallelLinear.forward``."""

    returns_head_inputs: bool = False

    def forward(
        self, input_: Tensor, weight: Tensor | None = None, runtime_gather_output: bool | None = None
    ) -> tuple[Any, Tensor | None]:
        if not self.returns_head_inputs:
            return super().forward(input_, weight, runtime_gather_output)
        return HeadInputs(input_, self.weight if weight is None else weight), None

    @contextmanager
    def returning_head_inputs(self) -> Iterator[None]:
        previous = self.returns_head_inputs
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
    """What :func:`install_distillation_head` fixed: the loss (``reduction="none"``, the output
    layer's tensor-parallel group and sequence parallelism, the real vocabulary size) and the
    frozen teacher GPTModel, if any. Held as a plain attribute (``model.orda_distillation``), so
    that neither module becomes a submodule of the student."""

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
        """GPTModel.forward's arguments, plus:

        - ``teacher_logits``: a cached teacher, ``[b, s, V_padded/tp]``, this rank's vocabulary
          shard in GPTModel's output layout (what a teacher's ``forward`` without labels returns);
        - ``return_components``: return an :class:`orda_tp.DistillationLossOutput` of ``[b, s]``
          tensors (loss; student CE, teacher CE and KL, unweighted and detached) instead of the loss.

        With ``labels`` it returns ``[b, s]`` per-token losses; without, GPTModel's output.
        """
        call = self.megatron_arguments(args, kwargs)
        labels = call.arguments.get("labels")
        if labels is None:
            if teacher_logits is not None or return_components:
                raise ValueError(
                    "teacher_logits= and return_components= need labels=...; without labels the model returns logits"
                )
            return super().forward(*args, **kwargs)
        setup = self.orda_distillation
        check_teacher_choice(setup, teacher_logits, call.arguments.get("decoder_input"))
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
    return HeadInputs(head.hidden, head.weight.detach())


@dataclass(frozen=True)
class RowOrder:
    """How the ``[b, s]`` positions become the loss's rows.

    Sequence-major (row ``i_s·b + i_b``): the hidden states ``[s, b, h]`` flatten as a view, and
    under sequence parallelism rank r's ``[s/tp, b, h]`` are the rows ``[r·(s/tp)·b, (r+1)·(s/tp)·b)``,
    the contiguous block orda_tp expects. Batch-major (row ``i_b·s + i_s``): a cached teacher
    ``[b, s, V/tp]`` flattens as a view and the hidden states (``h ≪ V/tp``) are copied instead;
    used for cached logits without sequence parallelism.
    """

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
    b, h]`` under sequence parallelism), cached logits ``[b, s, V/tp]``. A transposed tensor has as
    many elements, so the loss alone would not notice. Every rank sees the same shapes."""
    if not isinstance(labels, Tensor) or labels.dim() != 2:
        raise ValueError(f"labels must be Megatron's [b, s] tensor, got {_shape(labels)}")
    batch, seq = labels.shape
    if loss_mask is not None and (not isinstance(loss_mask, Tensor) or loss_mask.shape != labels.shape):
        raise ValueError(f"loss_mask must have labels' shape [b, s] = {list(labels.shape)}, got {_shape(loss_mask)}")
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
    """``setup.loss`` on Megatron's tensors; each field ``[b, s]``, 0 where ``loss_mask == 0``.

    ``teacher``: a teacher's output-layer inputs (``SeparateTeacher``), cached logits ``[b, s,
    V_padded/tp]`` (``PrecomputedTeacher``), or None when the loss needs no teacher (a tied
    placeholder the loss never reads: ``kl_weight == teacher_ce_weight == 0``).
    """
    check_layouts(setup, student, labels, loss_mask, teacher)
    order = RowOrder(batch_major=isinstance(teacher, Tensor) and not setup.sequence_parallel)
    if loss_mask is not None:
        labels = labels.masked_fill(loss_mask == 0, IGNORE_INDEX)
    hidden = order.hidden_rows(student.hidden)
    descriptor: TiedTeacher | SeparateTeacher | PrecomputedTeacher
    if isinstance(teacher, HeadInputs):
        descriptor = SeparateTeacher(order.hidden_rows(teacher.hidden), teacher.weight)
    elif isinstance(teacher, Tensor):
        descriptor = PrecomputedTeacher(logits=order.position_rows(teacher))
    elif teacher is None and not setup.needs_teacher:
        descriptor = TiedTeacher(hidden.detach())
    else:
        raise TypeError(f"teacher must be HeadInputs, a logits tensor or None (no KL), got {type(teacher).__name__}")
    out = setup.loss(hidden, student.weight, order.position_rows(labels), descriptor)
    batch, seq = labels.shape
    return DistillationLossOutput(*(order.positions(value, batch, seq) for value in out))


# ---------------------------------------------------------------------------------- installation


def install_distillation_head(
    model: nn.Module, *, vocab_size: int, teacher: nn.Module | None = None, **loss_options: Any
) -> nn.Module:
    """Make ``model(..., labels=labels, loss_mask=loss_mask)`` return orda_tp's ``[b, s]`` losses.

    ``model``: a ``GPTModel`` holding the output layer (the last pipeline stage), or a wrapper of
    one (``.module``). ``vocab_size``: the tokenizer's vocabulary; the model's padded columns get no
    probability. ``teacher``: a frozen teacher ``GPTModel`` with the same tensor-parallel group,
    padded vocabulary and sequence parallelism, run under ``torch.no_grad()`` on the student's
    inputs; without one, pass ``teacher_logits=`` to the forward (or use only the student CE).
    ``loss_options``: keywords of :func:`orda_tp.distillation_loss` (``student_ce_weight``,
    ``kl_weight``, ``kl_temperature``, ``kl_divergence``, ...); ``teacher_ce_weight`` defaults to 0.
    Installing again replaces the settings. Returns ``model``.
    """
    student = _gpt_model(model, "model")
    _check_output_stage(student, "model")
    layer = student.output_layer
    reserved = sorted(set(loss_options) & set(ADAPTER_KEYWORDS))
    if reserved:
        raise ValueError(
            f"install_distillation_head sets {reserved} itself (reduction='none', loss_mask == 0 rows ignored, "
            "tp_group and sequence_parallel from the output layer, vocab_size= its own keyword); got them in "
            "loss_options"
        )
    tp_size = dist.get_world_size(layer.tp_group)
    padded = layer.output_size_per_partition * tp_size
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 0 < vocab_size <= padded:
        raise ValueError(
            f"vocab_size must be the real vocabulary size, an int in [1, {padded}] (the model's padded vocabulary "
            f"{layer.output_size_per_partition} × tp {tp_size}), got {vocab_size!r}"
        )
    loss = DistillationLoss(
        **{"teacher_ce_weight": 0.0, **loss_options},
        reduction="none",
        ignore_index=IGNORE_INDEX,
        tp_group=layer.tp_group if tp_size > 1 else None,
        vocab_size=vocab_size,
        sequence_parallel=layer.sequence_parallel,
    )
    teacher_model = None
    if teacher is not None:
        teacher_gpt = _gpt_model(teacher, "teacher")
        _check_teacher(student, teacher_gpt, loss)
        _swap_class(teacher_gpt.output_layer, HeadInputsOutputLayer)
        teacher_model = _swap_class(teacher_gpt, HeadInputsModel)
    _swap_class(layer, HeadInputsOutputLayer)
    distilling = _swap_class(student, DistillationModel)
    distilling.orda_distillation = DistillationSetup(loss, teacher_model, layer.sequence_parallel, tp_size)
    return model


def _gpt_model(model: object, name: str) -> GPTModel:
    """``model`` itself or the GPTModel a wrapper holds (``Float16Module``, DDP: ``.module``)."""
    found = model
    while not isinstance(found, GPTModel):
        inner = getattr(found, "module", None)
        if not isinstance(inner, nn.Module):
            break
        found = inner
    if not isinstance(found, GPTModel):
        raise TypeError(f"{name} must be a megatron.core GPTModel (or a wrapper of one), got {type(model).__name__}")
    return found


def _check_output_stage(model: GPTModel, name: str) -> None:
    """The model holds its output layer and feeds it once per forward, as GPTModel does."""
    if not model.post_process:
        raise ValueError(
            f"{name} has no output layer (post_process=False: a pipeline stage before the last); install the "
            "distillation head on the last pipeline stage only (if post_process: ...), the other stages are unchanged"
        )
    if getattr(model, "mtp_process", False) or model.config.mtp_num_layers:
        raise ValueError(
            f"{name} uses multi-token prediction (mtp_num_layers={model.config.mtp_num_layers}), which is not "
            "supported: its output layer is called once per prediction depth"
        )
    if model.config.defer_embedding_wgrad_compute:
        raise ValueError(
            f"{name} has defer_embedding_wgrad_compute=True, which is not supported: it computes the output "
            "layer's weight gradient outside autograd, from buffers of the logits GEMM"
        )
    if not isinstance(model.output_layer, ColumnParallelLinear):
        raise TypeError(f"{name}.output_layer must be a ColumnParallelLinear, got {type(model.output_layer).__name__}")


def _check_teacher(student: GPTModel, teacher: GPTModel, loss: DistillationLoss) -> None:
    """A teacher GPTModel must produce hidden rows and vocabulary shards that line up with the
    student's on every rank."""
    if teacher is student:
        raise ValueError("teacher must be another GPTModel than the student")
    _check_output_stage(teacher, "teacher")
    if not teacher.pre_process or student.config.pipeline_model_parallel_size > 1:
        raise ValueError(
            "a teacher GPTModel needs the whole model on the student's ranks, without pipeline parallelism "
            f"(student pipeline_model_parallel_size={student.config.pipeline_model_parallel_size}, teacher "
            f"pre_process={teacher.pre_process}); under pipeline parallelism pass teacher_logits= instead"
        )
    if loss.options.kl_divergence in COTRAINING_VARIANTS:
        raise ValueError(
            f"kl_divergence={loss.options.kl_divergence!r} trains the teacher, but a teacher GPTModel runs frozen "
            "under torch.no_grad(); use a teacher-detached variant such as 'jeffreys'"
        )
    mine, theirs = student.output_layer, teacher.output_layer
    ranks = dist.get_process_group_ranks(mine.tp_group), dist.get_process_group_ranks(theirs.tp_group)
    if ranks[0] != ranks[1] or mine.output_size_per_partition != theirs.output_size_per_partition:
        raise ValueError(
            "the teacher must have the student's tensor-parallel group and padded vocabulary: student tp ranks "
            f"{ranks[0]} with {mine.output_size_per_partition} vocabulary rows each, teacher tp ranks {ranks[1]} "
            f"with {theirs.output_size_per_partition}"
        )
    if mine.sequence_parallel != theirs.sequence_parallel:
        raise ValueError(
            f"the teacher must use the student's sequence parallelism (student sequence_parallel="
            f"{mine.sequence_parallel}, teacher {theirs.sequence_parallel}): its hidden rows must be the student's"
        )


# Subclasses created by _swap_class, one per (mixin, original class).
_SUBCLASSES: dict[tuple[type, type], type] = {}

Mixin = TypeVar("Mixin")


def _swap_class(module: nn.Module, mixin: type[Mixin]) -> Mixin:
    """Give ``module`` the class ``(mixin, its original class)`` unless it has ``mixin`` already;
    its state (parameters, buffers, hooks, attributes) is untouched. Returns ``module``."""
    if isinstance(module, mixin):
        return module
    original = getattr(type(module), "orda_original_class", type(module))
    key = (mixin, original)
    if key not in _SUBCLASSES:
        name = mixin.__name__.removesuffix("Model").removesuffix("OutputLayer") + original.__name__
        _SUBCLASSES[key] = type(name, (mixin, original), {"__module__": __name__, "orda_original_class": original})
    module.__class__ = _SUBCLASSES[key]
    assert isinstance(module, mixin)
    return module


def _shape(value: object) -> str:
    return str(list(value.shape)) if isinstance(value, Tensor) else type(value).__name__
