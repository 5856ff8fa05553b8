"""The tiny Hugging Face Llama models of ``offline_topk_distill.py`` and ``mixture_distill.py``: built from a
config (seeded, nothing is downloaded), their final hidden states (what the LM head reads), and a brief
pre-training with plain cross-entropy on the synthetic Markov language of ``launch/data.py``.

Needs transformers (tested with 5.24.0): each example that imports this module says so first, and puts the
repository root (which holds ``launch``) on ``sys.path`` before.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM

from launch.data import MarkovLanguage, sample_batch

PRETRAIN_BATCH = 16  # sequences per pre-training step
PRETRAIN_LR = 1e-2  # AdamW (its default weight decay): high, for the few dozen steps the examples take


def tiny_llama(vocab: int, hidden: int, layers: int, max_seq: int, seed: int, device: torch.device) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` from a config (nothing downloaded), randomly initialized from ``seed``, with its
    own LM head (untied, so that the head can be split along the vocabulary alone)."""
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_seq,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(device)


def final_hidden(model: LlamaForCausalLM, inputs: Tensor) -> Tensor:
    """What the model's ``lm_head`` reads: the decoder output after its final norm, ``(batch, seq, hidden)``."""
    return model.model(input_ids=inputs, use_cache=False).last_hidden_state


class Pretrained(NamedTuple):
    """The last pre-training step's CE and the entropy floor of its batch (the best CE reachable), in nats."""

    ce: float
    floor: float


def pretrain(
    model: LlamaForCausalLM, language: MarkovLanguage, steps: int, seq: int, seed: int, device: torch.device
) -> Pretrained | None:
    """``steps`` AdamW steps of plain next-token CE on fresh text of ``language``, step ``i``'s batch drawn
    from seed ``seed + i`` (the same on every rank: the model stays replicated), then freeze the model
    (``requires_grad_(False)``, eval mode). Returns the last step's :class:`Pretrained`, None for 0 steps."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=PRETRAIN_LR)
    last = None
    for step in range(steps):
        batch = sample_batch(language, PRETRAIN_BATCH, seq, seed=seed + step)
        logits = model(input_ids=batch.inputs.to(device), use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.to(device).flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        last = Pretrained(loss.item(), batch.floor)
    model.requires_grad_(False).eval()
    return last
