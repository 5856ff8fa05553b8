"""KL variants: each defined once (statistics, finalize, gradient) and shared by all backends."""

from .base import (
    LOG_VOCAB,
    Divergence,
    DivergenceParams,
    EntropyGate,
    Finalized,
    RowTargets,
    VariantFormulas,
    formulas_of,
)
from .registry import ALIASES, DIVERGENCES, KL_VARIANTS, NAMED_VARIANTS, VARIANT_KEYWORDS, get_divergence

__all__ = [
    "ALIASES",
    "DIVERGENCES",
    "Divergence",
    "DivergenceParams",
    "EntropyGate",
    "Finalized",
    "KL_VARIANTS",
    "LOG_VOCAB",
    "NAMED_VARIANTS",
    "RowTargets",
    "VARIANT_KEYWORDS",
    "VariantFormulas",
    "formulas_of",
    "get_divergence",
]
