"""The reference backend, the test oracle: full (BT, V) logits, each divergence written here from
its definition (no formula shared with the chunked path), gradients from autograd; fp64 included,
memory of order BT × V.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..arguments.plan import LossPlan
from ..divergences import LOG_VOCAB, DivergenceParams, EntropyGate
from ..divergences.terms import COMPONENTS, STUDENT_TERMS
from .call import Call
from .logits import statistics_dtype
from .mixture_blocks import MixtureBlocks

__all__ = ["reference_loss", "reference_divergence"]


def _where_zero(mask: Tensor, value: Tensor) -> Tensor:
    return torch.where(mask, torch.zeros_like(value), value)


def _kl(x: Tensor, log_x: Tensor, log_y: Tensor) -> Tensor:
    """``Σ x (log x − log y)`` over the last dim, ``0·log 0 = 0``."""
    return _where_zero(x == 0, x * (log_x - log_y)).sum(-1)


def _renyi(log_a: Tensor, log_b: Tensor, order: float) -> Tensor:
    """``D_r(a‖b) = log Σ a^r b^{1−r} / (r − 1)``."""
    return torch.logsumexp(order * log_a + (1 - order) * log_b, dim=-1) / (order - 1)


def _dkd(logp: Tensor, logq: Tensor, labels: Tensor, params: DivergenceParams) -> Tensor:
    target = torch.nn.functional.one_hot(labels, logp.shape[-1]).bool()
    p_y = logp.gather(1, labels[:, None]).exp().squeeze(1)
    q_y = logq.gather(1, labels[:, None]).exp().squeeze(1)
    binary_p = torch.stack([p_y, 1 - p_y], dim=1)
    binary_q = torch.stack([q_y, 1 - q_y], dim=1)
    tckd = _kl(binary_q, torch.log(binary_q), torch.log(binary_p))
    neg_inf = torch.tensor(float("-inf"), dtype=logp.dtype, device=logp.device)
    log_p_hat = torch.log_softmax(torch.where(target, neg_inf, logp), dim=-1)
    log_q_hat = torch.log_softmax(torch.where(target, neg_inf, logq), dim=-1)
    nckd = _kl(log_q_hat.exp(), log_q_hat, log_p_hat)
    return params.real("kl_alpha") * tckd + params.real("kl_beta") * nckd


def _abkd(p: Tensor, q: Tensor, params: DivergenceParams) -> Tensor:
    a, b = params.real("kl_alpha"), params.real("kl_beta")
    bracket = p**a * q**b - a / (a + b) * p ** (a + b) - b / (a + b) * q ** (a + b)
    return -bracket.sum(-1) / (a * b)


def _triangular(p: Tensor, q: Tensor) -> Tensor:
    total = p + q
    empty = total == 0
    return _where_zero(empty, (p - q) ** 2 / torch.where(empty, torch.ones_like(total), total)).sum(-1)


def _alpha_divergence(p: Tensor, q: Tensor, alpha: float) -> Tensor:
    """``(1 − Σ p^α q^{1−α}) / (α (1 − α))``."""
    return (1 - (p**alpha * q ** (1 - alpha)).sum(-1)) / (alpha * (1 - alpha))


def _skew(p: Tensor, q: Tensor, logp: Tensor, logq: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """``(KL(q‖m), KL(p‖m))`` with ``m = (1−β) q + β p``."""
    log_m = torch.log((1 - beta) * q + beta * p)
    return _kl(q, logq, log_m), _kl(p, logp, log_m)


def _skew_js(p: Tensor, q: Tensor, logp: Tensor, logq: Tensor, beta: float) -> Tensor:
    """``(1−β) KL(q‖m) + β KL(p‖m)``."""
    return (1 - beta) * _skew(p, q, logp, logq, beta)[0] + beta * _skew(p, q, logp, logq, beta)[1]


def reference_divergence(name: str, logp: Tensor, logq: Tensor, labels: Tensor, params: DivergenceParams) -> Tensor:
    """Per-row ``D(p, q)`` of variant ``name`` from its definition (autograd-differentiable).

    ``mutual`` returns Jeffreys' value with the mutual-learning gradient: the student sees
    ``KL(sg q‖p)``, the teacher ``KL(sg p‖q)``.
    """
    p, q = logp.exp(), logq.exp()
    forward, reverse = _kl(q, logq, logp), _kl(p, logp, logq)
    formulas: dict[str, Callable[[], Tensor]] = {
        "forward": lambda: forward,
        "reverse": lambda: reverse,
        "jeffreys": lambda: forward + reverse,
        "cojeffreys": lambda: forward + reverse,
        "mutual": lambda: _kl(q.detach(), logq.detach(), logp) + _kl(p.detach(), logp.detach(), logq),
        "alpha_divergence": lambda: _alpha_divergence(p, q, params.real("kl_alpha")),
        "skew_forward": lambda: _skew(p, q, logp, logq, params.real("kl_beta"))[0],
        "skew_reverse": lambda: _skew(p, q, logp, logq, params.real("kl_beta"))[1],
        "skew_js": lambda: _skew_js(p, q, logp, logq, params.real("kl_beta")),
        "entropy_adaptive": lambda: _entropy_adaptive(forward, reverse, q, logq, params),
        "renyi": lambda: _renyi(logq, logp, params.real("kl_alpha")),
        "renyi_reverse": lambda: _renyi(logp, logq, params.real("kl_alpha")),
        "dkd": lambda: _dkd(logp, logq, labels, params),
        "abkd": lambda: _abkd(p, q, params),
        "triangular": lambda: _triangular(p, q),
    }
    return formulas[name]()


def _entropy_adaptive(forward: Tensor, reverse: Tensor, q: Tensor, logq: Tensor, params: DivergenceParams) -> Tensor:
    gate = params["entropy_gate"]
    assert isinstance(gate, EntropyGate)
    entropy = -_where_zero(q == 0, q * logq).sum(-1).detach()
    gamma = gate.alpha_min + (gate.alpha_max - gate.alpha_min) * torch.sigmoid(
        (entropy / params.real(LOG_VOCAB) - gate.tau) / gate.scale
    )
    return _where_zero(gamma == 0, gamma * forward) + _where_zero(gamma == 1, (1 - gamma) * reverse)


def _head_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, scale: float, dtype: torch.dtype) -> Tensor:
    """``scale·(hidden·weightᵀ + bias)`` in ``dtype`` (autograd differentiates it)."""
    logits = hidden.to(dtype) @ weight.to(dtype).T
    logits = logits if bias is None else logits + bias.to(dtype)
    return logits if scale == 1.0 else logits * scale


def _teacher_logits(
    call: Call[LossPlan],
    dtype: torch.dtype,
    student_head: tuple[Tensor, Tensor | None],
    teacher_hidden: Tensor | None,
    teacher_head: tuple[Tensor | None, Tensor | None],
    teacher_logits: Tensor | None,
) -> Tensor:
    """The teacher's full logits over the head's (real) columns, before its cap; ``student_head``
    and ``teacher_head``: each head's ``(weight, bias)`` (a tied teacher's is the student's)."""
    blocks = call.teacher_blocks
    if isinstance(blocks, MixtureBlocks) and blocks.plan.form == "mixed":  # log Σ_i w̃_i·q_i over every column
        return blocks.mixed_logits(call.labels.shape[0], dtype)
    if blocks is not None:
        formed = blocks.block(0, call.labels.shape[0], 0, student_head[0].shape[0], dtype, False)
        assert isinstance(formed, Tensor)  # formed in ``dtype``, not as stored
        return formed
    if teacher_logits is not None:
        return teacher_logits.to(dtype)  # a cache is taken as already capped and scaled
    assert teacher_hidden is not None
    weight, bias = student_head if teacher_head[0] is None else teacher_head
    assert weight is not None
    return _head_logits(teacher_hidden, weight, bias, call.plan.teacher_scale, dtype)


def _capped(logits: Tensor, cap: float | None) -> Tensor:
    """Gemma 2's soft-capping ``cap·tanh(logits/cap)`` (autograd differentiates it)."""
    return logits if cap is None else cap * torch.tanh(logits / cap)


def _value_clamped_at_zero(value: Tensor) -> Tensor:
    """``max(value, 0)`` in the forward, identity gradient (rounding can dip below 0)."""
    return torch.where(value < 0, value - value.detach(), value)


def reference_loss(
    call: Call[LossPlan],
    student_hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor | None,
    teacher_weight: Tensor | None,
    teacher_logits: Tensor | None,
    bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """``(loss, student_ce, teacher_ce, kl, *the other student terms, student_entropy)`` on full
    logits ``cap(scale·(h·Wᵀ + b))`` per side, with autograd gradients: the student's terms from
    their oracles (:meth:`orda_tp.divergences.terms.StudentTerm.oracle`), the entropy a detached
    report. Only the first ``vocab_size`` columns are read (the rest is vocabulary padding); each
    row's values are multiplied by its ``token_weights``."""
    plan, labels, valid = call.plan, call.labels, call.valid
    dtype = statistics_dtype(student_hidden, weight, teacher_hidden, teacher_weight, teacher_logits, bias, teacher_bias)
    vocab_size = call.layout.vocab_size
    weight, bias = weight[:vocab_size], None if bias is None else bias[:vocab_size]
    teacher_weight = None if teacher_weight is None else teacher_weight[:vocab_size]
    teacher_bias = None if teacher_bias is None else teacher_bias[:vocab_size]
    teacher_logits = None if teacher_logits is None else teacher_logits[:, :vocab_size]
    in_range = (labels >= 0) & (labels < weight.shape[0])
    # Ignored and out-of-range rows gather column 0, never an invalid index; below, they read 0 and NaN.
    safe_labels = torch.where(valid & in_range, labels, torch.zeros_like(labels))
    student = _capped(_head_logits(student_hidden, weight, bias, plan.student_scale, dtype), plan.student_softcap)
    zeros = torch.zeros(labels.shape[0], dtype=dtype, device=labels.device)
    teacher_ce = kl = zeros
    entropy = _student_entropy(student, plan.student_temperature) if plan.student_entropy else zeros
    terms = {term.name: zeros for term in STUDENT_TERMS}
    for term in plan.student_terms:
        terms[term.name] = term.oracle(student, safe_labels, plan.term_scalars)
    views = plan.mixture is not None and plan.mixture.form == "views"
    if plan.computes_kl and views:  # a mixture's Σ_i w_i·D(q_i‖p): each teacher's own divergence
        assert isinstance(call.teacher_blocks, MixtureBlocks)
        kl = _reference_views_kl(plan, student, call.teacher_blocks, safe_labels)
    elif plan.needs_teacher_logits:
        teacher = _teacher_logits(
            call, dtype, (weight, bias), teacher_hidden, (teacher_weight, teacher_bias), teacher_logits
        )
        teacher = _capped(teacher, plan.teacher_softcap)  # None for a cache (the plan refuses it)
        if not plan.teacher_receives_grad:
            teacher = teacher.detach()
        absent = (teacher == float("-inf")).all(-1)
        # An all −inf teacher row read as zeros: its log-softmax stays finite, its values are masked.
        teacher = torch.where(absent[:, None], torch.zeros_like(teacher), teacher)
        if plan.teacher_ce_weight > 0:
            ce = torch.logsumexp(teacher, -1) - teacher.gather(1, safe_labels[:, None]).squeeze(1)
            teacher_ce = _where_zero(absent, ce)
        if plan.computes_kl:
            kl = _reference_kl(plan, student, teacher, safe_labels, absent)
    components = {**terms, "teacher_ce": teacher_ce, "kl": kl, "student_entropy": entropy}
    # A label no column owns (possible only with assume_valid_labels) makes its row NaN.
    nan = torch.full_like(zeros, float("nan"))
    components = {name: torch.where(valid, torch.where(in_range, v, nan), zeros) for name, v in components.items()}
    if call.row_weights is not None:
        components = {name: values * call.row_weights.to(dtype) for name, values in components.items()}
    loss = sum((weight * components[name] for name, weight in plan.component_weights.items()), zeros)
    outputs = [loss] + [components[name].detach() for name in COMPONENTS]
    if plan.reduction != "none":
        outputs = [values.sum() for values in outputs]
        if plan.reduction == "mean":
            outputs = [total / call.denominator for total in outputs]
    return tuple(outputs)


def _student_entropy(student: Tensor, temperature: float) -> Tensor:
    """``H(p) = −Σ p log p`` per row, ``p = softmax(student/T_s)`` (``0·log 0 = 0``), detached: a report."""
    logp = torch.log_softmax(student.detach() / temperature, -1)
    p = logp.exp()
    return -_where_zero(p == 0, p * logp).sum(-1)


def _reference_kl(plan: LossPlan, student: Tensor, teacher: Tensor, labels: Tensor, absent: Tensor) -> Tensor:
    """``T_s²·D`` per row; rows whose D is +inf (zero support) or whose teacher is absent keep
    their value but pass no gradient."""
    assert plan.divergence is not None
    name = plan.divergence.name
    kl_teacher = teacher if plan.kl_trains_teacher else teacher.detach()

    def divergence(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
        logp = torch.log_softmax(student_logits / plan.student_temperature, -1)
        logq = torch.log_softmax(teacher_logits / plan.teacher_temperature, -1)
        return reference_divergence(name, logp, logq, labels, plan.params)

    with torch.no_grad():
        blocked = absent | torch.isposinf(divergence(student, kl_teacher))
    # A blocked row's logits detached: it keeps its value but passes no (inf or NaN) gradient.
    rows = blocked[:, None]
    value = divergence(torch.where(rows, student.detach(), student), torch.where(rows, kl_teacher.detach(), kl_teacher))
    value = _where_zero(absent, _value_clamped_at_zero(value))
    return plan.student_temperature**2 * value


def _reference_views_kl(plan: LossPlan, student: Tensor, blocks: MixtureBlocks, labels: Tensor) -> Tensor:
    """``T_s²·Σ_i w_i·max(D(q_i‖p), 0)`` per row over the teachers with ``w_i > 0``; a teacher absent
    on a row (no weight, or all −inf there) adds 0 and no gradient."""
    rows, columns = student.shape
    weights = blocks.weights(0, rows, student.dtype)
    kl = torch.zeros(rows, dtype=student.dtype, device=student.device)
    for index, logits in enumerate(blocks.member_tiles(0, rows, 0, columns, student.dtype)):
        absent = (logits == float("-inf")).all(-1)
        teacher = torch.where(absent[:, None], torch.zeros_like(logits), logits)
        term = _reference_kl(plan, student, teacher, labels, absent)
        # A teacher of weight 0 on a row adds 0 (never 0·inf).
        kl = kl + _where_zero(absent | (weights[:, index] == 0), weights[:, index] * term)
    return kl
