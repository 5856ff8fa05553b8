"""Multi-teacher mixing on a shared vocabulary, and the agreement diagnostic: teacher ``k`` gives logits
``x_k`` (..., V), ``q_k = softmax(x_k)``, and a weight ``w_k`` (docs/cross_vocab.md, "Mixing teachers")."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

from ._checks import check_choice, check_floating_tensor, check_real, check_same_shapes
from ._logmath import log_normalize

__all__ = ["MIX_MODES", "WEIGHT_SUM_TOLERANCE", "generalized_jensen_shannon", "mix_teacher_logits"]

MIX_MODES = ("arithmetic", "geometric")

# |Σ w_k − 1| allowed before the weights are rejected (they are then divided by their sum).
WEIGHT_SUM_TOLERANCE = 1e-6


def _check_logits_list(logits_list: object) -> list[torch.Tensor]:
    """A non-empty list or tuple of floating tensors of one shape, on one device."""
    if not isinstance(logits_list, (list, tuple)):
        raise TypeError(f"logits_list must be a list or tuple of tensors, got {type(logits_list).__name__}")
    if len(logits_list) == 0:
        raise ValueError("logits_list must hold at least one tensor, got an empty sequence")
    tensors = [check_floating_tensor(x, f"logits_list[{k}]") for k, x in enumerate(logits_list)]
    check_same_shapes(tensors, "logits_list")
    return tensors


def _check_weights(weights: object, count: int) -> list[float]:
    """``weights`` (``count`` finite reals ``>= 0``: a sequence or a 1-D tensor, summing to 1 within
    ``WEIGHT_SUM_TOLERANCE``) as floats divided by their sum, which then only removes rounding."""
    if isinstance(weights, torch.Tensor):
        if weights.dim() != 1:
            raise ValueError(f"weights must be 1-D, got shape {tuple(weights.shape)}")
        if weights.is_complex():
            raise TypeError(f"weights must be real, got dtype {weights.dtype}")
        # A few numbers, read on the host where they are checked and summed exactly (math.fsum).
        values: list[object] = [float(w) for w in weights.detach().cpu().tolist()]
    elif isinstance(weights, Sequence) and not isinstance(weights, (str, bytes)):
        values = list(weights)
    else:
        raise TypeError(f"weights must be a sequence of floats or a 1-D tensor, got {type(weights).__name__}")
    if len(values) != count:
        raise ValueError(f"weights must have one entry per tensor of logits_list ({count}), got {len(values)}")
    checked = [check_real(w, f"weights[{k}]") for k, w in enumerate(values)]
    total = math.fsum(checked)
    # Weights not (near-)normalized raise: in geometric mixing their scale is an inverse temperature, so
    # normalizing them silently would change the teacher.
    if abs(total - 1.0) > WEIGHT_SUM_TOLERANCE:
        raise ValueError(
            f"weights must sum to 1 (within {WEIGHT_SUM_TOLERANCE:g}), got sum {total!r} for {checked}; "
            "pass [w / sum(weights) for w in weights] to mix in those proportions"
        )
    return [w / total for w in checked]


def _weighted_log_probs(logits_list: list[torch.Tensor], weights: list[float]) -> Iterator[tuple[float, torch.Tensor]]:
    """``(w_k, log q_k)`` of each teacher with ``w_k > 0``, one at a time, in float32 (float64 if any input is)."""
    dtype = torch.float64 if any(x.dtype == torch.float64 for x in logits_list) else torch.float32
    for weight, logits in zip(weights, logits_list):
        if weight > 0:  # left out entirely: 0·log q_k = 0 even where q_k = 0, so its zeros veto nothing
            yield weight, log_normalize(logits.to(dtype))


def mix_teacher_logits(
    logits_list: Sequence[torch.Tensor], weights: Sequence[float] | torch.Tensor, mode: str = "arithmetic"
) -> torch.Tensor:
    """Teacher distributions ``q_k = softmax(x_k)`` mixed into logits of the inputs' shape: ``arithmetic``,
    ``log Σ_k w_k q_k`` (a log-probability vector), or ``geometric`` (product of experts), ``Σ_k w_k log q_k``
    as it is, not renormalized (its LSE is ``≤ 0``; a softmax renormalizes it to ``∝ Π_k q_k^{w_k}``).
    ``weights`` (one per tensor, finite, ``>= 0``) must sum to 1 within 1e-6, and are divided by their
    sum; a teacher with ``w_k = 0`` is left out entirely. A teacher row all ``-inf`` is the zero measure
    (no mass added, or every column vetoed); NaN or ``+inf`` in a row makes that output row NaN. Float32
    output (float64 if any input is), for ``PrecomputedTeacher(logits=mixed)`` (``logits_temperature=T``
    for tempered inputs)."""
    tensors = _check_logits_list(logits_list)
    normalized = _check_weights(weights, len(tensors))
    check_choice(mode, "mode", MIX_MODES)
    mixed: torch.Tensor | None = None
    for weight, log_probs in _weighted_log_probs(tensors, normalized):
        if mode == "arithmetic":
            # log(w_k q_k), merged in log space: no teacher's small probabilities underflow.
            term = log_probs + math.log(weight)
            mixed = term if mixed is None else torch.logaddexp(mixed, term)
        else:
            term = log_probs * weight
            mixed = term if mixed is None else mixed + term
    assert mixed is not None  # the weights sum to 1, so at least one is > 0
    return mixed


def generalized_jensen_shannon(
    logits_list: Sequence[torch.Tensor], weights: Sequence[float] | torch.Tensor
) -> torch.Tensor:
    """Per-row generalized Jensen–Shannon divergence ``Σ_k w_k KL(q_k ‖ m)``, ``m = Σ_k w_k q_k``, of
    the inputs' shape without the last dimension: 0 when the teachers with ``w_k > 0`` agree, at most
    ``H(w) ≤ log K``. Weights as in :func:`mix_teacher_logits`; differentiable."""
    tensors = _check_logits_list(logits_list)
    normalized = _check_weights(weights, len(tensors))
    log_mix = mix_teacher_logits(tensors, normalized, mode="arithmetic")
    divergence = torch.zeros_like(log_mix[..., 0])
    for weight, log_probs in _weighted_log_probs(tensors, normalized):
        # 0·log 0 = 0: where q_k = 0 the log-ratio is −inf or NaN (−inf − −inf), and 0 times it NaN.
        log_ratio = torch.where(log_probs == -math.inf, torch.zeros_like(log_probs), log_probs - log_mix)
        divergence = divergence + weight * (log_probs.exp() * log_ratio).sum(dim=-1)
    return divergence.clamp_min(0.0)  # ≥ 0 in exact arithmetic: rounding may leave a tiny negative
