"""Execution settings: chunking and profiles.

None of these change what is computed, only how (workspace size, checks); the exception is the
loss keywords that a :class:`KernelConfig` may override, as orda-kernel's does
(:func:`apply_loss_overrides`).

orda-kernel 0.1.0's spellings work too: ``ChunkSize.nrows(n)``, ``.dynamic()``, ``.fast()``; its
``KernelConfig`` fields (the chunking ones mapped onto the row layout, the autotuning ones accepted
and ignored with an ``IgnoredArgumentWarning``); :func:`reset_autotune_cache` and
:func:`begin_autotune_run` (no-ops: nothing is autotuned at run time).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from numbers import Integral
from typing import Any

from .checks import IgnoredArgumentWarning, caller_stacklevel
from .chunk_size import ChunkSize
from .divergences.base import EntropyGate

__all__ = [
    "HOST_WORKSPACE_MIB",
    "ChunkSize",
    "EntropyGate",
    "KernelConfig",
    "LOSS_OVERRIDES",
    "PROFILES",
    "apply_loss_overrides",
    "begin_autotune_run",
    "reset_autotune_cache",
    "spelled",
]


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _require_flags(owner: object, *names: str) -> None:
    """Flags must be real bools: a truthy string such as "no" must not read as True."""
    for name in names:
        value = getattr(owner, name)
        if not isinstance(value, bool):
            raise TypeError(f"{type(owner).__name__}.{name} must be a bool, got {value!r}")


def _is_count(value: object) -> bool:
    """A positive integer (``int`` or e.g. a NumPy integer, as orda-kernel accepts), not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool) and int(value) > 0


GRAD_WEIGHT_ACCUMULATIONS = ("auto", "compute", "fp32")
#: The default chunk workspace, in MiB, of a call whose tensors are not on a CUDA device.
HOST_WORKSPACE_MIB = 448
MAX_FUSED_SIZE = 32768  # orda-kernel's largest max_fused_size (a power of two)


_ROLE = "orda_tp.role"  # metadata key: what an orda-kernel field of KernelConfig does here
_NO_AUTOTUNER = "orda_tp autotunes nothing at run time (its Triton kernels take their tiles from a fixed table)"


def _loss_keyword() -> Any:
    """A field that overrides the loss keyword of the same name (:func:`apply_loss_overrides`)."""
    return field(default=None, kw_only=True, metadata={_ROLE: "loss keyword"})


def _ignored(reason: str) -> Any:
    """A field accepted and checked as orda-kernel checks it, with no effect here (``reason``);
    :func:`resolve_config` warns once per use."""
    return field(default=None, kw_only=True, metadata={_ROLE: "ignored", "reason": reason})


@dataclass(frozen=True)
class KernelConfig:
    """Execution knobs of the chunked backends.

    - ``chunk_size``: rows per chunk (see :class:`ChunkSize`). A chunk keeps its fp32 logits
      (student and teacher); when a gradient is formed, the logit gradients of a group of chunks
      are staged for one pair of gradient GEMMs. Workspace: ``C·(R·8 + G·2)`` bytes for ``R`` rows
      per chunk, ``G`` per group and ``C`` local vocabulary columns (bf16 inputs, frozen teacher;
      fp32 staging: 4 bytes), e.g. 1024/4096 rows in 1957 MiB at V = 128256. Rows depend on the
      workspace, the vocabulary and the dtypes, never on a long batch's length (a batch shorter
      than a chunk is one chunk), unless ``num_chunks`` or ``max_chunks`` asks for it.
    - ``vocab_block``: columns per statistics block of the torch backend; the records of the blocks
      are merged exactly as the records of tensor-parallel shards are (the Triton kernels tile the
      columns themselves).
    - ``workspace_mib``: ``None`` (default): the workspace grows with the device
      (:func:`orda_tp.engine.row_layout.default_workspace_mib`: on CUDA 2048, 1024 or 512 MiB, the largest
      that is at most 1/16 of the free memory; elsewhere 448), and the layout is the measured
      fastest that fits it (:data:`orda_tp.engine.row_layout.LAYOUT_COSTS`), at least 256 rows
      per chunk; an int: the workspace in MiB, a hard cap, the fastest measured layout within it.
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

    orda-kernel 0.1.0's fields (keyword-only; ``None`` leaves each at its default, and ``None`` is
    also accepted for ``chunk_size``, ``grad_weight_accumulation`` and ``assume_valid_labels``):

    - ``num_chunks``: split the rows into this many chunks (``ceil(rows / num_chunks)`` rows each);
      not with a ``ChunkSize`` that has ``nrows``.
    - ``max_chunks``: at most this many chunks: the workspace's rows per chunk are raised to
      ``ceil(rows / max_chunks)`` where they would give more (no effect with ``nrows`` or
      ``num_chunks``). A row count asked for this way or by ``num_chunks`` is lowered to fit an
      explicit ``workspace_mib`` when ``chunk_size.dynamic``, as a given ``nrows`` is.
    - ``max_fused_size`` (a power of two ≤ 32768), ``autotune`` (a bool or ``"Max"``),
      ``refresh_autotune`` (a bool): orda-kernel's Triton tile and autotuner settings; checked as
      there, ignored here with one ``IgnoredArgumentWarning`` per use.
    - ``kl_weight``, ``kl_temperature``, ``kl_teacher_temperature``, ``kl_divergence``,
      ``kl_alpha``, ``kl_beta``, ``entropy_gate``: override the call's keyword of the same name
      (:func:`apply_loss_overrides`); their values are checked as the call's keywords are.

    How the chunking fields become rows per chunk and per group: ``orda_tp.engine.row_layout``.
    """

    chunk_size: ChunkSize = field(default_factory=ChunkSize)
    vocab_block: int = 8192
    workspace_mib: int | None = None
    grad_weight_accumulation: str = "auto"
    assume_valid_labels: bool = False
    host_checks: bool | None = None
    check_finite_inputs: bool = False
    num_chunks: int | None = field(default=None, kw_only=True)
    max_chunks: int | None = field(default=None, kw_only=True)
    max_fused_size: int | None = _ignored(
        "orda_tp's Triton kernels tile a chunk's columns themselves and the torch backend's column block is vocab_block"
    )
    autotune: bool | str | None = _ignored(_NO_AUTOTUNER)
    refresh_autotune: bool | None = _ignored(_NO_AUTOTUNER)
    kl_weight: float | None = _loss_keyword()
    kl_temperature: float | None = _loss_keyword()
    kl_teacher_temperature: float | None = _loss_keyword()
    kl_divergence: str | None = _loss_keyword()
    kl_alpha: float | None = _loss_keyword()
    kl_beta: float | None = _loss_keyword()
    entropy_gate: EntropyGate | None = _loss_keyword()

    def __post_init__(self) -> None:
        # orda-kernel's None ("the profile's value") for three of our fields: their default.
        defaults = {"chunk_size": ChunkSize(), "grad_weight_accumulation": "auto", "assume_valid_labels": False}
        for name, default in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
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
        self._check_orda_kernel_fields()

    def _check_orda_kernel_fields(self) -> None:
        """orda-kernel's fields, checked as it checks them (at the call there, at construction here)."""
        for name in ("num_chunks", "max_chunks"):
            value = getattr(self, name)
            if value is not None:
                _require(_is_count(value), f"KernelConfig.{name} must be a positive int or None, got {value!r}")
                object.__setattr__(self, name, int(value))
        _require(
            self.num_chunks is None or self.chunk_size.nrows is None,
            f"KernelConfig.num_chunks={self.num_chunks} and chunk_size={self.chunk_size!r} both set the rows per "
            "chunk; give one of them (orda-kernel: chunk_size and num_chunks are mutually exclusive)",
        )
        size = self.max_fused_size
        _require(
            size is None or (_is_count(size) and int(size) <= MAX_FUSED_SIZE and int(size) & (int(size) - 1) == 0),
            f"KernelConfig.max_fused_size must be a power of two <= {MAX_FUSED_SIZE} or None, got {size!r}",
        )
        autotune = self.autotune
        _require(
            autotune is None or isinstance(autotune, bool) or (isinstance(autotune, str) and autotune == "Max"),
            f"KernelConfig.autotune must be a bool, 'Max' or None, got {autotune!r}",
        )
        if self.refresh_autotune is not None:
            _require_flags(self, "refresh_autotune")
        if self.entropy_gate is not None and not isinstance(self.entropy_gate, EntropyGate):
            raise TypeError(
                f"KernelConfig.entropy_gate must be an EntropyGate or None, got {type(self.entropy_gate).__name__}"
            )

    def loss_overrides(self) -> dict[str, object]:
        """The loss keywords this config overrides, by name (the fields that are not None)."""
        return {name: getattr(self, name) for name in LOSS_OVERRIDES if getattr(self, name) is not None}

    def without_loss_overrides(self) -> KernelConfig:
        """This config with no loss keyword overridden."""
        cleared: dict[str, Any] = dict.fromkeys(LOSS_OVERRIDES)  # every loss-keyword field is `X | None`
        return replace(self, **cleared)

    def ignored_fields(self) -> dict[str, str]:
        """The orda-kernel fields set here that have no effect, each with the reason."""
        return {
            spec.name: spec.metadata["reason"]
            for spec in fields(self)
            if spec.metadata.get(_ROLE) == "ignored" and getattr(self, spec.name) is not None
        }


LOSS_OVERRIDES = tuple(spec.name for spec in fields(KernelConfig) if spec.metadata.get(_ROLE) == "loss keyword")

PROFILES: dict[str, KernelConfig] = {
    "balanced": KernelConfig(),
    "fast": KernelConfig(chunk_size=ChunkSize(fast=True), vocab_block=32768),
    "debug": KernelConfig(workspace_mib=4, vocab_block=1024, host_checks=True, check_finite_inputs=True),
}


def spelled(config: KernelConfig, names: Iterable[str]) -> str:
    return "KernelConfig(" + ", ".join(f"{name}={getattr(config, name)!r}" for name in names) + ")"


def _same_value(a: object, b: object) -> bool:
    """Equality of plain keyword values (numbers, strings, gates, None); anything else differs."""
    plain = (type(None), int, float, str, EntropyGate)
    return isinstance(a, plain) and isinstance(b, plain) and a == b


def apply_loss_overrides(keywords: Mapping[str, object], defaults: Mapping[str, object]) -> dict[str, object]:
    """The keywords of a :func:`distillation_loss` call (or :class:`DistillationLoss`
    construction) with orda-kernel's precedence applied: a loss keyword that ``keywords["config"]``
    sets (:data:`LOSS_OVERRIDES`) replaces the call's keyword of the same name, whatever the call
    gave, and the returned ``config`` no longer carries it.

    ``defaults``: the keywords' default values. A keyword the call gave (not its default) that the
    config replaces by another value gives one ``IgnoredArgumentWarning``, attributed to the
    caller's line. The values are checked afterwards, as the call's keywords.
    """
    merged = dict(keywords)
    config = merged.get("config")
    if not isinstance(config, KernelConfig) or not config.loss_overrides():
        return merged
    for name, value in config.loss_overrides().items():
        given = merged[name]
        if not _same_value(given, defaults[name]) and not _same_value(given, value):
            warnings.warn(
                f"{name}={given!r} is ignored: config={spelled(config, [name])} overrides it (as in orda-kernel); "
                f"leave {name} at its default ({defaults[name]!r}) to silence this warning",
                IgnoredArgumentWarning,
                stacklevel=caller_stacklevel(),
            )
        merged[name] = value
    merged["config"] = config.without_loss_overrides()
    return merged


def reset_autotune_cache() -> None:
    """orda-kernel's ``reset_autotune_cache()`` clears its autotuner's winners, in memory and on
    disk. orda_tp autotunes nothing at run time (its Triton kernels take their tiles from a fixed
    table), so there is nothing to clear: a no-op, kept so that ported code runs. The ``triton``
    backend's generated kernel sources (``ORDA_TP_KERNEL_CACHE``) are not tuning state and stay."""


def begin_autotune_run() -> None:
    """orda-kernel's ``begin_autotune_run()`` starts a new autotuning run (shapes are tuned again
    once per run). orda_tp autotunes nothing at run time: a no-op, kept so that ported code runs."""
