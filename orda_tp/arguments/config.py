"""Execution settings: how a call runs (chunking, workspace, checks), never what it computes.
orda_tp's own :class:`ExecutionConfig` and :class:`ChunkRows`; orda-kernel's spellings of them
(``KernelConfig``, ``ChunkSize``) are in :mod:`.orda_kernel`."""

from __future__ import annotations

from dataclasses import dataclass, field

from .validation import check_flag, is_int

__all__ = ["GRAD_WEIGHT_ACCUMULATIONS", "HOST_WORKSPACE_MIB", "PROFILES", "ChunkRows", "ExecutionConfig"]

GRAD_WEIGHT_ACCUMULATIONS = ("auto", "compute", "fp32")
#: The default chunk workspace, in MiB, of a call whose tensors are not on a CUDA device.
HOST_WORKSPACE_MIB = 448


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class ChunkRows:
    """How many rows (tokens) one chunk of the loss processes at a time.

    - ``nrows``: a fixed row count per chunk (``None``: from the workspace).
    - ``dynamic``: a given ``nrows`` is lowered where one chunk's workspace would exceed an
      explicit ``workspace_mib`` (else it is used as is).
    - ``fast``: four times the workspace and the minimum rows (fewer, larger GEMMs and launches).
    """

    nrows: int | None = None
    dynamic: bool = True
    fast: bool = False

    def __post_init__(self) -> None:
        check_flag("ChunkSize.dynamic", self.dynamic)
        check_flag("ChunkSize.fast", self.fast)
        if self.nrows is not None and not (
            isinstance(self.nrows, int) and not isinstance(self.nrows, bool) and self.nrows > 0
        ):
            raise ValueError(f"ChunkSize.nrows must be a positive int or None, got {self.nrows!r}")


@dataclass(frozen=True)
class ExecutionConfig:
    """Execution knobs of the chunked backends (docs/reference.md, ``KernelConfig``).

    - ``chunk_size``: rows per chunk (:class:`ChunkRows`); ``num_chunks`` / ``max_chunks``
      (keyword-only): exactly / at most that many chunks.
    - ``vocab_block``: columns per statistics block of the torch backend.
    - ``workspace_mib``: None (the device's default workspace) or a hard cap in MiB.
    - ``grad_weight_accumulation``: the dtype a head weight's gradient is summed in over row
      groups: ``"fp32"``, ``"compute"`` (the weight's own) or ``"auto"`` (``"compute"`` for bf16).
    - ``assume_valid_labels``: skip the label range check (a bad label then gives a NaN row).
    - ``host_checks``: whether checks that read tensor values on the host run (None: for CPU
      tensors only, where a read costs no device synchronization).
    - ``check_finite_inputs``: raise on a non-finite hidden state or weight (synchronizes).
    """

    chunk_size: ChunkRows = field(default_factory=ChunkRows)
    vocab_block: int = 8192
    workspace_mib: int | None = None
    grad_weight_accumulation: str = "auto"
    assume_valid_labels: bool = False
    host_checks: bool | None = None
    check_finite_inputs: bool = False
    num_chunks: int | None = field(default=None, kw_only=True)
    max_chunks: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        _require(
            isinstance(self.chunk_size, ChunkRows),
            f"KernelConfig.chunk_size must be a ChunkSize, got {type(self.chunk_size).__name__}",
        )
        for name in ("assume_valid_labels", "check_finite_inputs"):
            check_flag(f"KernelConfig.{name}", getattr(self, name))
        if self.host_checks is not None:
            check_flag("KernelConfig.host_checks", self.host_checks)
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
        for name in ("num_chunks", "max_chunks"):
            value = getattr(self, name)
            if value is not None:  # an int or e.g. a NumPy integer, kept as an int
                message = f"KernelConfig.{name} must be a positive int or None, got {value!r}"
                _require(is_int(value) and int(value) > 0, message)
                object.__setattr__(self, name, int(value))
        _require(
            self.num_chunks is None or self.chunk_size.nrows is None,
            f"KernelConfig.num_chunks={self.num_chunks} and chunk_size={self.chunk_size!r} both set the rows per "
            "chunk; give one of them (orda-kernel: chunk_size and num_chunks are mutually exclusive)",
        )


PROFILES: dict[str, ExecutionConfig] = {
    "balanced": ExecutionConfig(),
    "fast": ExecutionConfig(chunk_size=ChunkRows(fast=True), vocab_block=32768),
    # A 4 MiB workspace and small blocks: many chunks and blocks per call, and every host check runs.
    "debug": ExecutionConfig(workspace_mib=4, vocab_block=1024, host_checks=True, check_finite_inputs=True),
}
