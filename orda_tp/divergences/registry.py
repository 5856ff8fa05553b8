"""The one table of KL variants, read by every backend."""

from __future__ import annotations

from .aliases import GeneralizedJSD
from .base import Divergence
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

# The registry's order, in which error messages list the variants.
KL_VARIANTS: tuple[str, ...] = tuple(DIVERGENCES)

#: Names of kl_divergence that stand for a registered variant with mapped parameters (docs/variants.md).
ALIASES: dict[str, GeneralizedJSD] = {
    alias.name: alias
    for alias in (GeneralizedJSD(DIVERGENCES["forward"], DIVERGENCES["reverse"], DIVERGENCES["skew_js"]),)
}

#: What kl_divergence may name, in the order error messages list them: the variants, then the aliases.
NAMED_VARIANTS: dict[str, Divergence | GeneralizedJSD] = {**DIVERGENCES, **ALIASES}

#: The loss keywords the variants read, each once, in the order of the variants that first read them.
VARIANT_KEYWORDS: tuple[str, ...] = tuple(
    dict.fromkeys(keyword for variant in DIVERGENCES.values() for keyword in variant.keywords)
)


def get_divergence(name: object) -> Divergence:
    """The registered variant called ``name``; a ValueError listing the variants otherwise."""
    if not isinstance(name, str) or name not in DIVERGENCES:
        raise ValueError(f"kl_divergence must be one of {list(KL_VARIANTS)}, got {name!r}")
    return DIVERGENCES[name]
