"""Execution settings: chunking, profiles and the entropy gate.

None of these change what is computed, only how (workspace size, checks); the
one exception is :class:`EntropyGate`, the parameters of ``entropy_adaptive``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

__all__ = ["ChunkSize", "EntropyGate", "KernelConfig", "PROFILES", "RowLayout", "resolve_config"]


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _require_flags(owner: object, *names: str) -> None:
    """Flags must be real bools: a truthy string such as "no" must not read as True."""
    for name in names:
        value = getattr(owner, name)
        if not isinstance(value, bool):
            raise TypeError(f"{type(owner).__name__}.{name} must be a bool, got {value!r}")


MIN_CHUNK_ROWS = 256
DEFAULT_WORKSPACE_MIB = 448
FAST_FACTOR = 4
CHUNKS_PER_GROUP = 3
GRAD_WEIGHT_ACCUMULATIONS = ("auto", "compute", "fp32")


@dataclass(frozen=True)
class ChunkSize:
    """How many rows (tokens) one chunk of the loss processes at a time.

    - ``nrows``: a fixed row count per chunk (``None``: from the workspace, see
      :class:`KernelConfig`).
    - ``dynamic``: when True, a given ``nrows`` is lowered where one chunk's workspace would exceed
      an explicit ``KernelConfig.workspace_mib``; when False it is used as is.
    - ``fast``: trade memory for speed: four times the workspace and the minimum rows (fewer,
      larger GEMMs and launches).
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
class RowLayout:
    """How a call walks its rows: ``chunk_rows`` rows share one pass of logits and statistics;
    ``group_rows`` (a multiple of ``chunk_rows``) share one pair of gradient GEMMs."""

    chunk_rows: int
    group_rows: int


@dataclass(frozen=True)
class KernelConfig:
    """Execution knobs of the chunked backends.

    - ``chunk_size``: rows per chunk (see :class:`ChunkSize`). A chunk keeps its fp32 logits
      (student and teacher); when a gradient is formed, the logit gradients of 3 chunks are staged
      for one pair of gradient GEMMs. Workspace per row and local vocabulary column: 8 + 3 × 2
      bytes for bf16 inputs (fp32 staging: 4 bytes), e.g. 438 MiB for 256 rows at V = 128256.
      Rows per chunk depend on the vocabulary and the dtypes, never on the number of rows of a
      call (no re-tuning or recompiling for a new sequence length).
    - ``vocab_block``: columns per statistics block of the torch backend; the records of the blocks
      are merged exactly as the records of tensor-parallel shards are (the Triton kernels tile the
      columns themselves).
    - ``workspace_mib``: ``None`` (default): as many rows (a multiple of 64) as fit 448 MiB, and
      at least 256, below which launches cost more than memory saves (so 438 MiB at V = 128256,
      875 MiB at V = 256000, 1024 rows at V = 32768); an int: a hard cap, in MiB.
    - ``grad_weight_accumulation``: the dtype in which a head weight's gradient is summed over
      row groups: ``"fp32"`` (an fp32 buffer of the weight's size), ``"compute"`` (the weight's
      own dtype: no extra memory, one rounding per group), ``"auto"`` (``"compute"`` for bf16
      weights, ``"fp32"`` otherwise).
    - ``assume_valid_labels``: skip the range check of ``labels`` wherever it would run. A label
      outside ``[0, V)`` then gives a NaN row (never another class).
    - ``host_checks``: whether checks that read tensor values on the host run (the label range,
      a cached teacher's NaN/+inf): ``None`` runs them for CPU tensors only, where reading a value
      costs nothing; on CUDA they would synchronize with the device, so there a bad label or a
      non-finite cache shows as NaN rows instead (the ``debug`` profile sets True).
    - ``check_finite_inputs``: raise if a hidden state or weight holds NaN/inf instead of letting
      the affected rows come out NaN (the ``debug`` profile turns it on; it synchronizes).
    """

    chunk_size: ChunkSize = field(default_factory=ChunkSize)
    vocab_block: int = 8192
    workspace_mib: int | None = None
    grad_weight_accumulation: str = "auto"
    assume_valid_labels: bool = False
    host_checks: bool | None = None
    check_finite_inputs: bool = False

    def __post_init__(self) -> None:
        _require(
            isinstance(self.chunk_size, ChunkSize),
            f"KernelConfig.chunk_size must be a ChunkSize, got {type(self.chunk_size).__name__}",
        )
        _require_flags(self, "assume_valid_labels", "check_finite_inputs")
        if self.host_checks is not None:
            _require_flags(self, "host_checks")
        _require(
            self.grad_weight_accumulation in GRAD_WEIGHT_ACCUMULATIONS,
            f"KernelConfig.grad_weight_accumulation must be one of {GRAD_WEIGHT_ACCUMULATIONS}, "
            f"got {self.grad_weight_accumulation!r}",
        )
        for name in ("vocab_block", "workspace_mib"):
            value = getattr(self, name)
            if name == "workspace_mib" and value is None:
                continue
            _require(
                isinstance(value, int) and not isinstance(value, bool) and value > 0,
                f"KernelConfig.{name} must be a positive int{' or None' if name == 'workspace_mib' else ''}, "
                f"got {value!r}",
            )

    def runs_host_checks(self, on_cpu: bool) -> bool:
        """Whether value checks that read tensors on the host run for tensors on this device."""
        return on_cpu if self.host_checks is None else self.host_checks

    def row_layout(
        self, total_rows: int, local_vocab: int, logit_bytes: int, staged_bytes: int, shards: int = 1
    ) -> RowLayout:
        """Rows per chunk and per gradient group for ``local_vocab`` columns.

        ``logit_bytes``: bytes one row of a chunk keeps per column (4 per fp32 logits side);
        ``staged_bytes``: bytes one staged row takes per column (0 when no gradient is formed);
        ``shards``: the tensor-parallel group's size. The default's minimum rows grow with it, so
        that a shard's chunk does a single device's work per record exchange (two collectives
        per chunk) in no more memory than a single device's chunk.
        """
        size = self.chunk_size
        factor = FAST_FACTOR if size.fast else 1
        per_row = max(local_vocab, 1) * (logit_bytes + CHUNKS_PER_GROUP * staged_bytes)
        if self.workspace_mib is None:
            fitting = DEFAULT_WORKSPACE_MIB * factor * (1 << 20) // per_row
            rows = max(MIN_CHUNK_ROWS * factor * shards, fitting - fitting % 64)
            if size.nrows is not None:
                rows = size.nrows
        else:
            fitting = self.workspace_mib * factor * (1 << 20) // per_row
            fitting = max(1, fitting - fitting % 16 if fitting >= 16 else fitting)
            rows = fitting if size.nrows is None else (min(size.nrows, fitting) if size.dynamic else size.nrows)
        rows = max(1, min(rows, max(total_rows, 1)))
        chunks = min(CHUNKS_PER_GROUP, -(-total_rows // rows)) if staged_bytes > 0 else 1
        return RowLayout(chunk_rows=rows, group_rows=rows * max(1, chunks))


PROFILES: dict[str, KernelConfig] = {
    "balanced": KernelConfig(),
    "fast": KernelConfig(chunk_size=ChunkSize(fast=True), vocab_block=32768),
    "debug": KernelConfig(workspace_mib=4, vocab_block=1024, host_checks=True, check_finite_inputs=True),
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
