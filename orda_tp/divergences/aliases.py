"""Names of ``kl_divergence`` that stand for a registered variant with its parameters mapped:
TRL's ``"generalized_jsd"`` (docs/variants.md, "TRL's generalized JSD"). An alias is resolved where
the variant is (``orda_tp.arguments.options.resolve_divergence``) and is then that variant: the
engine and the kernels never see it.
"""

from __future__ import annotations

from collections.abc import Mapping

from .base import Divergence, DivergenceParams, Real

__all__ = ["KL_BETA", "GeneralizedJSD"]

#: TRL's β, the teacher's weight in the mixture: both edges are variants of their own.
KL_BETA = Real("kl_beta", 0.5, low=0.0, high=1.0, low_open=False, high_open=False)


class GeneralizedJSD:
    """TRL's ``JSD(β) = β·KL(q‖m) + (1−β)·KL(p‖m)``, ``m = β·q + (1−β)·p``, with ``β = kl_beta``
    in [0, 1], closed: **the teacher's weight** in the mixture (TRL's ``beta``; its
    ``DistillationConfig`` defaults to 1.0, here 0.5). The edges are TRL's special cases, not the
    JSD's limits (which are 0): β = 0 is ``forward`` ``KL(q‖p)``, β = 1 ``reverse`` ``KL(p‖q)``;
    in between it is ``skew_js`` with ``kl_beta = 1 − β``, whose ``kl_beta`` weights the student.
    """

    name = "generalized_jsd"
    parameters = (KL_BETA,)
    keywords = ("kl_beta",)

    def __init__(self, forward: Divergence, reverse: Divergence, skew_js: Divergence) -> None:
        # The registry's own instances: the formulas and kernels are cached per variant instance.
        self.forward, self.reverse, self.skew_js = forward, reverse, skew_js

    def resolve(self, given: Mapping[str, object]) -> tuple[Divergence, DivergenceParams]:
        """The variant ``kl_beta`` (from ``given``; None: 0.5) selects, and its parameters."""
        value = given.get("kl_beta")
        beta = KL_BETA.check(KL_BETA.default if value is None else value, self.name)
        if beta == 0.0:
            return self.forward, DivergenceParams()
        if beta == 1.0:
            return self.reverse, DivergenceParams()
        student_weight = 1.0 - beta
        # A β ≤ 2^-54 (≈ 5.6e-17) rounds 1 − β to 1: skew_js's student weight would leave (0, 1).
        if student_weight == 1.0:
            raise ValueError(
                f"kl_beta={beta!r} is too small for kl_divergence={self.name!r}: 1 − kl_beta rounds to 1 (the JSD "
                "is then 0 up to rounding); pass kl_beta=0 for the forward KL, or a kl_beta of at least 1e-16"
            )
        return self.skew_js, self.skew_js.resolve({"kl_beta": student_weight})
