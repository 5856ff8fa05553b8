"""A tiny pre-norm causal transformer in pure torch, returning final hidden states.

The vocabulary head is deliberately not part of the model: the loss takes ``hidden`` and the head
weight ``(V, H)`` separately, so that it never has to build the ``(BT, V)`` logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LMConfig:
    """Shape of a :class:`TinyLM`."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    max_seq: int
    mlp_ratio: int = 4


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        if hidden % heads != 0:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, H) -> (B, T, H); position t attends to positions <= t."""
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, hidden // self.heads).unbind(dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, hidden))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads)
        self.mlp_norm = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, mlp_ratio * hidden), nn.GELU(), nn.Linear(mlp_ratio * hidden, hidden)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, H) -> (B, T, H)."""
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    """Token + learned position embeddings, ``layers`` blocks, final LayerNorm; no head."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab, config.hidden)
        self.position_embedding = nn.Embedding(config.max_seq, config.hidden)
        self.blocks = nn.ModuleList(Block(config.hidden, config.heads, config.mlp_ratio) for _ in range(config.layers))
        self.final_norm = nn.LayerNorm(config.hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> final hidden states (B, T, H)."""
        seq = tokens.shape[1]
        if seq > self.config.max_seq:
            raise ValueError(f"sequence length {seq} exceeds max_seq={self.config.max_seq}")
        positions = torch.arange(seq, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.final_norm(x)
