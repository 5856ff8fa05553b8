"""Logit scales and LM-head biases (tests/test_scale_bias.py): the problem, the teacher of every
kind, the keywords of a call, and the fp64 oracle written from the definitions (independently of
orda_tp's reference backend): per side ``z = cap(scale·(h·Wᵀ + b))``, then every term of the loss
on ``z``, with autograd gradients."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import orda_tp

from .topk_cases import dense_teacher, topk_of

IGNORE = -100
ROWS, WIDTH, TEACHER_WIDTH, VOCAB = 24, 16, 19, 203
#: Teacher kinds: a head read by the loss (tied, separate, a TeacherHead module, a cache of hidden
#: states and head) or formed logits (a cache of logits, a top-k cache).
KINDS = ("tied", "separate", "head", "hidden_cache", "logits_cache", "topk")
HEAD_KINDS = ("tied", "separate", "head", "hidden_cache")
VARIANTS: dict[str, dict[str, float]] = {
    "forward": {},
    "reverse": {},
    "skew_js": {"kl_beta": 0.4},
    "alpha_divergence": {"kl_alpha": 0.3},
    "mutual": {},  # co-trains the teacher: its KL gradient reaches the teacher's head and bias
}
STUDENT_SCALE, TEACHER_SCALE, STUDENT_CAP, TEACHER_CAP = 0.7, 1.6, 3.0, 4.0
WEIGHTS = {"student_ce_weight": 0.7, "kl_weight": 0.9, "z_loss_weight": 0.05, "label_smoothing": 0.1}
TOPK = 150  # ids of a top-k teacher (of the real vocabulary)


@dataclass
class Biased:
    """Both heads with their biases, the tied teacher's hidden states and the labels."""

    hidden: Tensor  # (N, H)
    weight: Tensor  # (V, H)
    bias: Tensor  # (V,)
    labels: Tensor  # (N,), every 5th row ignored
    tied_hidden: Tensor  # (N, H)
    teacher_hidden: Tensor  # (N, H_t)
    teacher_weight: Tensor  # (V, H_t)
    teacher_bias: Tensor  # (V,)

    def to(self, dtype: torch.dtype) -> Biased:
        """A copy in ``dtype``: fresh leaves that require grad (labels as they are)."""
        values = {spec.name: getattr(self, spec.name) for spec in fields(self)}
        return Biased(
            **{
                name: value if name == "labels" else value.detach().to(dtype).requires_grad_()
                for name, value in values.items()
            }
        )


def make_biased(seed: int, vocab: int = VOCAB, padded_to: int | None = None, rows: int = ROWS) -> Biased:
    """Heads with logits of standard deviation ≈ 2 and biases of ≈ 1 (fp64); ``padded_to``: head rows
    appended up to it (vocabulary padding), whose bias is a large 40 that no term may read."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64) * scale

    labels = torch.randint(0, vocab, (rows,), generator=generator)
    labels[::5] = IGNORE
    total = vocab if padded_to is None else padded_to
    bias, teacher_bias = randn(total), randn(total)
    bias[vocab:] = teacher_bias[vocab:] = 40.0
    return Biased(
        hidden=randn(rows, WIDTH),
        weight=randn(total, WIDTH, scale=2.0 / WIDTH**0.5),
        bias=bias,
        labels=labels,
        tied_hidden=randn(rows, WIDTH),
        teacher_hidden=randn(rows, TEACHER_WIDTH),
        teacher_weight=randn(total, TEACHER_WIDTH, scale=2.0 / TEACHER_WIDTH**0.5),
        teacher_bias=teacher_bias,
    )


def raw_teacher_logits(problem: Biased) -> Tensor:
    """The formed logits ``h_t·W_tᵀ + b_t`` a cache holds (fp64, detached; no scale, no cap)."""
    exact = problem.to(torch.float64)
    return (exact.teacher_hidden @ exact.teacher_weight.T + exact.teacher_bias).detach()


def topk_cache(problem: Biased, vocab_size: int) -> tuple[Tensor, Tensor]:
    """The ``TOPK`` most likely ids of the cache's logits over the real vocabulary, in fp64."""
    return topk_of(raw_teacher_logits(problem), TOPK, vocab_size, torch.float64)


def teacher_of(problem: Biased, kind: str, vocab_size: int) -> tuple[Any, list[Tensor]]:
    """The teacher of ``kind`` over ``problem`` and the tensors a call may train (in the oracle's
    order: hidden states, head weight, head bias)."""
    if kind == "tied":
        return orda_tp.TiedTeacher(problem.tied_hidden), [problem.tied_hidden]
    hidden, weight, bias = problem.teacher_hidden, problem.teacher_weight, problem.teacher_bias
    if kind == "separate":
        return orda_tp.SeparateTeacher(hidden, weight, bias), [hidden, weight, bias]
    if kind == "head":
        head = nn.Linear(TEACHER_WIDTH, weight.shape[0], dtype=weight.dtype)
        with torch.no_grad():
            head.weight.copy_(weight)
            head.bias.copy_(bias)
        return orda_tp.TeacherHead(hidden, head), [hidden, head.weight, head.bias]
    if kind == "hidden_cache":
        cache = orda_tp.PrecomputedTeacher(
            teacher_hidden=hidden.detach(), teacher_weight=weight.detach(), teacher_bias=bias.detach()
        )
        return cache, []
    if kind == "logits_cache":
        return orda_tp.PrecomputedTeacher(logits=raw_teacher_logits(problem).to(weight.dtype)), []
    assert kind == "topk"
    ids, logprobs = topk_cache(problem, vocab_size)
    return orda_tp.PrecomputedTeacher(topk_ids=ids, topk_logprobs=logprobs.to(weight.dtype), retemper=True), []


def keywords(kind: str, variant: str, reduction: str, caps: bool = True) -> dict[str, Any]:
    """The call's keywords: every term on, both scales ≠ 1 where the teacher is a head (one scale for
    a tied head), the soft-caps where ``caps``; a teacher trained by its CE where it can be."""
    kw: dict[str, Any] = dict(
        WEIGHTS, kl_temperature=2.0, kl_divergence=variant, reduction=reduction, logit_scale=STUDENT_SCALE
    )
    kw.update(VARIANTS[variant])
    if variant != "mutual":  # a co-training variant takes one temperature
        kw["kl_teacher_temperature"] = 1.5
    if kind in HEAD_KINDS:
        kw["teacher_logit_scale"] = STUDENT_SCALE if kind == "tied" else TEACHER_SCALE
    if caps:
        kw["logit_softcap"] = STUDENT_CAP
        kw.update({"teacher_logit_softcap": TEACHER_CAP} if kind in HEAD_KINDS else {})
    # The tied teacher keeps its default (1.0: trained); a cache's CE is reported, not differentiated.
    kw.update({"separate": {"teacher_ce_weight": 0.4}, "head": {"teacher_ce_weight": 0.4}}.get(kind, {}))
    if kind not in HEAD_KINDS:
        kw["teacher_ce_weight"] = 0.2
    return kw


def _capped(logits: Tensor, cap: float | None) -> Tensor:
    return logits if cap is None else cap * torch.tanh(logits / cap)


def _divergence(variant: str, logp: Tensor, logq: Tensor, params: dict[str, float]) -> Tensor:
    """Per-row ``D(p, q)`` from its definition."""
    p, q = logp.exp(), logq.exp()

    def kl(x: Tensor, log_x: Tensor, log_y: Tensor) -> Tensor:
        return (x * (log_x - log_y)).sum(-1)

    if variant == "forward":
        return kl(q, logq, logp)
    if variant == "reverse":
        return kl(p, logp, logq)
    if variant == "skew_js":
        beta = params["kl_beta"]
        log_m = torch.log((1 - beta) * q + beta * p)
        return (1 - beta) * kl(q, logq, log_m) + beta * kl(p, logp, log_m)
    if variant == "alpha_divergence":
        alpha = params["kl_alpha"]
        return (1 - (p**alpha * q ** (1 - alpha)).sum(-1)) / (alpha * (1 - alpha))
    assert variant == "mutual"  # Jeffreys' value; the student sees KL(sg q‖p), the teacher KL(sg p‖q)
    return kl(q.detach(), logq.detach(), logp) + kl(p.detach(), logp.detach(), logq)


def oracle_logits(exact: Biased, kind: str, kw: dict[str, Any], vocab_size: int) -> tuple[Tensor, Tensor]:
    """Both sides' logits over the real vocabulary, formed by hand: ``cap(scale·(h·Wᵀ + b))`` for a
    head (a tied teacher through the student's), a cache's as it holds them."""
    real = slice(0, vocab_size)
    student_scale, teacher_scale = kw["logit_scale"], kw.get("teacher_logit_scale", 1.0)
    student = exact.hidden @ exact.weight[real].T + exact.bias[real]
    student = _capped(student_scale * student, kw.get("logit_softcap"))
    if kind == "tied":
        teacher = exact.tied_hidden @ exact.weight[real].T + exact.bias[real]
    elif kind in HEAD_KINDS:
        teacher = exact.teacher_hidden @ exact.teacher_weight[real].T + exact.teacher_bias[real]
    elif kind == "logits_cache":
        return student, raw_teacher_logits(exact)[:, real]
    else:
        ids, logprobs = topk_cache(exact, vocab_size)
        return student, dense_teacher(ids, logprobs, "uniform", exact.weight.shape[0], vocab_size)[:, real]
    return student, _capped(teacher_scale * teacher, kw.get("teacher_logit_softcap"))


def oracle(exact: Biased, kind: str, kw: dict[str, Any], vocab_size: int = VOCAB) -> dict[str, Tensor]:
    """``loss`` and its components (reduced as ``kw["reduction"]``) on logits formed by hand; the
    teacher's CE differentiated where the call trains the teacher by it, its KL side only for a
    co-training variant."""
    student, teacher = oracle_logits(exact, kind, kw, vocab_size)
    valid = exact.labels != IGNORE
    safe = torch.where(valid, exact.labels, 0)
    trained = kind in ("tied", "separate", "head")
    w_t = kw.get("teacher_ce_weight", 1.0 if kind == "tied" else 0.0)
    frozen = teacher if trained and w_t > 0 else teacher.detach()
    variant = kw["kl_divergence"]
    t_s, t_t = kw["kl_temperature"], kw.get("kl_teacher_temperature") or kw["kl_temperature"]
    kl_teacher = teacher if variant == "mutual" else teacher.detach()
    logp, logq = torch.log_softmax(student / t_s, -1), torch.log_softmax(kl_teacher / t_t, -1)
    rows = {
        "student_ce": F.cross_entropy(student, safe, label_smoothing=kw["label_smoothing"], reduction="none"),
        "teacher_ce": F.cross_entropy(frozen, safe, reduction="none")
        if w_t > 0
        else torch.zeros_like(safe, dtype=student.dtype),
        "kl": t_s**2 * _divergence(variant, logp, logq, kw),
        "z_loss": torch.logsumexp(student, -1) ** 2,
    }
    rows = {name: torch.where(valid, values, 0.0) for name, values in rows.items()}
    weights = {
        "student_ce": kw["student_ce_weight"],
        "teacher_ce": w_t,
        "kl": kw["kl_weight"],
        "z_loss": kw["z_loss_weight"],
    }
    rows["loss"] = sum((weights[name] * rows[name] for name in weights), torch.zeros_like(rows["kl"]))
    if kw["reduction"] == "none":
        return rows
    count = valid.sum() if kw["reduction"] == "mean" else 1
    return {name: values.sum() / count for name, values in rows.items()}
