"""orda-kernel 0.1.0's spellings of the execution settings, and their translation.

``orda_tp.KernelConfig`` and ``orda_tp.ChunkSize`` are orda-kernel's classes: the core
:class:`~.config.ExecutionConfig` and :class:`~.config.ChunkRows` (whose fields come first) with
what orda-kernel spells besides. A loss's options translate them once, when they are built
(:func:`apply_loss_overrides`, :func:`own_config`); the rest of the package reads the core classes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

from ..divergences.base import EntropyGate
from .config import ChunkRows, ExecutionConfig
from .validation import IgnoredArgumentWarning, caller_stacklevel, check_flag, is_int

__all__ = [
    "LOSS_OVERRIDES",
    "ChunkSize",
    "KernelConfig",
    "apply_loss_overrides",
    "begin_autotune_run",
    "own_config",
    "reset_autotune_cache",
    "spelled",
]

MAX_FUSED_SIZE = 32768  # orda-kernel's largest max_fused_size (a power of two)
NONE_MEANS_DEFAULT = ("chunk_size", "grad_weight_accumulation", "assume_valid_labels")

_ROLE = "orda_kernel"  # metadata key: what an orda-kernel field does here
_NO_AUTOTUNER = "orda_tp autotunes nothing at run time (its Triton kernels take their tiles from a fixed table)"
_OWN_TILES = (
    "orda_tp's Triton kernels tile a chunk's columns themselves and the torch backend's column block is vocab_block"
)


class _ClassConstructor:
    """A ``ChunkSize`` field name that is also an orda-kernel constructor: read on the class it is
    the constructor (``ChunkSize.nrows(512)``); an instance keeps its fields in its ``__dict__``,
    which a descriptor without ``__set__`` does not shadow (``ChunkSize(nrows=512).nrows == 512``)."""

    def __init__(self, build: Callable[..., ChunkSize]) -> None:
        self.build = build
        self.__doc__ = build.__doc__

    def __get__(self, instance: object, owner: type | None = None) -> Callable[..., ChunkSize]:
        return self.build


@dataclass(frozen=True)
class ChunkSize(ChunkRows):
    """orda-kernel's ``ChunkSize``: :class:`~.config.ChunkRows`' fields (``nrows``, ``dynamic``,
    ``fast``), and orda-kernel's constructors under the same names, read on the class:
    ``ChunkSize.nrows(n)`` (exactly ``n`` rows, never lowered: ``ChunkSize(nrows=n,
    dynamic=False)``), ``ChunkSize.dynamic()`` (``ChunkSize()``), ``ChunkSize.fast()``
    (``ChunkSize(fast=True)``)."""

    @property
    def is_dynamic(self) -> bool:
        """The rows per chunk are chosen for the call (no ``nrows``, not ``fast``); not the
        ``dynamic`` field, which only matters with an ``nrows``."""
        return self.nrows is None and not self.fast

    @property
    def is_fast(self) -> bool:
        """``fast``."""
        return self.fast

    @property
    def value(self) -> int:
        """The fixed ``nrows`` (``TypeError`` when there is none)."""
        if self.nrows is None:
            raise TypeError(f"{self!r} has no nrows value")
        return self.nrows


# Installed after @dataclass, which would read them as the fields' defaults.
ChunkSize.nrows = _ClassConstructor(lambda n: ChunkSize(nrows=n, dynamic=False))  # type: ignore[assignment]
ChunkSize.dynamic = _ClassConstructor(lambda: ChunkSize())  # type: ignore[assignment]
ChunkSize.fast = _ClassConstructor(lambda: ChunkSize(fast=True))  # type: ignore[assignment]


def _loss_keyword() -> Any:
    """A field that overrides the loss keyword of the same name (:func:`apply_loss_overrides`)."""
    return field(default=None, kw_only=True, metadata={_ROLE: "loss keyword"})


def _ignored(reason: str) -> Any:
    """A field accepted and checked as orda-kernel checks it, without effect here (``reason``)."""
    return field(default=None, kw_only=True, metadata={_ROLE: "ignored", "reason": reason})


@dataclass(frozen=True, repr=False)
class KernelConfig(ExecutionConfig):
    """orda-kernel's ``KernelConfig``: :class:`~.config.ExecutionConfig`'s fields, then
    orda-kernel's own, keyword-only (``None`` leaves each unset):

    - ``max_fused_size`` (a power of two ≤ 32768), ``autotune`` (a bool or ``"Max"``),
      ``refresh_autotune`` (a bool): orda-kernel's Triton tile and autotuner settings; checked as
      there, ignored here with one ``IgnoredArgumentWarning`` per use.
    - ``kl_weight``, ``kl_temperature``, ``kl_teacher_temperature``, ``kl_divergence``,
      ``kl_alpha``, ``kl_beta``, ``entropy_gate``: override the call's keyword of the same name
      (:func:`apply_loss_overrides`); their values are checked as the call's keywords are.

    ``None`` for ``chunk_size``, ``grad_weight_accumulation`` and ``assume_valid_labels`` is the
    default, as in orda-kernel.
    """

    chunk_size: ChunkRows = field(default_factory=ChunkSize)
    max_fused_size: int | None = _ignored(_OWN_TILES)
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
        for spec in fields(self):  # orda-kernel's None: the field's default
            if spec.name in NONE_MEANS_DEFAULT and getattr(self, spec.name) is None:
                default = spec.default if spec.default_factory is MISSING else spec.default_factory()
                object.__setattr__(self, spec.name, default)
        super().__post_init__()  # the core's checks, on the defaults filled in
        size = self.max_fused_size
        # A power of two has one bit set: x & (x − 1) == 0.
        power_of_two = is_int(size) and 0 < int(size) <= MAX_FUSED_SIZE and int(size) & (int(size) - 1) == 0
        if size is not None and not power_of_two:
            raise ValueError(
                f"KernelConfig.max_fused_size must be a power of two <= {MAX_FUSED_SIZE} or None, got {size!r}"
            )
        autotune = self.autotune
        if not (autotune is None or isinstance(autotune, bool) or (isinstance(autotune, str) and autotune == "Max")):
            raise ValueError(f"KernelConfig.autotune must be a bool, 'Max' or None, got {autotune!r}")
        if self.refresh_autotune is not None:
            check_flag("KernelConfig.refresh_autotune", self.refresh_autotune)
        if self.entropy_gate is not None and not isinstance(self.entropy_gate, EntropyGate):
            raise TypeError(
                f"KernelConfig.entropy_gate must be an EntropyGate or None, got {type(self.entropy_gate).__name__}"
            )

    def __repr__(self) -> str:
        """``KernelConfig(...)`` with the core's fields first, then orda-kernel's."""
        # A stable sort: the core's fields first, then orda-kernel's, each in declaration order.
        ordered = sorted(fields(self), key=lambda spec: _ROLE in spec.metadata)
        return f"KernelConfig({', '.join(f'{spec.name}={getattr(self, spec.name)!r}' for spec in ordered)})"

    def loss_overrides(self) -> dict[str, object]:
        """The loss keywords this config overrides, by name (the fields that are not None)."""
        return {name: getattr(self, name) for name in LOSS_OVERRIDES if getattr(self, name) is not None}

    def ignored_fields(self) -> dict[str, str]:
        """The fields set here that have no effect, each with the reason."""
        return {
            spec.name: spec.metadata["reason"]
            for spec in fields(self)
            if spec.metadata.get(_ROLE) == "ignored" and getattr(self, spec.name) is not None
        }


LOSS_OVERRIDES = tuple(spec.name for spec in fields(KernelConfig) if spec.metadata.get(_ROLE) == "loss keyword")


def spelled(config: KernelConfig, names: Iterable[str]) -> str:
    """``KernelConfig(name=value, ...)`` of ``config``'s fields ``names``."""
    return "KernelConfig(" + ", ".join(f"{name}={getattr(config, name)!r}" for name in names) + ")"


def _same_value(a: object, b: object) -> bool:
    """Equality of plain keyword values (numbers, strings, gates, None); anything else differs."""
    plain = (type(None), int, float, str, EntropyGate)
    return isinstance(a, plain) and isinstance(b, plain) and a == b


def apply_loss_overrides(keywords: Mapping[str, object], defaults: Mapping[str, object]) -> dict[str, object]:
    """The keywords of a ``distillation_loss`` call (or ``DistillationLoss`` construction) with
    orda-kernel's precedence: a loss keyword that ``keywords["config"]`` sets (:data:`LOSS_OVERRIDES`)
    replaces the call's, and the returned ``config`` no longer carries it. A keyword the call gave
    (not its ``defaults`` value) that the config replaces by another value gives one
    ``IgnoredArgumentWarning`` at the caller's line. The values are checked afterwards."""
    merged = dict(keywords)
    config = merged.get("config")
    if not isinstance(config, KernelConfig) or not config.loss_overrides():
        return merged
    for name, value in config.loss_overrides().items():
        given = merged[name]
        # Warn only where the caller's own value is lost: a keyword it gave (not the default) unlike the config's.
        if not _same_value(given, defaults[name]) and not _same_value(given, value):
            warnings.warn(
                f"{name}={given!r} is ignored: config={spelled(config, [name])} overrides it (as in orda-kernel); "
                f"leave {name} at its default ({defaults[name]!r}) to silence this warning",
                IgnoredArgumentWarning,
                stacklevel=caller_stacklevel(),
            )
        merged[name] = value
    # Applied, they leave the config: own_config would otherwise refuse it as overriding loss keywords.
    unset: dict[str, Any] = dict.fromkeys(LOSS_OVERRIDES)
    merged["config"] = replace(config, **unset)
    return merged


def own_config(config: ExecutionConfig) -> ExecutionConfig:
    """``config`` as the core :class:`~.config.ExecutionConfig`: each orda-kernel field without
    effect here gives one ``IgnoredArgumentWarning`` at the caller's line and is dropped. A loss
    keyword that ``config`` still overrides raises ValueError rather than being ignored: an entry
    point applies those first (:func:`apply_loss_overrides`) or refuses them."""
    if not isinstance(config, KernelConfig):
        return config
    overrides = config.loss_overrides()
    if overrides:
        raise ValueError(
            f"{spelled(config, overrides)} overrides loss keywords, which this entry point does not apply; "
            f"pass {', '.join(overrides)} to the call instead"
        )
    for name, reason in config.ignored_fields().items():
        warnings.warn(
            f"{spelled(config, [name])} is ignored: {reason}; leave {name}=None to silence this warning",
            IgnoredArgumentWarning,
            stacklevel=caller_stacklevel(),
        )
    # The core's fields only: nothing past this point reads orda-kernel's.
    return ExecutionConfig(**{spec.name: getattr(config, spec.name) for spec in fields(ExecutionConfig)})


def reset_autotune_cache() -> None:
    """A no-op, kept so that ported code runs: orda-kernel's clears its autotuner's winners, and
    orda_tp autotunes nothing at run time (its Triton kernels' tiles come from a fixed table). The
    generated kernel sources (``ORDA_TP_KERNEL_CACHE``) are not tuning state and stay."""


def begin_autotune_run() -> None:
    """A no-op, kept so that ported code runs: orda-kernel's starts a new autotuning run, and
    orda_tp autotunes nothing at run time."""
