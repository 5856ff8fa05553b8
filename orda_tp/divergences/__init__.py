"""KL variants: each defined once (statistics, finalize, gradient) and shared by all backends."""

from .base import Divergence, DivergenceParams, EntropyGate, Finalized, RowTargets, VariantFormulas, formulas_of
from .registry import DIVERGENCES, KL_VARIANTS, get_divergence

__all__ = [
    "DIVERGENCES",
    "Divergence",
    "DivergenceParams",
    "EntropyGate",
    "Finalized",
    "KL_VARIANTS",
    "RowTargets",
    "VariantFormulas",
    "formulas_of",
    "get_divergence",
]
