"""The student's entropy ``H(p) = −Σ_j p_j·log p_j`` at the KL temperature (``p = softmax(s/T_s)``,
after the soft-cap: the ``p`` of the KL), reported beside the loss and never differentiated: one
more column term of round 2, summed after the variant's (docs/reference.md, ``student_entropy``).
"""

from __future__ import annotations

from functools import cache

from .expr import LOGP, Expr, P, equal, where

__all__ = ["STUDENT_ENTROPY", "round_two_terms"]

#: ``−p·log p`` of a column, 0 where p = 0 (``0·log 0 = 0``: a −inf logit, or one that underflows, adds nothing).
STUDENT_ENTROPY = where(equal(P, 0.0), 0.0, -(P * LOGP))


@cache
def round_two_terms(variant_terms: tuple[Expr, ...], student_entropy: bool) -> tuple[Expr, ...]:
    """The column terms whose row sums round 2 collects: the variant's (``finalize`` reads the first
    ``num_sums`` sums; none without a KL term), then ``STUDENT_ENTROPY`` where the entropy is
    reported. Cached: a plan and the kernels built from the same trees hold the same tuple."""
    return (*variant_terms, STUDENT_ENTROPY) if student_entropy else variant_terms
