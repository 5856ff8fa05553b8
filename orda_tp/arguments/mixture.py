"""What a :class:`orda_tp.TeacherMixture` call reads of each teacher: :class:`MemberPlan`, and the
mixture's :class:`MixturePlan` (``LossPlan.mixture``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MemberPlan", "MixturePlan"]


@dataclass(frozen=True)
class MemberPlan:
    """One teacher's logits as the mixture reads them: ``v = cap(scale·(h·Wᵀ + b))/temperature``
    (a cache's values divided by ``temperature`` only)."""

    kind: str  # its TeacherSource.kind
    temperature: float
    softcap: float | None
    scale: float


@dataclass(frozen=True)
class MixturePlan:
    """``combine`` (``TeacherMixture.COMBINE_MODES``), the call's ``form`` ("linear": one block
    Σ_i w_i·v_i read as one teacher at temperature 1) and each teacher's :class:`MemberPlan`."""

    combine: str
    form: str
    members: tuple[MemberPlan, ...]
