"""The keywords of a loss call, validated once: :class:`LossOptions` (``distillation_loss``,
``DistillationLoss``) and :class:`LogitsOptions` (``KDLoss``, ``flash_ce_kd_loss``).

Each argument is checked in one place, here, when the options are built (so ``DistillationLoss(...)``
fails at construction); the divergence is resolved once and kept. What depends on the tensors of
a call (the teacher's kind, the vocabulary) is resolved by :class:`orda_tp.plan.LossPlan`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Protocol, TypeGuard

import torch.distributed as dist
from torch import Tensor

from .arguments import (
    IgnoredArgumentWarning,
    caller_stacklevel,
    check_choice,
    check_ignore_index,
    check_loss_weight,
    check_temperature,
    is_int,
)
from .config import KernelConfig, resolve_config, spelled
from .divergences import Divergence, DivergenceParams, EntropyGate, resolve_divergence

__all__ = ["BACKENDS", "LOGITS_BACKENDS", "REDUCTIONS", "GradScalerLike", "LogitsOptions", "LossOptions"]

BACKENDS = ("auto", "triton", "torch", "reference")
#: The logits-level losses read logits; "reference" builds them from hidden states.
LOGITS_BACKENDS = ("auto", "torch", "triton")
REDUCTIONS = ("mean", "sum", "none")


class GradScalerLike(Protocol):
    """What the loss reads of a ``torch.amp.GradScaler``: its scale (``get_scale``)."""

    def get_scale(self) -> float: ...


def _is_grad_scaler(value: object) -> TypeGuard[GradScalerLike]:
    """A GradScaler instance (or one alike): not a class, with a callable ``get_scale``."""
    return not isinstance(value, type) and callable(getattr(value, "get_scale", None))


def check_precision(
    gradient_materialization_scale: object, grad_scaler: object
) -> tuple[float | Tensor | None, GradScalerLike | None]:
    """``gradient_materialization_scale``: None, a finite real > 0, or a one-element floating-point
    tensor that does not require grad (orda-kernel's form, e.g. ``GradScaler.scale(torch.ones(()))``,
    used on the device as it is: its value is never read). ``grad_scaler``: None or a GradScaler."""
    scale: float | Tensor | None = None
    value = gradient_materialization_scale
    if isinstance(value, Tensor):
        if value.numel() != 1 or not value.is_floating_point() or value.requires_grad:
            raise ValueError(
                "gradient_materialization_scale must be a finite real number > 0 or a one-element floating-point "
                f"tensor that does not require grad, got a tensor of shape {tuple(value.shape)}, dtype "
                f"{value.dtype}, requires_grad={value.requires_grad}"
            )
        scale = value.reshape(())
    elif value is not None:
        scale = check_temperature("gradient_materialization_scale", value)
    if grad_scaler is None or _is_grad_scaler(grad_scaler):
        return scale, grad_scaler
    received = f"the class {grad_scaler.__name__}" if isinstance(grad_scaler, type) else type(grad_scaler).__name__
    raise TypeError(f"grad_scaler must be a torch.amp.GradScaler instance or None, got {received}")


def _check_vocab_range(vocab_range: object) -> tuple[int, int] | None:
    if vocab_range is None:
        return None
    if (
        not isinstance(vocab_range, (tuple, list))
        or len(vocab_range) != 2
        or not all(is_int(v) for v in vocab_range)
        or not 0 <= vocab_range[0] <= vocab_range[1]
    ):
        raise ValueError(
            f"vocab_range must be a pair of ints (start, stop) with 0 <= start <= stop, got {vocab_range!r}"
        )
    return int(vocab_range[0]), int(vocab_range[1])


def check_group(group: object) -> dist.ProcessGroup | None:
    """``tp_group``: a process group or None."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"tp_group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    return group


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


@dataclass(frozen=True)
class LossOptions:
    """The keywords of :func:`orda_tp.distillation_loss` (see its docstring and docs/reference.md),
    validated and normalized at construction; ``divergence``, ``params`` (the variant and its
    parameters, resolved once) and ``kernel_config`` (``config``, or the ``profile``'s preset) are
    derived. A ``config`` that overrides loss keywords (orda-kernel's fields) replaces them first.
    """

    student_ce_weight: float = 1.0
    teacher_ce_weight: float | None = None
    kl_weight: float = 0.0
    kl_temperature: float = 1.0
    kl_teacher_temperature: float | None = None
    kl_divergence: str = "forward"
    kl_alpha: float | None = None
    kl_beta: float | None = None
    entropy_gate: EntropyGate | None = None
    ignore_index: int = -100
    reduction: str = "mean"
    profile: str = "balanced"
    backend: str = "auto"
    config: KernelConfig | None = None
    gradient_materialization_scale: float | Tensor | None = None
    grad_scaler: GradScalerLike | None = None
    tp_group: dist.ProcessGroup | None = None
    vocab_range: tuple[int, int] | None = None
    vocab_size: int | None = None
    sequence_parallel: bool | None = None
    divergence: Divergence = field(init=False, repr=False, compare=False)
    params: DivergenceParams = field(init=False, repr=False, compare=False)
    kernel_config: KernelConfig = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = {spec.name: getattr(self, spec.name) for spec in fields(self) if spec.init}
        values = apply_loss_overrides(given, KEYWORD_DEFAULTS)  # orda-kernel: a config's loss keywords win
        divergence, params = resolve_divergence(
            values["kl_divergence"], values["kl_alpha"], values["kl_beta"], values["entropy_gate"], unused="warn"
        )
        scale, scaler = check_precision(values["gradient_materialization_scale"], values["grad_scaler"])
        optional_weight, optional_temperature = values["teacher_ce_weight"], values["kl_teacher_temperature"]
        normalized = {
            "student_ce_weight": check_loss_weight("student_ce_weight", values["student_ce_weight"]),
            "teacher_ce_weight": None
            if optional_weight is None
            else check_loss_weight("teacher_ce_weight", optional_weight),
            "kl_weight": check_loss_weight("kl_weight", values["kl_weight"]),
            "kl_temperature": check_temperature("kl_temperature", values["kl_temperature"]),
            "kl_teacher_temperature": None
            if optional_temperature is None
            else check_temperature("kl_teacher_temperature", optional_temperature),
            "kl_divergence": divergence.name,
            # A parameter the variant does not read was warned about and is dropped.
            **{
                name: values[name] if name in divergence.parameters else None
                for name in ("kl_alpha", "kl_beta", "entropy_gate")
            },
            "ignore_index": check_ignore_index(values["ignore_index"]),
            "reduction": check_choice("reduction", values["reduction"], REDUCTIONS),
            "backend": check_choice("backend", values["backend"], BACKENDS),
            "config": values["config"],
            "gradient_materialization_scale": scale,
            "grad_scaler": scaler,
            **self._parallel_keywords(values),
        }
        for name, value in normalized.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "divergence", divergence)
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "kernel_config", resolve_config(values["profile"], values["config"]))
        if self.kl_teacher_temperature is not None and divergence.cotrains_teacher:
            if self.kl_teacher_temperature != self.kl_temperature:
                raise ValueError(
                    f"kl_divergence={divergence.name!r} needs kl_teacher_temperature == kl_temperature "
                    f"({self.kl_temperature!r}), got {self.kl_teacher_temperature!r}"
                )

    @staticmethod
    def _parallel_keywords(values: dict[str, object]) -> dict[str, object]:
        """The tensor-parallel keywords, checked (the group's ranks are checked by the call)."""
        vocab_size, sequence_parallel = values["vocab_size"], values["sequence_parallel"]
        if vocab_size is not None and (not is_int(vocab_size) or int(vocab_size) < 1):
            raise ValueError(f"vocab_size must be a positive int or None, got {vocab_size!r}")
        if sequence_parallel is not None and not isinstance(sequence_parallel, bool):
            raise TypeError(f"sequence_parallel must be a bool or None, got {sequence_parallel!r}")
        return {
            "tp_group": check_group(values["tp_group"]),
            "vocab_range": _check_vocab_range(values["vocab_range"]),
            "vocab_size": None if vocab_size is None else int(vocab_size),
            "sequence_parallel": sequence_parallel,
        }

    def with_precision(self, gradient_materialization_scale: object, grad_scaler: object) -> LossOptions:
        """These options with the given per-call precision arguments (None keeps the option's)."""
        scale, scaler = check_precision(gradient_materialization_scale, grad_scaler)
        if scale is None and scaler is None:
            return self
        return replace(self, gradient_materialization_scale=scale, grad_scaler=scaler)

    @property
    def gradient_scale(self) -> float | Tensor | None:
        """The scale at which fp16 logit gradients are materialized for the gradient GEMMs: the
        given number or tensor, else the GradScaler's scale tensor (left on the device, never read)."""
        if self.gradient_materialization_scale is not None:
            return self.gradient_materialization_scale
        scaler = self.grad_scaler
        if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
            return None
        scale = getattr(scaler, "_scale", None)
        if isinstance(scale, Tensor):
            return scale.reshape(())
        return float(scaler.get_scale())  # not yet initialized: its init scale


KEYWORD_DEFAULTS: dict[str, object] = {spec.name: spec.default for spec in fields(LossOptions) if spec.init}


@dataclass(frozen=True)
class LogitsOptions:
    """The validated keywords every logits-level loss shares (each loss checks its own sizes).

    ``chunk_rows``: rows per chunk, 0 for the default workspace (:meth:`KernelConfig.row_layout`);
    ``config.vocab_block``: columns per block of the torch backend.
    """

    temperature: float
    divergence: Divergence
    params: DivergenceParams
    ignore_index: int
    chunk_rows: int
    backend: str
    tp_group: object
    config: KernelConfig

    @staticmethod
    def resolve(
        *,
        temperature: object,
        kl_divergence: object,
        kl_alpha: object,
        kl_beta: object,
        entropy_gate: object,
        ignore_index: object,
        chunk_rows: int,
        backend: object,
        tp_group: object,
        config: KernelConfig,
    ) -> LogitsOptions:
        divergence, params = resolve_divergence(kl_divergence, kl_alpha, kl_beta, entropy_gate)
        return LogitsOptions(
            temperature=check_temperature("temperature", temperature),
            divergence=divergence,
            params=params,
            ignore_index=check_ignore_index(ignore_index),
            chunk_rows=chunk_rows,
            backend=check_choice("backend", backend, LOGITS_BACKENDS),
            tp_group=tp_group,
            config=config,
        )
