"""Keywords of the logits-level losses, validated once, and the :class:`LossPlan` they describe.

Both losses are planned as a frozen, cached teacher: the student receives the gradient, the
teacher's logits never do (``teacher_kind`` "precomputed_*", ``teacher_role`` "frozen"). The plan
then drives the same statistics and gradient code as the fused path.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

from ..config import KernelConfig
from ..divergences import Divergence, DivergenceParams
from ..plan import LossPlan
from ..validation import check_ignore_index, check_temperature, resolve_divergence, with_vocabulary

__all__ = ["LOGITS_BACKENDS", "LogitsOptions", "check_count", "check_flag", "logits_plan", "resolve_logits_options"]

#: Backends of the logits-level losses; "reference" builds logits from hidden states and has no
#: logits entry point.
LOGITS_BACKENDS = ("auto", "torch", "triton")


def check_flag(name: str, value: object) -> bool:
    """A real bool: a truthy string such as "no" must not read as True."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_count(name: str, value: object, minimum: int) -> int:
    """An int (not a bool) ≥ ``minimum``."""
    if not isinstance(value, Integral) or isinstance(value, bool) or int(value) < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class LogitsOptions:
    """The validated scalar keywords of a logits-level loss.

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


def resolve_logits_options(
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
    """Validate what every logits-level loss shares (each loss checks its own size keywords)."""
    divergence, params = resolve_divergence(kl_divergence, kl_alpha, kl_beta, entropy_gate)
    if backend not in LOGITS_BACKENDS:
        raise ValueError(f"backend must be one of {list(LOGITS_BACKENDS)}, got {backend!r}")
    return LogitsOptions(
        temperature=check_temperature("temperature", temperature),
        divergence=divergence,
        params=params,
        ignore_index=check_ignore_index(ignore_index),
        chunk_rows=chunk_rows,
        backend=backend,
        tp_group=tp_group,
        config=config,
    )


def logits_plan(
    options: LogitsOptions, student_ce_weight: float, reduction: str, teacher_kind: str, vocab_size: int
) -> LossPlan:
    """``loss = w_s·CE(s) + T²·D(p, q)`` with ``p = softmax(s/T)``, ``q = softmax(t/T)``; the
    teacher is frozen (no gradient reaches its logits, whatever the variant)."""
    return LossPlan(
        student_ce_weight=student_ce_weight,
        teacher_ce_weight=0.0,
        kl_weight=1.0,
        student_temperature=options.temperature,
        teacher_temperature=options.temperature,
        divergence=options.divergence,
        params=with_vocabulary(options.divergence, options.params, vocab_size),
        reduction=reduction,
        ignore_index=options.ignore_index,
        teacher_kind=teacher_kind,
        teacher_role="frozen",
        config=options.config,
    )
