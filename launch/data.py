"""A small synthetic language: a sparse first-order Markov chain over a fixed vocabulary.

Every token has ``branching`` possible successors with log-normal random probabilities, all fixed by
one seed. The chain has real structure (its entropy rate is far below ``log(vocab)``), so a language
model's cross-entropy falls steadily while it learns, and the conditional entropy of the observed
transitions is a floor no model can beat.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MarkovLanguage:
    """Transition table of the language: ``successors[a, k]`` follows ``a`` with ``probs[a, k]``."""

    successors: torch.Tensor  # (V, K) long
    probs: torch.Tensor  # (V, K) float, rows sum to 1
    entropy: torch.Tensor  # (V,) next-token entropy of each state, in nats

    @property
    def vocab(self) -> int:
        """Number of token ids."""
        return self.successors.shape[0]


def make_language(vocab: int, seed: int, branching: int = 8, spread: float = 1.5) -> MarkovLanguage:
    """Draw the transition table of a ``vocab``-token chain from ``seed``.

    The successors of each token are ``branching`` distinct ids (random strictly increasing offsets
    from the token, modulo ``vocab``); their probabilities are log-normal with log-scale ``spread``,
    normalized, so most states have a few dominant continuations.
    """
    if not 1 <= branching <= vocab:
        raise ValueError(f"branching must be in [1, vocab={vocab}], got {branching}")
    generator = torch.Generator().manual_seed(seed)
    gaps = torch.randint(1, vocab // branching + 1, (vocab, branching), generator=generator)
    successors = (torch.arange(vocab).unsqueeze(1) + gaps.cumsum(dim=1)) % vocab
    logits = spread * torch.randn(vocab, branching, generator=generator, dtype=torch.float64)
    probs = logits.softmax(dim=1)
    entropy = -(probs * logits.log_softmax(dim=1)).sum(dim=1)
    return MarkovLanguage(successors=successors, probs=probs, entropy=entropy)


@dataclass(frozen=True)
class Batch:
    """One batch of sequences: model ``inputs`` (B, T), next-token ``labels`` (B, T), and ``floor``:
    the mean true next-token entropy at the labelled positions (the best achievable mean CE, nats)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    floor: float


def sample_batch(language: MarkovLanguage, batch: int, seq: int, seed: int) -> Batch:
    """Sample ``batch`` sequences of ``seq + 1`` tokens, deterministically from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, language.vocab, (batch,), generator=generator)
    for position in range(seq):
        state = tokens[:, position]
        choice = torch.multinomial(language.probs[state], 1, generator=generator).squeeze(1)
        tokens[:, position + 1] = language.successors[state, choice]
    floor = language.entropy[tokens[:, :-1]].mean().item()
    return Batch(inputs=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(), floor=floor)
