"""Token-map projection: a teacher's distribution carried onto the student's vocabulary through exact
token matches (:func:`build_exact_token_map`, :func:`project_teacher_logits`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from ._checks import check_choice, check_floating_tensor, check_positive_int, check_real
from ._logmath import log_normalize

__all__ = ["UNMATCHED_MODES", "build_exact_token_map", "project_teacher_logits"]

UNMATCHED_MODES = ("renormalize", "mask")

# Elements of one (rows × vocab) buffer of the row-chunked projection: 64 MiB of fp32.
_WORKSPACE_ELEMENTS = 1 << 24

Vocab = Sequence[str] | Mapping[str, int]


def _tokens_by_id(vocab: object, name: str) -> list[str | None]:
    """The token string of every id ``0 … V−1`` (a mapping's: ``V = max id + 1``, None for an id left out)."""
    if isinstance(vocab, Mapping):
        tokens: list[str | None] = [None] * (_max_id(vocab, name) + 1)
        for token, index in vocab.items():
            if not isinstance(token, str):
                raise TypeError(f"{name} keys must be str, got {type(token).__name__} ({token!r})")
            if tokens[index] is not None:
                raise ValueError(
                    f"{name} must give every id to one token, got id {index} for {tokens[index]!r} and {token!r}"
                )
            tokens[index] = token
        return tokens
    if isinstance(vocab, (str, bytes)) or not isinstance(vocab, Sequence):
        raise TypeError(f"{name} must be a sequence of str or a mapping str -> id, got {type(vocab).__name__}")
    if len(vocab) == 0:
        raise ValueError(f"{name} must be non-empty, got an empty sequence")
    for index, token in enumerate(vocab):
        if not isinstance(token, str):
            raise TypeError(f"{name}[{index}] must be a str, got {type(token).__name__} ({token!r})")
    return list(vocab)


def _max_id(vocab: Mapping[object, object], name: str) -> int:
    """The largest id of a non-empty mapping whose ids are all ints ``>= 0``."""
    if len(vocab) == 0:
        raise ValueError(f"{name} must be non-empty, got an empty mapping")
    largest = 0
    for token, index in vocab.items():
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise ValueError(f"{name} ids must be ints >= 0, got {index!r} for token {token!r}")
        largest = max(largest, index)
    return largest


def build_exact_token_map(student_vocab: Vocab, teacher_vocab: Vocab) -> torch.Tensor:
    """Every teacher id mapped to the student id of the identical token string, or ``-1``: int64 ``(V_t,)``.
    A vocabulary is a sequence of token strings (id = position) or a mapping ``str -> id``
    (``tokenizer.get_vocab()``: ``V = max id + 1``, ids it leaves out map to ``-1``). Strings match
    exactly, without normalization (``"Ġthe"`` and ``"▁the"`` differ). Several teacher ids may map to
    one student id (their probabilities add up in :func:`project_teacher_logits`); a student string
    at two ids raises. For teacher logits wider than ``V_t`` (a padded head), append ``-1`` entries."""
    student_index: dict[str, int] = {}
    for index, token in enumerate(_tokens_by_id(student_vocab, "student_vocab")):
        if token is None:
            continue
        if token in student_index:
            raise ValueError(
                f"student_vocab must hold each token string once, got {token!r} at ids "
                f"{student_index[token]} and {index}"
            )
        student_index[token] = index
    teacher_tokens = _tokens_by_id(teacher_vocab, "teacher_vocab")
    mapped = [-1 if token is None else student_index.get(token, -1) for token in teacher_tokens]
    return torch.tensor(mapped, dtype=torch.long)


def _check_token_map(
    token_map: object, teacher_vocab_size: int, student_vocab_size: int, device: torch.device
) -> torch.Tensor:
    """``token_map`` as an int64 tensor on ``device``, after checking its shape and entries."""
    if not isinstance(token_map, torch.Tensor):
        raise TypeError(f"token_map must be a torch.Tensor, got {type(token_map).__name__}")
    if token_map.is_floating_point() or token_map.is_complex() or token_map.dtype == torch.bool:
        raise TypeError(f"token_map must be an integer tensor, got dtype {token_map.dtype}")
    if token_map.shape != (teacher_vocab_size,):
        raise ValueError(
            f"token_map must have shape ({teacher_vocab_size},) (the last dimension of "
            f"teacher_logits), got {tuple(token_map.shape)}"
        )
    token_map = token_map.to(device=device, dtype=torch.long)
    # Two numbers read on the host: the map is checked once per call, before any row is projected.
    low, high = int(token_map.min()), int(token_map.max())
    if low < -1 or high >= student_vocab_size:
        raise ValueError(
            f"token_map entries must lie in [-1, {student_vocab_size}) (student_vocab_size="
            f"{student_vocab_size}), got values in [{low}, {high}]"
        )
    if high < 0:
        raise ValueError("token_map must match at least one teacher column to a student column, got only -1")
    return token_map


def _teacher_log_probs(tempered: torch.Tensor, matched: torch.Tensor, unmatched: str) -> torch.Tensor:
    """``log q`` on the matched teacher columns, shape ``(rows, M)``: normalized over the matched
    columns (``renormalize``) or over all, the unmatched mass lost (``mask``)."""
    if unmatched == "renormalize":
        return log_normalize(tempered.index_select(-1, matched))
    return log_normalize(tempered).index_select(-1, matched)


def _scatter_logsumexp(log_probs: torch.Tensor, targets: torch.Tensor, size: int) -> torch.Tensor:
    """``out[r, s] = log Σ_{j: targets[j] = s} exp(log_probs[r, j])``, ``-inf`` where no ``j`` maps; a
    target reached by one column gets that column's value exactly."""
    rows = log_probs.shape[0]
    # Merged around each target's maximum, so no mass underflows: the column that is the peak adds e⁰ = 1.
    peak = log_probs.new_full((rows, size), -math.inf).scatter_reduce(
        1, targets.expand(rows, -1), log_probs, reduce="amax", include_self=True
    )
    # A target without mass keeps −inf (log 0), not NaN; detached: the shift cancels, no gradient need pass the max.
    shift = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak)).detach()
    mass = log_probs.new_zeros((rows, size)).index_add(1, targets, torch.exp(log_probs - shift[:, targets]))
    return torch.log(mass) + shift


def project_teacher_logits(
    teacher_logits: torch.Tensor,
    token_map: torch.Tensor,
    student_vocab_size: int,
    *,
    unmatched: str = "renormalize",
    temperature: float = 1.0,
) -> torch.Tensor:
    """Teacher logits ``(..., V_t)`` projected onto the student vocabulary, ``(..., student_vocab_size)``
    log-probabilities. With ``v = teacher_logits / temperature`` and ``M`` the matched teacher columns
    (``token_map[j] >= 0``)::

        renormalize: log q_j = v_j − LSE_{i ∈ M} v_i        (q sums to 1 over M)
        mask:        log q_j = v_j − LSE_{all i} v_i         (the unmatched columns' mass dropped)
        out[s]       = log Σ_{j ∈ M: token_map[j] = s} q_j  (−inf where no teacher column maps)

    The temperature is applied before the merge: declare the result as ``PrecomputedTeacher(logits=out,
    logits_temperature=temperature)``. A row holding NaN or ``+inf`` comes out all NaN; one without mass
    on the columns its normalization uses, all ``-inf``. ``token_map`` may be on any device. Float32
    output (float64 for float64 input), in row chunks."""
    teacher_logits = check_floating_tensor(teacher_logits, "teacher_logits")
    student_vocab_size = check_positive_int(student_vocab_size, "student_vocab_size")
    check_choice(unmatched, "unmatched", UNMATCHED_MODES)
    temperature = check_real(temperature, "temperature", positive=True)
    teacher_vocab_size = teacher_logits.shape[-1]
    token_map = _check_token_map(token_map, teacher_vocab_size, student_vocab_size, teacher_logits.device)

    # The matched teacher columns, and the student column each one feeds.
    matched = torch.nonzero(token_map >= 0).squeeze(1)
    targets = token_map.index_select(0, matched)
    dtype = torch.float64 if teacher_logits.dtype == torch.float64 else torch.float32
    rows = teacher_logits.reshape(-1, teacher_vocab_size)
    step = max(1, _WORKSPACE_ELEMENTS // max(teacher_vocab_size, student_vocab_size))  # rows per chunk
    projected = rows.new_empty((rows.shape[0], student_vocab_size), dtype=dtype)
    for start in range(0, rows.shape[0], step):
        # Tempered before the merge: the tempering of merged duplicates would be another distribution.
        tempered = rows[start : start + step].to(dtype) / temperature
        log_probs = _teacher_log_probs(tempered, matched, unmatched)
        # NaN or +inf in any column, matched or not, makes the whole row NaN rather than a silently wrong value.
        invalid = (torch.isnan(tempered) | (tempered == math.inf)).any(dim=-1, keepdim=True)
        merged = _scatter_logsumexp(log_probs, targets, student_vocab_size)
        projected[start : start + step] = merged.masked_fill(invalid, math.nan)
    return projected.reshape(*teacher_logits.shape[:-1], student_vocab_size)
