"""The keywords of a loss call, each validated once when the options are built (so
``DistillationLoss(...)`` fails at construction): :class:`LossOptions` (``distillation_loss``,
``DistillationLoss``) and :class:`LogitsOptions` (``KDLoss``, ``flash_ce_kd_loss``)."""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from typing import Literal, Protocol, TypeGuard

import torch.distributed as dist
from torch import Tensor

from ..divergences import NAMED_VARIANTS, VARIANT_KEYWORDS, Divergence, DivergenceParams, EntropyGate
from .config import PROFILES, ExecutionConfig
from .orda_kernel import apply_loss_overrides, own_config
from .validation import (
    IgnoredArgumentWarning,
    caller_stacklevel,
    check_choice,
    check_ignore_index,
    check_number,
    is_int,
)

__all__ = [
    "BACKENDS",
    "LOGITS_BACKENDS",
    "REDUCTIONS",
    "GradScalerLike",
    "LogitsOptions",
    "LossOptions",
    "check_loss_keywords",
    "resolve_divergence",
    "setting_text",
]

BACKENDS = ("auto", "triton", "torch", "reference")
#: The logits-level losses read logits; "reference" builds them from hidden states.
LOGITS_BACKENDS = tuple(name for name in BACKENDS if name != "reference")
REDUCTIONS = ("mean", "sum", "none")
PROFILE_NAMES = tuple(sorted(PROFILES))


def _reads(keywords: tuple[str, ...]) -> str:
    if not keywords:
        return f"none of {', '.join(VARIANT_KEYWORDS)}"
    return "only " + " and ".join(keywords)


def resolve_divergence(
    kl_divergence: object, given: Mapping[str, object], *, unused: Literal["raise", "warn"] = "raise"
) -> tuple[Divergence, DivergenceParams]:
    """The registered variant and its parameters (defaults filled, ranges checked) from ``given``,
    the call's variant keywords by name (:data:`~orda_tp.divergences.VARIANT_KEYWORDS`; None: not
    given); an alias (:data:`~orda_tp.divergences.ALIASES`) gives the variant it stands for.

    A parameter the variant does not read is neither checked nor used: with ``unused="warn"``
    (``distillation_loss``) it gives one :class:`IgnoredArgumentWarning`, with ``unused="raise"``
    (the logits-level losses) a ValueError.
    """
    divergence = NAMED_VARIANTS.get(kl_divergence) if isinstance(kl_divergence, str) else None
    if divergence is None:
        raise ValueError(f"kl_divergence must be one of {list(NAMED_VARIANTS)}, got {kl_divergence!r}")
    if isinstance(divergence, Divergence) and not divergence.parameters and all(v is None for v in given.values()):
        return divergence, DivergenceParams()  # the common case: nothing to resolve
    reads = divergence.keywords
    for keyword, value in given.items():
        if value is None or keyword in reads:
            continue
        if unused == "raise":
            raise ValueError(
                f"{keyword}={value!r} is not used by kl_divergence={divergence.name!r} "
                f"(it reads {list(reads) or 'no parameters'}); leave {keyword}=None"
            )
        warnings.warn(
            f"{keyword}={value!r} is ignored: kl_divergence={divergence.name!r} reads {_reads(divergence.keywords)}; "
            f"leave {keyword}=None to silence this warning",
            IgnoredArgumentWarning,
            stacklevel=caller_stacklevel(),
        )
    if isinstance(divergence, Divergence):
        return divergence, divergence.resolve(given)
    return divergence.resolve(given)  # an alias: the variant it stands for, and its parameters


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
    tensor that does not require grad (e.g. ``GradScaler.scale(torch.ones(()))``, used on the
    device as it is: its value is never read). ``grad_scaler``: None or a GradScaler."""
    scale: float | Tensor | None = None
    value = gradient_materialization_scale
    if isinstance(value, Tensor):
        if value.numel() != 1 or not value.is_floating_point() or value.requires_grad:
            raise ValueError(
                "gradient_materialization_scale must be a finite real number > 0 or a one-element floating-point "
                f"tensor that does not require grad, got a tensor of shape {tuple(value.shape)}, dtype "
                f"{value.dtype}, requires_grad={value.requires_grad}"
            )
        # Kept on the device as it is (a GradScaler's scale): reading it would synchronize.
        scale = value.reshape(())
    elif value is not None:
        scale = check_number("gradient_materialization_scale", value, positive=True)
    if grad_scaler is None or _is_grad_scaler(grad_scaler):
        return scale, grad_scaler
    received = f"the class {grad_scaler.__name__}" if isinstance(grad_scaler, type) else type(grad_scaler).__name__
    raise TypeError(f"grad_scaler must be a torch.amp.GradScaler instance or None, got {received}")


def check_group(group: object) -> dist.ProcessGroup | None:
    """``tp_group``: a process group or None."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"tp_group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    return group


@dataclass(frozen=True)
class LossOptions:
    """The keywords of :func:`orda_tp.distillation_loss` (see its docstring and docs/reference.md),
    validated and normalized at construction; ``divergence``, ``params`` (the variant and its
    parameters, resolved once) and ``kernel_config`` (``config``, or the ``profile``'s preset) are
    derived. orda-kernel's spellings in ``config`` are translated first (:mod:`orda_tp.arguments.orda_kernel`).
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
    label_smoothing: float = 0.0
    z_loss_weight: float = 0.0
    logit_softcap: float | None = None
    teacher_logit_softcap: float | None = None
    logit_scale: float = 1.0
    teacher_logit_scale: float = 1.0
    ignore_index: int = -100
    reduction: str = "mean"
    profile: str = "balanced"
    backend: str = "auto"
    config: ExecutionConfig | None = None
    gradient_materialization_scale: float | Tensor | None = None
    grad_scaler: GradScalerLike | None = None
    tp_group: dist.ProcessGroup | None = None
    vocab_range: tuple[int, int] | None = None
    vocab_size: int | None = None
    sequence_parallel: bool | None = None
    student_entropy: bool = False
    divergence: Divergence = field(init=False, repr=False, compare=False)
    params: DivergenceParams = field(init=False, repr=False, compare=False)
    kernel_config: ExecutionConfig = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        values = {spec.name: getattr(self, spec.name) for spec in fields(self) if spec.init}
        if values["config"] is not None:
            values = apply_loss_overrides(values, KEYWORD_DEFAULTS)  # a config's loss keywords win
        given = {keyword: values[keyword] for keyword in VARIANT_KEYWORDS}
        divergence, params = resolve_divergence(values["kl_divergence"], given, unused="warn")
        for name, positive in _NUMBERS.items():
            if values[name] is not None or name not in _OPTIONAL:
                values[name] = check_number(name, values[name], positive=positive)
        if values["label_smoothing"] >= 1:
            raise ValueError(f"label_smoothing must be in [0, 1), got {values['label_smoothing']!r}")
        if values["gradient_materialization_scale"] is not None or values["grad_scaler"] is not None:
            values["gradient_materialization_scale"], values["grad_scaler"] = check_precision(
                values["gradient_materialization_scale"], values["grad_scaler"]
            )
        named = NAMED_VARIANTS[values["kl_divergence"]]  # an alias keeps its name and its kl_beta
        for keyword, value in given.items():
            if value is not None and keyword not in named.keywords:
                values[keyword] = None  # not read by the variant: warned about, and dropped
        values["kl_divergence"] = named.name
        if not isinstance(values["student_entropy"], bool):  # a truthy "no" must not read as True
            raise TypeError(f"student_entropy must be a bool, got {values['student_entropy']!r}")
        values["ignore_index"] = check_ignore_index(values["ignore_index"])
        values["reduction"] = check_choice("reduction", values["reduction"], REDUCTIONS)
        values["backend"] = check_choice("backend", values["backend"], BACKENDS)
        if any(values[name] is not None for name in PARALLEL_KEYWORDS):
            _check_parallel_keywords(values)
        values["profile"] = check_choice("profile", values["profile"], PROFILE_NAMES)
        config = values["config"]
        if config is not None and not isinstance(config, ExecutionConfig):
            raise TypeError(f"config must be a KernelConfig or None, got {type(config).__name__}")
        kernel_config = PROFILES[values["profile"]] if config is None else own_config(config)
        # A co-training variant trains both sides through one KL: it takes one temperature (docs/variants.md).
        if values["kl_teacher_temperature"] not in (None, values["kl_temperature"]) and divergence.cotrains_teacher:
            raise ValueError(
                f"kl_divergence={divergence.name!r} needs kl_teacher_temperature == kl_temperature "
                f"({values['kl_temperature']!r}), got {values['kl_teacher_temperature']!r}"
            )
        derived = {"divergence": divergence, "params": params, "kernel_config": kernel_config}
        for name, value in {**values, **derived}.items():
            object.__setattr__(self, name, value)

    def with_precision(self, gradient_materialization_scale: object, grad_scaler: object) -> LossOptions:
        """These options with the given per-call precision arguments (None keeps the option's)."""
        scale, scaler = check_precision(gradient_materialization_scale, grad_scaler)
        if scale is None and scaler is None:
            return self
        return replace(self, gradient_materialization_scale=scale, grad_scaler=scaler)

    @cached_property  # the options are frozen: built once per DistillationLoss, read by every call
    def settings_text(self) -> str:
        """``name=value`` lines of the keywords that every rank of a tensor-parallel call must
        give alike (a tensor or GradScaler by its presence); the parallel keywords are compared
        by the handshake itself (``tp_group``, and ``vocab_range``, which differs per rank)."""
        lines = []
        for spec in fields(self):
            # The parallel keywords are the handshake's own; config is compared as the kernel_config it became.
            if spec.init and spec.name not in (*PARALLEL_KEYWORDS, "config"):
                lines.append(f"{spec.name}={setting_text(getattr(self, spec.name))}")
        lines.append(f"config={self.kernel_config!r}")
        return "\n".join(lines)

    @property
    def gradient_scale(self) -> float | Tensor | None:
        """The scale at which fp16 logit gradients are materialized for the gradient GEMMs: the
        given number or tensor, else the GradScaler's scale tensor (left on the device, never read)."""
        if self.gradient_materialization_scale is not None:
            return self.gradient_materialization_scale
        scaler = self.grad_scaler
        if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
            return None
        # The scaler's own device tensor, not get_scale(), which reads it on the host (a synchronization).
        scale = getattr(scaler, "_scale", None)
        if isinstance(scale, Tensor):
            return scale.reshape(())
        return float(scaler.get_scale())  # not yet initialized: its init scale


def setting_text(value: object) -> str:
    """A keyword's value as :meth:`LossOptions.settings_text` compares it across ranks."""
    if isinstance(value, Tensor):
        return "<tensor>"  # never read: that would synchronize with the device
    if value is not None and _is_grad_scaler(value):
        return "<grad_scaler>"
    return repr(value)


KEYWORD_DEFAULTS: dict[str, object] = {spec.name: spec.default for spec in fields(LossOptions) if spec.init}


def check_loss_keywords(door: str, keywords: Mapping[str, object]) -> None:
    """Python's TypeError for a keyword :class:`LossOptions` does not take, naming ``door`` (what the
    user called, not ``LossOptions.__init__``) and the closest loss keyword."""
    for keyword in keywords:
        if keyword not in KEYWORD_DEFAULTS:
            close = difflib.get_close_matches(keyword, KEYWORD_DEFAULTS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{door}() got an unexpected keyword argument {keyword!r}{hint}")


# The numeric keywords, and whether each must be > 0 (else ≥ 0); the optional ones may be None.
_NUMBERS = {
    "student_ce_weight": False,
    "teacher_ce_weight": False,
    "kl_weight": False,
    "kl_temperature": True,
    "kl_teacher_temperature": True,
    "label_smoothing": False,
    "z_loss_weight": False,
    "logit_softcap": True,
    "teacher_logit_softcap": True,
    "logit_scale": True,
    "teacher_logit_scale": True,
}
_OPTIONAL = ("teacher_ce_weight", "kl_teacher_temperature", "logit_softcap", "teacher_logit_softcap")
PARALLEL_KEYWORDS = ("tp_group", "vocab_range", "vocab_size", "sequence_parallel")


def _check_parallel_keywords(values: dict[str, object]) -> None:
    """The tensor-parallel keywords of ``values``, checked and normalized in place (the group's
    ranks are checked by the call, against its tensors)."""
    vocab_range, vocab_size, sequence_parallel = (
        values["vocab_range"],
        values["vocab_size"],
        values["sequence_parallel"],
    )
    if values["tp_group"] is not None:
        check_group(values["tp_group"])
    if vocab_range is not None:
        if (
            not isinstance(vocab_range, (tuple, list))
            or len(vocab_range) != 2
            or not all(is_int(v) for v in vocab_range)
            or not 0 <= vocab_range[0] <= vocab_range[1]
        ):
            raise ValueError(
                f"vocab_range must be a pair of ints (start, stop) with 0 <= start <= stop, got {vocab_range!r}"
            )
        values["vocab_range"] = (int(vocab_range[0]), int(vocab_range[1]))
    if vocab_size is not None:
        if not is_int(vocab_size) or int(vocab_size) < 1:
            raise ValueError(f"vocab_size must be a positive int or None, got {vocab_size!r}")
        values["vocab_size"] = int(vocab_size)
    if sequence_parallel is not None and not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be a bool or None, got {sequence_parallel!r}")


@dataclass(frozen=True)
class LogitsOptions:
    """The validated keywords every logits-level loss shares (each loss checks its own sizes).

    ``config.chunk_size.nrows``: rows per chunk (None: from the default workspace,
    ``engine.workspace.row_layout``); ``config.vocab_block``: columns per block of the torch
    backend.
    """

    temperature: float
    divergence: Divergence
    params: DivergenceParams
    ignore_index: int
    backend: str
    tp_group: object
    config: ExecutionConfig

    @cached_property  # the options are frozen: built once per KDLoss, read by every call
    def settings_text(self) -> str:
        """``name=value`` lines of what every rank of a tensor-parallel call must give alike."""
        values = {
            "temperature": self.temperature,
            "kl_divergence": self.divergence.name,
            "params": self.params,
            "ignore_index": self.ignore_index,
            "backend": self.backend,
            "config": self.config,
        }
        return "\n".join(f"{name}={value!r}" for name, value in values.items())

    @staticmethod
    def resolve(
        *,
        temperature: object,
        kl_divergence: object,
        ignore_index: object,
        backend: object,
        tp_group: object,
        config: ExecutionConfig,
        **variant_parameters: object,
    ) -> LogitsOptions:
        """The options of a logits-level loss; ``variant_parameters``: its variant keywords as the
        loss received them (``kl_alpha=``, …; None: not given), a keyword its variant does not read
        raising."""
        # A keyword no variant reads is a TypeError, as Python's own for an unexpected keyword argument.
        unknown = [keyword for keyword in variant_parameters if keyword not in VARIANT_KEYWORDS]
        if unknown:
            raise TypeError(
                f"got an unexpected keyword argument {unknown[0]!r} (the variant keywords are {list(VARIANT_KEYWORDS)})"
            )
        divergence, params = resolve_divergence(kl_divergence, variant_parameters)
        return LogitsOptions(
            temperature=check_number("temperature", temperature, positive=True),
            divergence=divergence,
            params=params,
            ignore_index=check_ignore_index(ignore_index),
            backend=check_choice("backend", backend, LOGITS_BACKENDS),
            tp_group=tp_group,
            config=config,
        )
