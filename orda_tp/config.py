"""Execution settings: chunking, profiles and the entropy gate.

None of these change what is computed, only how (workspace size, checks); the
one exception is :class:`EntropyGate`, the parameters of ``entropy_adaptive``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

__all__ = ["ChunkSize", "EntropyGate", "KernelConfig", "PROFILES", "resolve_config"]


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _require_flags(owner: object, *names: str) -> None:
    """Flags must be real bools: a truthy string such as "no" must not read as True."""
    for name in names:
        value = getattr(owner, name)
        if not isinstance(value, bool):
            raise TypeError(f"{type(owner).__name__}.{name} must be a bool, got {value!r}")


@dataclass(frozen=True)
class ChunkSize:
    """How many rows (tokens) one chunk of the loss processes at a time.

    - ``nrows``: a fixed row count per chunk (``None``: derived from the workspace budget).
    - ``dynamic``: when True, ``nrows`` is an upper bound that is lowered so that one chunk's
      workspace, ``rows × local_vocab`` fp32 values per live buffer, fits
      ``KernelConfig.workspace_mib``; when False a given ``nrows`` is used as is.
    - ``fast``: trade memory for speed: four times the workspace budget.
    """

    nrows: int | None = None
    dynamic: bool = True
    fast: bool = False

    def __post_init__(self) -> None:
        _require_flags(self, "dynamic", "fast")
        if self.nrows is not None:
            _require(
                isinstance(self.nrows, int) and not isinstance(self.nrows, bool) and self.nrows > 0,
                f"ChunkSize.nrows must be a positive int or None, got {self.nrows!r}",
            )


@dataclass(frozen=True)
class KernelConfig:
    """Execution knobs of the chunked backends.

    - ``chunk_size``: rows per chunk (see :class:`ChunkSize`).
    - ``vocab_block``: columns per statistics block inside a chunk; the records of the blocks are
      merged exactly as the records of tensor-parallel shards are.
    - ``workspace_mib``: size of one (rows × local vocab) fp32 buffer, in MiB; it sets the rows per
      chunk. A chunk keeps a few such buffers alive (student and teacher logits, per-block
      temporaries), so the loss's workspace is a small multiple of it (measured: 5–10×).
    - ``assume_valid_labels``: skip the host-synchronizing range check of ``labels``. A label
      outside ``[0, V)`` then gives a NaN row (never another class).
    - ``check_finite_inputs``: raise if a hidden state or weight holds NaN/inf instead of letting
      the affected rows come out NaN (the ``debug`` profile turns it on).
    """

    chunk_size: ChunkSize = field(default_factory=ChunkSize)
    vocab_block: int = 8192
    workspace_mib: int = 64
    assume_valid_labels: bool = False
    check_finite_inputs: bool = False

    def __post_init__(self) -> None:
        _require(
            isinstance(self.chunk_size, ChunkSize),
            f"KernelConfig.chunk_size must be a ChunkSize, got {type(self.chunk_size).__name__}",
        )
        _require_flags(self, "assume_valid_labels", "check_finite_inputs")
        for name in ("vocab_block", "workspace_mib"):
            value = getattr(self, name)
            _require(
                isinstance(value, int) and not isinstance(value, bool) and value > 0,
                f"KernelConfig.{name} must be a positive int, got {value!r}",
            )

    def rows_per_chunk(self, total_rows: int, local_vocab: int) -> int:
        """Rows of one chunk for a call with ``total_rows`` rows over ``local_vocab`` columns."""
        budget_values = self.workspace_mib * (1 << 20) // 4 * (4 if self.chunk_size.fast else 1)
        from_budget = max(1, budget_values // max(local_vocab, 1))
        requested = self.chunk_size.nrows
        if requested is None:
            rows = from_budget
        elif self.chunk_size.dynamic:
            rows = min(requested, from_budget)
        else:
            rows = requested
        return max(1, min(rows, max(total_rows, 1)))


PROFILES: dict[str, KernelConfig] = {
    "balanced": KernelConfig(),
    "fast": KernelConfig(chunk_size=ChunkSize(fast=True), vocab_block=32768),
    "debug": KernelConfig(workspace_mib=4, vocab_block=1024, check_finite_inputs=True),
}


def resolve_config(profile: str, config: KernelConfig | None) -> KernelConfig:
    """The profile's preset, or ``config`` when given (the profile name is still validated)."""
    if not isinstance(profile, str) or profile not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {profile!r}")
    if config is None:
        return PROFILES[profile]
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a KernelConfig or None, got {type(config).__name__}")
    return replace(config)


@dataclass(frozen=True)
class EntropyGate:
    """Teacher-entropy gate of ``entropy_adaptive``.

    ``γ = alpha_min + (alpha_max − alpha_min) · σ((H(q)/log V − tau) / scale)``: a confident
    teacher (low normalized entropy) leans on the reverse KL, an uncertain one on the forward KL.
    """

    alpha_min: float = 0.0
    alpha_max: float = 1.0
    tau: float = 0.5
    scale: float = 0.1

    def __post_init__(self) -> None:
        for name in ("alpha_min", "alpha_max", "tau", "scale"):
            value = getattr(self, name)
            _require(
                isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                f"EntropyGate.{name} must be a finite real number, got {value!r}",
            )
        _require(
            0.0 <= self.alpha_min <= self.alpha_max <= 1.0,
            "EntropyGate needs 0 <= alpha_min <= alpha_max <= 1, got "
            f"alpha_min={self.alpha_min!r}, alpha_max={self.alpha_max!r}",
        )
        _require(self.scale > 0, f"EntropyGate.scale must be > 0, got {self.scale!r}")
