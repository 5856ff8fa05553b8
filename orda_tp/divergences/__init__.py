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
from .registry import DIVERGENCES, KL_VARIANTS, VARIANT_KEYWORDS, get_divergence

__all__ = [
    "DIVERGENCES",
    "Divergence",
    "DivergenceParams",
    "EntropyGate",
    "Finalized",
    "KL_VARIANTS",
    "LOG_VOCAB",
    "RowTargets",
    "VARIANT_KEYWORDS",
    "VariantFormulas",
    "formulas_of",
    "get_divergence",
]
