"""KL variants: each defined once (statistics, finalize, gradient) and shared by all backends."""

from .base import BlockTerms, Divergence, DivergenceParams, EntropyGate, Finalized, RowTargets
from .registry import DIVERGENCES, KL_VARIANTS, get_divergence

__all__ = [
    "BlockTerms",
    "DIVERGENCES",
    "Divergence",
    "DivergenceParams",
    "EntropyGate",
    "Finalized",
    "KL_VARIANTS",
    "RowTargets",
    "get_divergence",
]
