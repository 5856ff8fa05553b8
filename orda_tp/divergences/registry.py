"""The one table of KL variants, read by every backend, and how a call's keywords select one."""

from __future__ import annotations

import math
import warnings
from typing import Literal

from ..arguments import IgnoredArgumentWarning, caller_stacklevel
from .base import Divergence, DivergenceParams
from .contrast import DecoupledKD, Triangular
from .kl_family import CoJeffreys, EntropyAdaptive, Forward, Jeffreys, Mutual, Reverse
from .power import ABDivergence, AlphaDivergence, Renyi, RenyiReverse
from .skew import SkewForward, SkewJS, SkewReverse

DIVERGENCES: dict[str, Divergence] = {
    variant.name: variant
    for variant in (
        Forward(),
        Reverse(),
        Jeffreys(),
        Mutual(),
        CoJeffreys(),
        AlphaDivergence(),
        SkewForward(),
        SkewReverse(),
        SkewJS(),
        EntropyAdaptive(),
        Renyi(),
        RenyiReverse(),
        DecoupledKD(),
        ABDivergence(),
        Triangular(),
    )
}

KL_VARIANTS: tuple[str, ...] = tuple(DIVERGENCES)


def get_divergence(name: object) -> Divergence:
    """The registered variant called ``name``; a ValueError listing the variants otherwise."""
    if not isinstance(name, str) or name not in DIVERGENCES:
        raise ValueError(f"kl_divergence must be one of {list(KL_VARIANTS)}, got {name!r}")
    return DIVERGENCES[name]


VARIANT_PARAMETERS = ("kl_alpha", "kl_beta", "entropy_gate")  # the order of Divergence.resolve's arguments


def _reads(divergence: Divergence) -> str:
    if not divergence.parameters:
        return f"none of {', '.join(VARIANT_PARAMETERS)}"
    return "only " + " and ".join(divergence.parameters)


def resolve_divergence(
    kl_divergence: object,
    kl_alpha: object,
    kl_beta: object,
    entropy_gate: object,
    *,
    unused: Literal["raise", "warn"] = "raise",
) -> tuple[Divergence, DivergenceParams]:
    """The registered variant and its parameters (defaults filled, ranges checked).

    A parameter the variant does not read is neither checked nor used: with ``unused="warn"``
    (``distillation_loss``, as orda-kernel accepts it) it gives one :class:`IgnoredArgumentWarning`,
    with ``unused="raise"`` (the logits-level losses) a ValueError.
    """
    divergence = get_divergence(kl_divergence)
    given = dict(zip(VARIANT_PARAMETERS, (kl_alpha, kl_beta, entropy_gate)))
    for keyword, value in given.items():
        if value is None or keyword in divergence.parameters:
            continue
        if unused == "raise":
            raise ValueError(
                f"{keyword}={value!r} is not used by kl_divergence={divergence.name!r} "
                f"(it reads {list(divergence.parameters) or 'no parameters'}); leave {keyword}=None"
            )
        warnings.warn(
            f"{keyword}={value!r} is ignored: kl_divergence={divergence.name!r} reads {_reads(divergence)}; "
            f"leave {keyword}=None to silence this warning",
            IgnoredArgumentWarning,
            stacklevel=caller_stacklevel(),
        )
        given[keyword] = None
    return divergence, divergence.resolve(*given.values())


def with_vocabulary(divergence: Divergence, params: DivergenceParams, vocab_size: int) -> DivergenceParams:
    """``params`` completed by what the variant reads of the global real vocabulary: ``log V``,
    the normalizer of ``entropy_adaptive``'s gate (which needs V ≥ 2)."""
    if divergence.name != "entropy_adaptive":
        return params
    if vocab_size < 2:
        raise ValueError(f"kl_divergence='entropy_adaptive' needs a vocabulary of at least 2 columns, got {vocab_size}")
    return DivergenceParams(params.alpha, params.beta, params.gate, math.log(vocab_size))
