"""TRL adapter: :func:`chunked_divergence_loss` is TRL 1.16's ``DistillationTrainer`` loss
(``trl.trainer.distillation_trainer._chunked_divergence_loss``: the generalized JSD(β) between the
student's and the teacher's next-token distributions over the completion tokens) computed by
:func:`orda_tp.distillation_loss`: the same arguments, the same ``(loss, entropy_sum, n_valid)``.
:class:`OrdaDistillationTrainer` is ``DistillationTrainer`` with that loss; :func:`orda_divergence_loss`
swaps it into any ``DistillationTrainer`` (subclasses included) for a block (docs/integrations.md, "TRL").
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from orda_tp.loss import distillation_loss
from orda_tp.teachers import SeparateTeacher

from .fsdp_rows import local_heads, rows_gathered_loss, sharded_heads

# OrdaDistillationTrainer is public too, built by __getattr__ on first use.
__all__ = ["chunked_divergence_loss", "orda_divergence_loss"]

# TRL's loss function, looked up in its trainer's module at each call (the swap point).
TRL_LOSS_NAME = "_chunked_divergence_loss"
TESTED_TRL = "1.16.0"
IGNORE_INDEX = -100


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast gives matmuls on ``device`` inside the caller's autocast region, or None."""
    if not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


def _denominator(n_valid: Tensor, num_items_in_batch: Tensor | int | None, device: torch.device) -> Tensor | int:
    """TRL's: the mask's count (at least 1) when the trainer gives no count, else its count."""
    if num_items_in_batch is None:
        return n_valid.clamp(min=1)
    if isinstance(num_items_in_batch, Tensor):
        return num_items_in_batch.to(device)
    return num_items_in_batch


def chunked_divergence_loss(
    student_hidden_states: Tensor,
    teacher_hidden_states: Tensor,
    student_lm_head_weight: Tensor,
    teacher_lm_head_weight: Tensor,
    completion_mask: Tensor,
    beta: float,
    num_items_in_batch: Tensor | int | None = None,
    student_lm_head_bias: Tensor | None = None,
    teacher_lm_head_bias: Tensor | None = None,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_final_logit_softcapping: float | None = None,
    teacher_final_logit_softcapping: float | None = None,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """TRL 1.16's ``_chunked_divergence_loss``, argument for argument, by orda_tp's fused loss.

    ``student_hidden_states`` (B, K, H_s) and ``teacher_hidden_states`` (B, K, H_t): the states that
    feed each LM head at the K completion positions; the heads' weights (V, H_s), (V, H_t) and
    biases (V,) or None; ``completion_mask`` (B, K), nonzero where a position is in the loss. Each
    side's logits are ``cap(scale·(h·Wᵀ + b))/temperature`` (``cap`` the final soft-cap, if any);
    ``beta`` picks the divergence: 0 is KL(teacher‖student), 1 is KL(student‖teacher), in between
    ``β·KL(q‖m) + (1−β)·KL(p‖m)`` with ``m = β·q + (1−β)·p`` (no temperature² factor).

    Returns ``(loss, entropy_sum, n_valid)``: the divergence summed over the masked-in positions and
    divided by ``num_items_in_batch`` (by ``n_valid``, at least 1, when None); the student's entropy
    at ``temperature`` summed over those positions (detached); their count (int64, 0-d). Gradients
    reach the student's hidden states, head weight and bias; the teacher's tensors get none.

    Heads given as DTensors sharded on the vocabulary are used shard by shard (no gather). A head
    that FSDP2 holds sharded over data parallelism (its own ``fully_shard`` unit, read in the
    student's forward) is too: the ranks' rows are gathered instead, each rank's loss stays its own
    batch's, and the shard's gradient is FSDP2's mean over the ranks (:mod:`.fsdp_rows`). Under
    autocast the GEMMs run in autocast's dtype, as TRL's do.
    """
    valid = completion_mask.reshape(-1) != 0
    n_valid = valid.sum()
    student = student_hidden_states.reshape(-1, student_hidden_states.shape[-1])
    teacher = teacher_hidden_states.reshape(-1, teacher_hidden_states.shape[-1])
    if not isinstance(student_lm_head_weight, DTensor):
        # As TRL does on a GPU (here on every device, so that the CPU tests run it): the masked-out
        # positions are dropped before the GEMMs (one host sync);
        # a batch with none masked, or all, is used as it is (no copy; no empty call).
        rows = valid.nonzero().squeeze(1)
        if 0 < rows.numel() < valid.numel():
            student, teacher, valid = student.index_select(0, rows), teacher.index_select(0, rows), valid[rows]
    # Every position gets a label: the student CE, the one term that reads it, has weight 0.
    labels = torch.where(valid, 0, IGNORE_INDEX)
    compute_dtype = _autocast_dtype(student.device)
    if compute_dtype is not None:  # TRL's GEMMs run in autocast's dtype; orda_tp's in its inputs'
        student, teacher = student.to(compute_dtype), teacher.to(compute_dtype)
    keywords = _divergence_keywords(
        beta, temperature, (student_logit_scale, teacher_logit_scale),
        (student_final_logit_softcapping, teacher_final_logit_softcapping),
    )  # fmt: skip
    denominator = _denominator(n_valid, num_items_in_batch, student.device)
    # Before any cast: FSDP2's sharded parameters are recognized as themselves.
    heads = sharded_heads(student_lm_head_weight, teacher_lm_head_weight)
    if heads is not None:  # a head sharded over data parallelism: each rank reads its rows, of every rank's batch
        local = local_heads(
            heads, student_lm_head_weight, student_lm_head_bias, teacher_lm_head_weight, teacher_lm_head_bias
        ).with_weights_in(compute_dtype)
        output = rows_gathered_loss(student, labels, teacher, heads, local, denominator, **keywords)
        return output.loss, output.student_entropy, n_valid
    student_weight, teacher_weight = student_lm_head_weight, teacher_lm_head_weight
    if compute_dtype is not None:
        student_weight, teacher_weight = student_weight.to(compute_dtype), teacher_weight.to(compute_dtype)
    output = distillation_loss(
        student,
        student_weight,
        labels,
        SeparateTeacher(teacher, teacher_weight, bias=teacher_lm_head_bias),
        bias=student_lm_head_bias,
        reduction="sum",
        **keywords,
    )
    return output.loss / denominator, output.student_entropy, n_valid


def _divergence_keywords(
    beta: float, temperature: float, scales: tuple[float, float], caps: tuple[float | None, float | None]
) -> dict[str, Any]:
    """:func:`orda_tp.distillation_loss`'s keywords for TRL's divergence (all but the reduction):
    JSD(β) at ``temperature`` between the student's and the teacher's logits, each side scaled by
    its ``scales`` entry and soft-capped by its ``caps`` entry, and the student's entropy."""
    return {
        "student_ce_weight": 0.0,
        "teacher_ce_weight": 0.0,
        # orda_tp's KL term is T²·D; TRL's loss is D.
        "kl_weight": 1.0 / temperature**2,
        "kl_temperature": temperature,
        "kl_divergence": "generalized_jsd",
        "kl_beta": beta,
        "logit_scale": scales[0],
        "teacher_logit_scale": scales[1],
        "logit_softcap": caps[0],
        "teacher_logit_softcap": caps[1],
        "student_entropy": True,
    }


def _trl_module() -> ModuleType:
    """TRL's trainer module, checked to call a loss with :func:`chunked_divergence_loss`'s arguments
    (imported here: the loss itself needs no TRL)."""
    try:
        import trl
        import trl.trainer.distillation_trainer as trl_distillation
    except ImportError as error:  # an optional extra: say how to install it
        raise ImportError(
            "the TRL trainer of orda_tp.integrations.trl needs trl: pip install 'orda_tp[trl]'"
        ) from error
    original = getattr(trl_distillation, TRL_LOSS_NAME, None)
    ours = list(inspect.signature(chunked_divergence_loss).parameters)
    if original is None or list(inspect.signature(original).parameters) != ours:
        raise RuntimeError(
            f"trl {trl.__version__}'s DistillationTrainer does not compute its loss with "
            f"{TRL_LOSS_NAME}({', '.join(ours)}), the function orda_tp.integrations.trl stands in for "
            f"(tested with trl=={TESTED_TRL}); install that version"
        )
    return trl_distillation


@contextmanager
def orda_divergence_loss() -> Iterator[None]:
    """Inside the block, every TRL ``DistillationTrainer`` computes its loss with
    :func:`chunked_divergence_loss` (TRL's function is put back after it, whatever happens)."""
    module = _trl_module()
    saved = getattr(module, TRL_LOSS_NAME)
    setattr(module, TRL_LOSS_NAME, chunked_divergence_loss)
    try:
        yield
    finally:
        setattr(module, TRL_LOSS_NAME, saved)


@functools.cache
def _trainer_class() -> type:
    base = _trl_module().DistillationTrainer

    class OrdaDistillationTrainer(base):  # type: ignore[misc, valid-type]  # a base known at run time
        """TRL's ``DistillationTrainer`` whose loss is :func:`chunked_divergence_loss`: a drop-in
        replacement (same arguments, same logs), everything else TRL's own."""

        def _compute_loss(self, unwrapped_student: Any, inputs: Any, num_items_in_batch: Any) -> Any:
            with orda_divergence_loss():
                return super()._compute_loss(unwrapped_student, inputs, num_items_in_batch)

    OrdaDistillationTrainer.__module__ = __name__
    return OrdaDistillationTrainer


def __getattr__(name: str) -> Any:
    # OrdaDistillationTrainer subclasses TRL's trainer: built on first use, so the loss needs no TRL.
    if name == "OrdaDistillationTrainer":
        return _trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
