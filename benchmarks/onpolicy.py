"""TRL 1.16's on-policy distillation loss as its ``DistillationTrainer`` calls it, for the benchmarks
(``benchmarks/trl_loss.py`` and the on-policy methods of ``benchmarks/train_step.py``).

``DistillationTrainer._compute_loss`` runs each model's backbone on prompt + completion and keeps the
hidden states that predict the K completion tokens (``_get_last_hidden_state``: the last position
dropped, the last K kept); it then calls ``_chunked_divergence_loss`` with both LM heads' weights and
biases, the loss mask (B, K), ``beta``, ``num_items_in_batch`` (``compute_loss``: the generation
batch's masked-in count, at least 1, over the processes) and each model's logit scale, final
soft-cap and the temperature. ``orda_tp.integrations.trl.chunked_divergence_loss`` takes the same
arguments, so either function goes through :func:`trainer_call`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import Tensor

from benchmarks.harness import IGNORE_INDEX

if TYPE_CHECKING:  # train_step imports this module: its types only for the annotations
    from transformers import LlamaForCausalLM

    from benchmarks.train_step import Context, HeadLoss, Inputs

#: ``_chunked_divergence_loss`` or orda_tp's adapter: ``(loss, entropy_sum, n_valid)``.
TrlLoss = Callable[..., tuple[Tensor, Tensor, Tensor]]
#: The on-policy step's β (TRL's generalized JSD; ``DistillationConfig(beta=0.5)``) and temperature.
ONPOLICY_BETA, ONPOLICY_TEMPERATURE = 0.5, 1.0
#: In the training step, the first 1/PROMPT_SHARE of each sequence is the prompt, the rest the completion.
PROMPT_SHARE = 4


def trainer_num_items(loss_mask: Tensor, processes: int = 1) -> Tensor:
    """``num_items_in_batch`` as ``compute_loss`` passes it in training: the loss mask's count over
    the generation batch (here one micro-batch), at least 1, divided by the number of processes."""
    return loss_mask.sum().clamp(min=1.0) / processes


def trainer_call(
    loss: TrlLoss,
    student_states: Tensor,
    teacher_states: Tensor,
    student_weight: Tensor,
    teacher_weight: Tensor,
    loss_mask: Tensor,
    beta: float,
    num_items_in_batch: Tensor,
    temperature: float = 1.0,
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``loss`` called as ``_compute_loss`` calls ``_chunked_divergence_loss``, for models whose
    configs set no logit scale and no final soft-cap (Llama's, Qwen's): scales 1.0, soft-caps None."""
    return loss(
        student_states,
        teacher_states,
        student_weight,
        teacher_weight,
        loss_mask,
        beta,
        num_items_in_batch=num_items_in_batch,
        student_lm_head_bias=student_bias,
        teacher_lm_head_bias=teacher_bias,
        student_logit_scale=1.0,
        teacher_logit_scale=1.0,
        student_final_logit_softcapping=None,
        teacher_final_logit_softcapping=None,
        temperature=temperature,
    )


def completion_states(states: Tensor, completion_length: int) -> Tensor:
    """``_get_last_hidden_state``: of the (B, T, H) states, those that predict the last
    ``completion_length`` tokens, (B, K, H)."""
    return states[:, :-1, :][:, -completion_length:, :]


def onpolicy_loss(loss: TrlLoss, student: LlamaForCausalLM, ctx: Context) -> HeadLoss:
    """The training step's head and loss of an on-policy method: ``loss`` on the student's and the
    frozen teacher's states at the completion positions (the last (PROMPT_SHARE − 1)/PROMPT_SHARE of
    the sequence), the loss mask the batch's labels there (1 in 7 ignored, as in the KD methods),
    β = ONPOLICY_BETA, T = ONPOLICY_TEMPERATURE, both models' LM heads as the trainer reads them."""
    completion_length = ctx.sizes.seq - ctx.sizes.seq // PROMPT_SHARE

    def head_loss(x: Inputs) -> Tensor:
        assert x.teacher_hidden is not None
        loss_mask = (x.labels[:, -completion_length:] != IGNORE_INDEX).long()
        student_head, teacher_head = student.lm_head, ctx.teacher.lm_head
        value, _, _ = trainer_call(
            loss,
            completion_states(x.hidden, completion_length),
            completion_states(x.teacher_hidden, completion_length),
            student_head.weight,
            teacher_head.weight,
            loss_mask,
            ONPOLICY_BETA,
            trainer_num_items(loss_mask),
            temperature=ONPOLICY_TEMPERATURE,
            student_bias=student_head.bias,
            teacher_bias=teacher_head.bias,
        )
        return value

    return head_loss
