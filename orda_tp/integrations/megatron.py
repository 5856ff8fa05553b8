"""Megatron-core adapter: :func:`install_distillation_head` makes a ``GPTModel``'s forward with
``labels`` return orda_tp's ``[b, s]`` per-token losses (what Megatron's ``loss_func`` masks and
sums), computed from the hidden states GPTModel feeds its output layer and the weight it passes it,
without building the logits; without ``labels`` it returns its logits as before. Two instances change
class, nothing private of Megatron is overridden (docs/integrations.md, "Megatron-core": the one step,
how it works, the one Megatron behaviour relied on).
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch.distributed as dist
from torch import nn

from orda_tp import DistillationLoss
from orda_tp.arguments.options import check_loss_keywords

try:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import ColumnParallelLinear
except ImportError as error:  # an optional extra: say how to install it
    raise ImportError("orda_tp.integrations.megatron needs megatron-core: pip install 'orda_tp[megatron]'") from error

from .megatron_head import (
    IGNORE_INDEX,
    DistillationModel,
    DistillationSetup,
    HeadInputs,
    HeadInputsModel,
    HeadInputsOutputLayer,
    per_token_loss,
)

__all__ = [
    "DistillationModel",
    "DistillationSetup",
    "HeadInputs",
    "HeadInputsModel",
    "HeadInputsOutputLayer",
    "install_distillation_head",
    "per_token_loss",
]

# Keywords of orda_tp.distillation_loss that the adapter sets itself.
ADAPTER_KEYWORDS = (
    "reduction", "ignore_index", "tp_group", "vocab_range", "vocab_size", "sequence_parallel", "num_valid_tokens",
)  # fmt: skip
# Variants that train the teacher; a teacher GPTModel runs under torch.no_grad().
COTRAINING_VARIANTS = ("mutual", "cojeffreys")


def install_distillation_head(
    model: nn.Module, *, vocab_size: int, teacher: nn.Module | None = None, **loss_options: Any
) -> nn.Module:
    """Make ``model(..., labels=labels, loss_mask=loss_mask)`` return orda_tp's ``[b, s]`` losses
    (0 where ``loss_mask == 0``); returns ``model``, and installing again replaces the settings.

    ``model``: a ``GPTModel`` holding the output layer (the last pipeline stage), or a wrapper of
    one (``.module``). ``vocab_size``: the tokenizer's vocabulary; the padded columns get no
    probability. ``teacher``: a frozen teacher ``GPTModel`` with the same tensor-parallel group,
    padded vocabulary and sequence parallelism, run under ``torch.no_grad()`` on the student's
    inputs; without one, pass ``teacher_logits=`` to the forward (or use only the student CE).
    ``loss_options``: keywords of :func:`orda_tp.distillation_loss`; ``teacher_ce_weight`` defaults to 0.
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
    check_loss_keywords("install_distillation_head", loss_options)
    tp_size = dist.get_world_size(layer.tp_group)
    # Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by × tp: the columns past
    # vocab_size are padding, which the loss gives no probability.
    padded = layer.output_size_per_partition * tp_size
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 0 < vocab_size <= padded:
        raise ValueError(
            f"vocab_size must be the real vocabulary size, an int in [1, {padded}] (the model's padded vocabulary "
            f"{layer.output_size_per_partition} × tp {tp_size}), got {vocab_size!r}"
        )
    # Validated here, at installation; no group at tp = 1, so a single rank takes the one-device path.
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
    # A plain attribute, not a submodule: neither the loss nor the teacher joins the student's state.
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
    # One subclass per (mixin, class), as fully_shard makes them: the instance keeps its state, hooks and keys.
    if key not in _SUBCLASSES:
        name = mixin.__name__.removesuffix("Model").removesuffix("OutputLayer") + original.__name__
        _SUBCLASSES[key] = type(name, (mixin, original), {"__module__": __name__, "orda_original_class": original})
    module.__class__ = _SUBCLASSES[key]  # in place: parameters, buffers and hooks stay where they are
    assert isinstance(module, mixin)
    return module
