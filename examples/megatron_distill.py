"""Distill a tiny Megatron-core GPTModel from another through orda_tp's output layer.

    torchrun --standalone --nproc-per-node 2 examples/megatron_distill.py

Tensor parallel over 2 ranks, CPU and gloo, about 16 s on 2 CPU cores (imports included). Needs
megatron-core (from the clone: ``pip install -e '.[megatron]'``; tested with 0.16.1):

1. a teacher GPTModel learns a synthetic language for a few steps with Megatron's own loss
   (``model(..., labels=...)`` → ``[b, s]`` cross entropy, ``loss_func`` as in pretrain_gpt.py);
2. check: a student with the head installed at ``kl_weight=0`` returns the per-token losses of
   Megatron's ``vocab_parallel_cross_entropy``;
3. the student is distilled from the frozen teacher: ``model_provider`` installs the head (the one
   step), ``forward_step`` and ``loss_func`` are Megatron's usual ones, no logits are built.

The vocabulary has 250 tokens, padded by Megatron's rule to 256 = 2 × 128 rows: rank 1's last 6
rows are padding, which ``vocab_size=250`` keeps out of every softmax.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

try:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer import TransformerConfig
except ImportError as error:  # an optional extra of orda_tp: say how to install it
    raise ImportError("examples/megatron_distill.py needs megatron-core: pip install 'orda_tp[megatron]'") from error

from orda_tp.integrations.megatron import install_distillation_head

TP = 2
VOCAB_SIZE = 250  # the tokenizer's
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128
PADDED_VOCAB_SIZE = math.ceil(VOCAB_SIZE / (MAKE_VOCAB_SIZE_DIVISIBLE_BY * TP)) * MAKE_VOCAB_SIZE_DIVISIBLE_BY * TP
BATCH, SEQ, PROMPT = 8, 32, 4  # the first PROMPT positions of each sequence get no loss
TEACHER_STEPS, STUDENT_STEPS, LOG_EVERY = 40, 40, 10


def use_megatron_on_cpu() -> None:
    """CPU only (not needed on GPUs): megatron-core 0.16.1's attention forks CUDA RNG states (the
    inference tracker forks nothing; dropout is 0 here) and allocates buffers on
    ``torch.cuda.current_device()``."""
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment, return-value]


def build_gpt(hidden_size: int, num_layers: int, seed: int) -> GPTModel:
    torch.manual_seed(seed)  # the same on every rank: CPU initialization splits one full weight
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=4,
        tensor_model_parallel_size=TP,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=PADDED_VOCAB_SIZE,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=True,
    )


def model_provider(teacher: GPTModel, pre_process: bool = True, post_process: bool = True) -> GPTModel:
    """The student, as Megatron's ``model_provider`` builds it, plus the one step."""
    model = build_gpt(hidden_size=32, num_layers=2, seed=2)
    if post_process:  # the stage that holds the output layer
        install_distillation_head(
            model, vocab_size=VOCAB_SIZE, teacher=teacher, student_ce_weight=0.5, kl_weight=1.0, kl_temperature=2.0
        )
    return model


@dataclass(frozen=True)
class Batch:
    tokens: Tensor
    position_ids: Tensor
    attention_mask: Tensor
    labels: Tensor
    loss_mask: Tensor


def synthetic_language() -> Tensor:
    """A bigram table: each token is followed by one of 3 tokens, with probabilities 0.6, 0.3, 0.1."""
    generator = torch.Generator().manual_seed(0)
    successors = torch.randint(0, VOCAB_SIZE, (VOCAB_SIZE, 3), generator=generator)
    table = torch.zeros(VOCAB_SIZE, VOCAB_SIZE)
    return table.scatter_add_(1, successors, torch.tensor([0.6, 0.3, 0.1]).expand(VOCAB_SIZE, 3))


def get_batch(step: int, language: Tensor) -> Batch:
    """Identical on every tensor-parallel rank (Megatron broadcasts the batch over the TP group)."""
    generator = torch.Generator().manual_seed(1000 + step)
    text = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
    text[:, 0] = torch.randint(0, VOCAB_SIZE, (BATCH,), generator=generator)
    for i in range(SEQ):
        text[:, i + 1] = torch.multinomial(language[text[:, i]], 1, generator=generator).squeeze(1)
    loss_mask = torch.ones(BATCH, SEQ)
    loss_mask[:, :PROMPT] = 0
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril().logical_not()[None, None]
    return Batch(text[:, :-1], torch.arange(SEQ).expand(BATCH, SEQ), causal, text[:, 1:], loss_mask)


def loss_func(loss_mask: Tensor, output_tensor: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Megatron's: per-token losses × loss_mask, summed, with the token count."""
    losses = output_tensor.float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses.view(-1) * loss_mask)
    num_tokens = loss_mask.sum()
    return loss, num_tokens, {"lm loss": loss.detach() / num_tokens}


def forward_step(batch: Batch, model: GPTModel) -> tuple[Tensor, partial]:
    """Megatron's, unchanged: [b, s] losses from the model, ``loss_func`` reduces them."""
    output_tensor = model(
        batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels, loss_mask=batch.loss_mask
    )
    return output_tensor, partial(loss_func, batch.loss_mask)


def train_step(model: GPTModel, optimizer: torch.optim.Optimizer, batch: Batch) -> float:
    optimizer.zero_grad()
    output_tensor, reduce = forward_step(batch, model)
    loss, num_tokens, report = reduce(output_tensor)
    (loss / num_tokens).backward()
    optimizer.step()
    return report["lm loss"].item()


def masked_mean(values: Tensor, loss_mask: Tensor) -> float:
    return ((values * loss_mask).sum() / loss_mask.sum()).item()


def check_cross_entropy(language: Tensor) -> float:
    """Max relative difference between Megatron's [b, s] cross entropy and the installed head's
    at kl_weight=0 (the default), on the positions that count."""
    model = build_gpt(hidden_size=32, num_layers=2, seed=3)
    batch = get_batch(-1, language)
    with torch.no_grad():
        expected, _ = forward_step(batch, model)
        install_distillation_head(model, vocab_size=PADDED_VOCAB_SIZE)  # no padding in Megatron's own CE
        losses, _ = forward_step(batch, model)
    valid = batch.loss_mask.bool()
    return ((losses - expected).abs() / expected.abs())[valid].max().item()


def main() -> None:
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    use_megatron_on_cpu()
    rank = dist.get_rank()
    log = print if rank == 0 else (lambda *_: None)
    language = synthetic_language()

    teacher = build_gpt(hidden_size=64, num_layers=2, seed=1)
    optimizer = torch.optim.Adam(teacher.parameters(), lr=1e-2)
    for step in range(TEACHER_STEPS):
        lm_loss = train_step(teacher, optimizer, get_batch(step, language))
        if step % LOG_EVERY == 0 or step == TEACHER_STEPS - 1:
            log(f"teacher step {step} | lm loss {lm_loss:.4f}")
    teacher.eval()

    error = check_cross_entropy(language)
    log(f"check {'PASS' if error <= 1e-5 else 'FAIL'}: kl_weight=0 losses equal Megatron's cross entropy "
        f"(max relative difference {error:.2e})")  # fmt: skip

    student = model_provider(teacher)
    optimizer = torch.optim.Adam(student.parameters(), lr=1e-2)
    for step in range(STUDENT_STEPS):
        batch = get_batch(TEACHER_STEPS + step, language)
        loss = train_step(student, optimizer, batch)
        if step % LOG_EVERY == 0 or step == STUDENT_STEPS - 1:
            with torch.no_grad():  # the components, for the log
                out = student(
                    batch.tokens, batch.position_ids, batch.attention_mask,
                    labels=batch.labels, loss_mask=batch.loss_mask, return_components=True,
                )  # fmt: skip
            kl, student_ce = masked_mean(out.kl, batch.loss_mask), masked_mean(out.student_ce, batch.loss_mask)
            log(f"student step {step} | loss {loss:.4f} | kl {kl:.4f} | student ce {student_ce:.4f}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without interpreter shutdown: gloo's worker threads release a finished collective's tensors
    # only after wait() has returned, and a release during shutdown aborts the process ("terminate
    # called without an active exception"; docs/integrations.md §10).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
