"""The resolved plan of one loss call (:class:`LossPlan`): weights, temperatures, variant, teacher
routing, and what the engine reads of them, derived once."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..divergences import Divergence, DivergenceParams, VariantFormulas, formulas_of
from ..divergences.entropy import round_two_terms
from ..divergences.expr import Expr, equal, greater, logical_and, where
from ..divergences.terms import RAW_STUDENT, RAW_TEACHER, STUDENT_TERMS, CrossEntropy, StudentTerm, column_sums_of
from ..teachers import TeacherSource
from .config import ExecutionConfig
from .mixture import MixturePlan
from .options import LogitsOptions, LossOptions

__all__ = ["UNSUPPORTED", "LogitFamily", "LossPlan", "StepKey", "check_sparse_teacher"]


@dataclass(frozen=True)
class LogitFamily:
    """One side's logits divided by one temperature: ``x = logits/temperature``."""

    side: str  # "student" or "teacher"
    temperature: float


def _check_tempered_cache(options: LossOptions, tempered: float, teacher_ce_weight: float) -> None:
    """A cache of logits already divided by ``tempered`` is used as it is:
    it cannot give the teacher CE (``LSE(t) − t_y`` on raw logits), nor another temperature."""
    if teacher_ce_weight > 0:
        raise ValueError(
            f"teacher_ce_weight={teacher_ce_weight} needs raw teacher logits, but "
            f"PrecomputedTeacher(logits_temperature={tempered!r}) declares a cache already "
            "divided by that temperature, from which the teacher CE cannot be formed; pass teacher_ce_weight=0.0, "
            "or pass the raw logits without logits_temperature (the KL then divides them by kl_teacher_temperature)"
        )
    if options.kl_teacher_temperature not in (None, tempered):
        raise ValueError(
            f"kl_teacher_temperature={options.kl_teacher_temperature!r} disagrees with "
            f"PrecomputedTeacher(logits_temperature={tempered!r}), a cache already divided by {tempered!r}; "
            "leave kl_teacher_temperature=None (the cache is used as it is), or pass the raw logits "
            "without logits_temperature"
        )


def _cache_temperature(
    options: LossOptions, teacher: TeacherSource, teacher_ce_weight: float, vocab_size: int
) -> float:
    """What the loss divides a cache's values by: 1 for a cache of logits already divided by a
    temperature (used as it is); for a top-k cache, the ratio of the loss's teacher temperature
    (``kl_teacher_temperature``, else ``kl_temperature``) to the one it was made at (1: as it is),
    where the cache allows it; else the loss's teacher temperature."""
    tempered = teacher.cache_temperature
    if tempered is not None:
        _check_tempered_cache(options, tempered, teacher_ce_weight)
        return 1.0
    given = options.kl_teacher_temperature
    temperature = options.kl_temperature if given is None else given
    made_at = teacher.made_at_temperature
    if made_at is None:
        return temperature
    # The teacher CE reads the teacher at T = 1: a cache made at another one cannot give it.
    if teacher_ce_weight > 0 and made_at != 1.0:
        raise ValueError(
            f"teacher_ce_weight={teacher_ce_weight} asks for the teacher CE at temperature 1, but the top-k cache "
            f"was made at topk_temperature={made_at!r}; pass teacher_ce_weight=0.0"
        )
    if options.kl_weight > 0:
        teacher.check_read_at(temperature, vocab_size)
    return temperature / made_at


def check_sparse_teacher(divergence: Divergence, params: DivergenceParams) -> None:
    """Refuse a variant that is +inf on every row of a teacher without mass outside its top-k ids
    (a ``PrecomputedTeacher(tail="renormalize")``, for the fused and the logits-level losses)."""
    if divergence.infinite_without_support(params):
        raise ValueError(
            f"kl_divergence={divergence.name!r} is +inf on every row whose teacher has no mass on a column, and "
            "a PrecomputedTeacher(tail='renormalize') has none outside its top-k ids; use tail='uniform' "
            "(the missing mass spread over the other columns) or a variant that stays finite there, such as "
            "'forward', 'skew_reverse' or 'dkd' (docs/variants.md, \"Top-k teacher caches\")"
        )


def _check_cache(options: LossOptions, teacher: TeacherSource, teacher_ce_weight: float) -> None:
    """What a cache cannot give: a soft-cap of logits it holds (they are taken as capped); and,
    for a teacher without mass on most columns (a renormalized top-k cache), the variants that are
    +inf there and the teacher CE, +inf on every row."""
    if options.teacher_logit_scale != 1.0 and not teacher.reads_head:
        raise ValueError(
            f"teacher_logit_scale={options.teacher_logit_scale!r} scales logits a teacher head forms, but this "
            f"{teacher.kind} cache holds logits already formed; scale them when you build the cache and leave "
            "teacher_logit_scale=1.0"
        )
    capped = options.teacher_logit_softcap
    if capped is not None and teacher.made_at_softcap is not None and capped != teacher.made_at_softcap:
        raise ValueError(
            f"teacher_logit_softcap={capped!r} disagrees with the top-k cache's topk_softcap="
            f"{teacher.made_at_softcap!r}, the soft-cap it was made with; leave teacher_logit_softcap=None"
        )
    if capped is not None and teacher.made_at_softcap is None and not teacher.reads_head:
        raise ValueError(
            f"teacher_logit_softcap={options.teacher_logit_softcap!r} caps logits a teacher head forms, but "
            f"this {teacher.kind} cache is taken as already capped; cap the cache when you build it and "
            "leave teacher_logit_softcap=None"
        )
    if not teacher.sparse_support:
        return
    if options.kl_weight > 0:
        check_sparse_teacher(options.divergence, options.params)
    if teacher_ce_weight > 0:
        raise ValueError(
            f"teacher_ce_weight={teacher_ce_weight} asks for the teacher CE −log q_y, which is +inf on every row "
            "whose label is not among the top-k ids of a PrecomputedTeacher(tail='renormalize'); pass "
            "teacher_ce_weight=0.0 or use tail='uniform'"
        )


@dataclass(frozen=True)
class StepKey:
    """What a call's row programs (:mod:`orda_tp.engine.row_formulas`) depend on: its structure, never
    its weights or temperatures."""

    num_families: int
    student_terms: tuple[StudentTerm, ...]  # orda_tp.divergences.terms
    num_column_sums: int  # the column sums of round 1's record
    # Indices into LossPlan.families, None where the call has none: the student's family at T = 1 (its row
    # terms'), the teacher's CE family, the KL's two (the student's also the entropy's), the first teacher family.
    terms_family: int | None
    ce_teacher: int | None
    kl_student: int | None
    kl_teacher: int | None
    teacher_family: int | None
    unsupported_sum: int | None = None  # the column sum that counts UNSUPPORTED columns, None where none does
    teacher_ce_trains: bool = False  # the teacher's CE trains the teacher
    variant_constants: tuple[str, ...] = ()  # the variant's finalize constants that its gradients read


#: A column where the student's logit is −inf and the teacher's is not: ``p = 0 < q`` there, so a
#: KL weighted by ``q`` (``forward``) is +inf on its row. Counted by round 1 where a variant sums
#: round 2 in the gradient pass on given logits (``LossPlan.kl_sums_in_gradient_pass``), so that
#: the gradient knows ``keep`` before ``D``.
UNSUPPORTED = where(logical_and(equal(RAW_STUDENT, -math.inf), greater(RAW_TEACHER, -math.inf)), 1.0, 0.0)


@dataclass(frozen=True)
class LossPlan:
    """What to compute for ``loss = Σ_k w_k·L_k(s) + w_t·CE_t + w_kl·T_s²·D(p, q)``, built once per
    call by :meth:`build` or :meth:`for_logits`: the engine reads the plan and never re-derives
    routing or defaults. The ``init=False`` fields are derived from the others in ``__post_init__``.
    """

    # The student's row terms L_k whose weight is > 0 (orda_tp.divergences.terms: its CE, z-loss), their
    # weights w_k, and the runtime values their formulas read (their parameters; inv_vocab = 1/V, added below).
    student_terms: tuple[StudentTerm, ...]
    term_weights: tuple[float, ...]
    term_scalars: dict[str, float]
    teacher_ce_weight: float
    kl_weight: float
    student_temperature: float
    teacher_temperature: float
    divergence: Divergence | None
    params: DivergenceParams
    vocab_size: int  # the global real vocabulary
    reduction: str
    ignore_index: int
    teacher_kind: str  # "tied", "separate", "precomputed_logits", "precomputed_hidden", "precomputed_topk", "mixture"
    # docs/variants.md, "Teacher routing": "cotrained" when a co-training variant (mutual, cojeffreys) has
    # kl_weight > 0; else "trained" when teacher_ce_weight > 0; else "frozen".
    teacher_role: str
    config: ExecutionConfig
    teacher_trainable: bool  # whether a loss term may send the teacher a gradient (not a cache)
    # Soft-caps c of each side's logits (c·tanh(z/c)), None for none; never a cache's (taken as capped).
    student_softcap: float | None = None
    teacher_softcap: float | None = None
    student_scale: float = 1.0  # each side's logit scale, before its cap: cap(scale·(h·Wᵀ + b))
    teacher_scale: float = 1.0
    # The student's logits are a head's products (finite for finite inputs), not given logits that may hold −inf.
    student_logits_finite: bool = True
    student_entropy: bool = False  # report H(p) at T_s (round 2's last column term), with or without a KL
    mixture: MixturePlan | None = None  # a TeacherMixture's teachers (arguments.mixture_plan), None for one teacher
    # Derived once from the fields above (read at every chunk, so not recomputed there).
    # The KL's round 2 and gradients run only with kl_weight > 0 and a variant (round 2 also for the entropy).
    computes_kl: bool = field(init=False)
    # Only the KL and the teacher CE read the teacher's logits: without them none are formed, no cache value read.
    needs_teacher_logits: bool = field(init=False)
    # A trainable teacher co-trained by the KL or trained by its CE; a cache never receives a gradient.
    teacher_receives_grad: bool = field(init=False)
    # A TiedTeacher reads the student's head: one GEMM gives both sides' logits, and the teacher's head
    # gradient goes to the student's weight.
    tied_head: bool = field(init=False)
    # A value check can fail (a cache's: modified in place, non-finite where read; or check_finite_inputs').
    # Decided by the teacher's kind and the keywords, so alike on every rank: the first record exchange has
    # one width on every rank, and where it is False nothing is read on the host.
    checks_values: bool = field(init=False)
    # The KL's ∂D/∂v reaches the teacher only for a co-training variant and a trainable teacher.
    kl_trains_teacher: bool = field(init=False)
    # The teacher CE's gradient reaches a trainable teacher; a cache's CE is reported, not differentiated.
    teacher_ce_trains_teacher: bool = field(init=False)
    # The head inputs a gradient is routed to, in GradNeeds' order (student hidden, weight, teacher hidden,
    # teacher weight, bias, teacher bias): only the row terms and the KL differentiate the student's logits,
    # and a tied teacher's head gradient goes to the student's weight and bias.
    gradient_routes: tuple[bool, bool, bool, bool, bool, bool] = field(init=False)
    # Each output component's weight, loss = Σ w·component: every backend sums the components so.
    component_weights: dict[str, float] = field(init=False)
    # (w_kl·T_s, w_kl·T_s²/T_t): the factors of ∂D/∂u in ∂loss/∂s and of ∂D/∂v in ∂loss/∂t (u = s/T_s,
    # v = t/T_t), before the row scale.
    kl_grad_weights: tuple[float, float] = field(init=False)
    # The column terms of round 1's record: the student terms' sums, then UNSUPPORTED where it is counted.
    column_sums: tuple[Expr, ...] = field(init=False)
    # The distinct logit families whose log-partitions round 1 computes, deduplicated: a side whose KL
    # temperature is 1 has one family for its CE and its KL, whose LSE round 1 computes once.
    families: tuple[LogitFamily, ...] = field(init=False)
    # The call's structure, never its weights or temperatures: a new value builds no new row program.
    step_key: StepKey = field(init=False)
    # The variant's trees for these parameters (cached per variant and parameters); None without a KL term.
    formulas: VariantFormulas | None = field(init=False)
    # The column terms round 2 sums (divergences.entropy): the variant's, then the entropy's; none: no round 2.
    round_two_terms: tuple[Expr, ...] = field(init=False)
    # Round 2 summed by the gradient pass itself (one pass over the logits fewer) where the gradients read no
    # round-2 constant and keep is known after round 1: D is +inf only on a row with a counted UNSUPPORTED
    # column (a trainable teacher's head has no −inf column, or the variant is finite without teacher support).
    kl_sums_in_gradient_pass: bool = field(init=False)

    def __post_init__(self) -> None:
        # What the formulas read of the global real vocabulary: the terms' 1/V (inf for an empty
        # vocabulary, which the call's checks refuse) and log V where the variant reads it.
        inv_vocab = 1.0 / self.vocab_size if self.vocab_size else math.inf
        object.__setattr__(self, "term_scalars", {**self.term_scalars, "inv_vocab": inv_vocab})
        if self.divergence is not None and self.divergence.reads_log_vocab:
            object.__setattr__(self, "params", self.divergence.with_log_vocab(self.params, self.vocab_size))
        computes_kl = self.kl_weight > 0 and self.divergence is not None
        teacher_trains = self.teacher_trainable and (
            self.teacher_role == "cotrained" or (self.teacher_role == "trained" and self.teacher_ce_weight > 0)
        )
        teacher_ce_trains = teacher_trains and self.teacher_ce_weight > 0
        kl_student = self.kl_weight * self.student_temperature
        ce_families = LogitFamily("student", 1.0), LogitFamily("teacher", 1.0)
        kl_families = LogitFamily("student", self.student_temperature), LogitFamily("teacher", self.teacher_temperature)
        wanted = [ce_families[0]] if self.student_terms else []
        wanted += [ce_families[1]] if self.teacher_ce_weight > 0 else []
        wanted += list(kl_families) if computes_kl else [kl_families[0]] if self.student_entropy else []
        families = tuple(dict.fromkeys(wanted))
        head = (student := bool(self.student_terms) or computes_kl) or (self.teacher_kind == "tied" and teacher_trains)
        formulas = formulas_of(self.divergence, self.params) if computes_kl and self.divergence else None
        in_gradient_pass = bool(formulas and not formulas.row_names) and (
            self.teacher_trainable or not (self.divergence and self.divergence.infinite_without_support(self.params))
        )
        # Logits that may hold −inf: round 1 counts the columns where p = 0 < q, whose rows' D is +inf.
        counts_unsupported = in_gradient_pass and not self.student_logits_finite
        column_sums = column_sums_of(self.student_terms) + ((UNSUPPORTED,) if counts_unsupported else ())
        step_key = StepKey(
            num_families=len(families),
            student_terms=self.student_terms,
            num_column_sums=len(column_sums),
            terms_family=families.index(ce_families[0]) if self.student_terms else None,
            ce_teacher=families.index(ce_families[1]) if self.teacher_ce_weight > 0 else None,
            kl_student=families.index(kl_families[0]) if computes_kl or self.student_entropy else None,
            kl_teacher=families.index(kl_families[1]) if computes_kl else None,
            teacher_family=next((i for i, family in enumerate(families) if family.side == "teacher"), None),
            unsupported_sum=len(column_sums) - 1 if counts_unsupported else None,
            teacher_ce_trains=teacher_ce_trains,
            variant_constants=formulas.row_names if formulas else (),
        )
        derived = {
            "computes_kl": computes_kl,
            "needs_teacher_logits": computes_kl or self.teacher_ce_weight > 0,
            "teacher_receives_grad": teacher_trains,
            "tied_head": self.teacher_kind == "tied",
            "checks_values": not self.teacher_trainable or self.config.check_finite_inputs,
            "kl_trains_teacher": self.teacher_role == "cotrained" and teacher_trains,
            "teacher_ce_trains_teacher": teacher_ce_trains,
            "gradient_routes": (student, head, teacher_trains, teacher_trains, head, teacher_trains),
            "component_weights": {
                **{term.name: weight for term, weight in zip(self.student_terms, self.term_weights)},
                **{"teacher_ce": self.teacher_ce_weight, "kl": self.kl_weight},
            },
            "kl_grad_weights": (kl_student, kl_student * self.student_temperature / self.teacher_temperature),
            "column_sums": column_sums,
            "families": families,
            "step_key": step_key,
            "formulas": formulas,
            "round_two_terms": round_two_terms(formulas.column_terms if formulas else (), self.student_entropy),
            "kl_sums_in_gradient_pass": in_gradient_pass,
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @staticmethod
    def build(options: LossOptions, teacher: TeacherSource, vocab_size: int) -> LossPlan:
        """The plan of a :func:`orda_tp.distillation_loss` call (docs/variants.md, "Teacher routing")."""
        divergence = options.divergence
        if teacher.kind == "tied" and options.teacher_logit_scale != options.logit_scale:  # one head, one scale
            scales = f"teacher_logit_scale={options.teacher_logit_scale!r} and logit_scale={options.logit_scale!r}"
            raise ValueError(f"a TiedTeacher reads the student's head, whose logits have one scale; got {scales}")
        if divergence.cotrains_teacher and not teacher.trainable:
            raise ValueError(
                f"kl_divergence={divergence.name!r} trains the teacher and needs a TiedTeacher or SeparateTeacher; "
                "got a PrecomputedTeacher (use a teacher-detached variant such as 'jeffreys')"
            )
        teacher_ce_weight = (
            teacher.default_ce_weight if options.teacher_ce_weight is None else options.teacher_ce_weight
        )
        given = options.kl_teacher_temperature
        teacher_temperature = options.kl_temperature if given is None else given
        if not teacher.trainable:
            _check_cache(options, teacher, teacher_ce_weight)
            teacher_temperature = _cache_temperature(options, teacher, teacher_ce_weight, vocab_size)
        if divergence.cotrains_teacher and options.kl_weight > 0:
            role = "cotrained"
        elif teacher_ce_weight > 0:
            role = "trained"
        else:
            role = "frozen"
        if teacher.mode is not None and teacher.mode != role:  # the role the descriptor asserts
            weights = f"teacher_ce_weight={teacher_ce_weight}, kl_weight={options.kl_weight}"
            raise ValueError(
                f"{type(teacher).__name__}.mode={teacher.mode!r} but the loss weights make the teacher {role!r} "
                f"({weights}, kl_divergence={divergence.name!r})"
            )
        # The registered terms whose weight is > 0, each with its nonzero parameters.
        terms = [
            term(frozenset(name for name in term.parameters if getattr(options, name)))
            for term in STUDENT_TERMS
            if getattr(options, term.weight) > 0
        ]
        scalars = {name: float(getattr(options, name)) for term in terms for name in term.given}
        return LossPlan(
            student_terms=tuple(terms),
            term_weights=tuple(getattr(options, term.weight) for term in terms),
            term_scalars=scalars,
            teacher_ce_weight=teacher_ce_weight,
            kl_weight=options.kl_weight,
            student_temperature=options.kl_temperature,
            teacher_temperature=teacher_temperature,
            divergence=divergence,
            params=options.params,
            vocab_size=vocab_size,
            reduction=options.reduction,
            ignore_index=options.ignore_index,
            teacher_kind=teacher.kind,
            teacher_role=role,
            teacher_trainable=teacher.trainable,
            config=options.kernel_config,
            student_softcap=options.logit_softcap,
            # A cache holds capped values already (a top-k cache may declare its cap, the loss's alike).
            teacher_softcap=options.teacher_logit_softcap if teacher.reads_head else None,
            student_scale=options.logit_scale,
            teacher_scale=options.teacher_logit_scale,
            student_entropy=options.student_entropy,
        )

    @staticmethod
    def for_logits(
        options: LogitsOptions,
        student_ce_weight: float,
        reduction: str,
        teacher_kind: str,
        vocab_size: int,
        cache: TeacherSource | None = None,
    ) -> LossPlan:
        """``loss = w_s·CE(s) + T²·D(p, q)`` with ``p = softmax(s/T)``, ``q = softmax(t/T)`` on given
        logits: the teacher is frozen (no gradient reaches its logits, whatever the variant).
        ``cache``: a top-k cache standing for the teacher's logits (read at ``T`` relative to the
        temperature it was made at)."""
        teacher_temperature = options.temperature
        made_at = None if cache is None else cache.made_at_temperature
        if cache is not None and made_at is not None:
            cache.check_read_at(options.temperature, vocab_size)
            teacher_temperature = options.temperature / made_at
        return LossPlan(
            student_terms=(CrossEntropy(),) if student_ce_weight > 0 else (),
            term_weights=(student_ce_weight,) if student_ce_weight > 0 else (),
            term_scalars={},
            teacher_ce_weight=0.0,
            kl_weight=1.0,
            student_temperature=options.temperature,
            teacher_temperature=teacher_temperature,
            divergence=options.divergence,
            params=options.params,
            vocab_size=vocab_size,
            reduction=reduction,
            ignore_index=options.ignore_index,
            teacher_kind=teacher_kind,
            teacher_role="frozen",
            teacher_trainable=False,
            config=options.config,
            student_logits_finite=False,
        )
