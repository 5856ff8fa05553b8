"""The plan of a :class:`orda_tp.TeacherMixture` call: :func:`mixture_plan` refuses what a mixture
cannot be (a trained teacher), checks each teacher as the one-teacher plan would, and returns the
``LossPlan`` of one teacher read at temperature 1 (the mixture's formed block) with its
:class:`~orda_tp.arguments.mixture.MixturePlan`."""

from __future__ import annotations

from dataclasses import replace

from ..teachers import TeacherSource, TiedTeacher
from ..teachers.mixture import TeacherMixture
from .mixture import MemberPlan, MixturePlan
from .options import LossOptions
from .plan import LossPlan, _cache_temperature, _check_cache

__all__ = ["mixture_plan"]


def _refuse_training(options: LossOptions, members: list[TeacherSource]) -> None:
    """A mixture's teachers are frozen: every way the loss would train one raises."""
    if options.teacher_ce_weight is not None and options.teacher_ce_weight > 0:
        raise ValueError(
            f"teacher_ce_weight={options.teacher_ce_weight} trains a teacher, but a TeacherMixture's teachers are "
            "frozen; pass teacher_ce_weight=0.0 (or leave it None)"
        )
    if options.divergence.cotrains_teacher:
        raise ValueError(
            f"kl_divergence={options.divergence.name!r} co-trains the teacher, but a TeacherMixture's teachers are "
            "frozen; use a teacher-detached variant such as 'jeffreys'"
        )
    for index, member in enumerate(members):
        if isinstance(member, TiedTeacher) and member.mode not in (None, "frozen"):
            raise ValueError(
                f"TeacherMixture.teachers[{index}] is a TiedTeacher(mode={member.mode!r}), but a TeacherMixture's "
                "teachers are frozen; pass mode='frozen' or None"
            )


def _member_plan(options: LossOptions, member: TeacherSource, vocab_size: int) -> MemberPlan:
    """How the mixture reads ``member``: as a one-teacher call of the same keywords would, frozen."""
    given = options.kl_teacher_temperature
    temperature = options.kl_temperature if given is None else given
    if isinstance(member, TiedTeacher) and options.teacher_logit_scale != options.logit_scale:
        scales = f"teacher_logit_scale={options.teacher_logit_scale!r} and logit_scale={options.logit_scale!r}"
        raise ValueError(f"a TiedTeacher reads the student's head, whose logits have one scale; got {scales}")
    if not member.trainable:
        _check_cache(options, member, 0.0)
        temperature = _cache_temperature(options, member, 0.0, vocab_size)
    cap = options.teacher_logit_softcap if member.reads_head else None
    return MemberPlan(member.kind, temperature, cap, options.teacher_logit_scale if member.reads_head else 1.0)


def mixture_plan(options: LossOptions, mixture: TeacherSource, vocab_size: int) -> LossPlan:
    """The plan of a call on a prepared :class:`TeacherMixture` (``TeacherMixture.prepared``)."""
    assert isinstance(mixture, TeacherMixture) and mixture.routing is not None
    members = mixture.members()
    _refuse_training(options, members)
    plans = []
    for index, member in enumerate(members):
        try:
            plans.append(_member_plan(options, member, vocab_size))
        except ValueError as error:
            raise ValueError(f"TeacherMixture.teachers[{index}]: {error}") from error
    form = mixture.routing.form
    # The formed block is one teacher read as it is: at temperature 1, uncapped, unscaled (each teacher's own).
    one_teacher = LossPlan.build(options, mixture, vocab_size)
    return replace(
        one_teacher,
        teacher_temperature=1.0,
        teacher_softcap=None,
        teacher_scale=1.0,
        mixture=MixturePlan(mixture.combine, form, tuple(plans)),
    )
