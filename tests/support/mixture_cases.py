"""``TeacherMixture`` problems and their oracle, composed from one-teacher ``backend="reference"``
calls exactly as issue 38's plan proves (``/work/notes/issue38_scratch/exp1_oracle.py``): the mixture's
tempered logits are formed here from their definition, never by orda_tp's mixture code.

- ``log_probabilities``: ``PrecomputedTeacher(logits=Σ_i w_i·v_i, logits_temperature=1.0)`` (−inf on a
  row without a teacher);
- ``probabilities``: ``PrecomputedTeacher(logits=logsumexp_i(log w̃_i + log_softmax(v_i)), logits_temperature=1.0)``;
- ``divergences``: the student terms' call plus, per teacher, ``token_weights=w[:, i]``, ``student_ce_weight=0``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

import orda_tp

from .topk_cases import dense_teacher, topk_of

ROWS, HIDDEN, VOCAB = 24, 16, 37
#: The teacher kinds a mixture test draws from: tied, separate of two widths, precomputed logits, hidden
#: cache, top-k (uniform tail).
KINDS = ("tied", "separate20", "separate12", "logits", "hidden", "topk")
#: The keywords of a teacher's reading, which a cache of already tempered logits refuses.
TEACHER_KEYWORDS = ("kl_teacher_temperature", "teacher_logit_softcap", "teacher_logit_scale")
#: A "divergences" oracle's per-teacher calls: the student's terms are the first call's alone.
STUDENT_TERMS_OFF = dict(student_ce_weight=0.0, label_smoothing=0.0, z_loss_weight=0.0, student_entropy=False)


@dataclass
class MixtureProblem:
    student_hidden: Tensor
    weight: Tensor
    bias: Tensor
    labels: Tensor
    teachers: dict[str, orda_tp.TiedTeacher | orda_tp.SeparateTeacher | orda_tp.PrecomputedTeacher]
    raw: dict[str, Tensor]  # each teacher's logits before its cap, scale and temperature (top-k: dense log-probs)


def weights_of(kind: str, n: int, seed: int) -> torch.Tensor:
    """(rows, n) fp64 weights: "dense" (rows summing to 1, a zero row, a zero entry), "routed"
    (one-hot rows, some rows without a teacher), "scalar" (the same row everywhere)."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "routed":
        weights = torch.nn.functional.one_hot(torch.randint(0, n, (ROWS,), generator=generator), n).double()
        weights[3::5] = 0.0
        return weights
    weights = torch.rand(ROWS, n, generator=generator, dtype=torch.float64) + 0.1
    if kind == "scalar":
        weights = weights[:1].expand(ROWS, n).clone()
    else:
        weights[2, 0], weights[5] = 0.0, 0.0
    return weights / weights.sum(1, keepdim=True).clamp_min(1e-300)


def make_problem(seed: int) -> MixtureProblem:
    """fp64 leaves; labels with one row in 7 ignored."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64) * scale

    hidden = randn(ROWS, HIDDEN).requires_grad_()
    weight = (randn(VOCAB, HIDDEN) / HIDDEN**0.5).requires_grad_()
    bias = randn(VOCAB, scale=0.3).requires_grad_()
    labels = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    labels[::7] = -100
    tied = randn(ROWS, HIDDEN)
    teachers: dict[str, orda_tp.TiedTeacher | orda_tp.SeparateTeacher | orda_tp.PrecomputedTeacher] = {}
    raw: dict[str, Tensor] = {}
    teachers["tied"], raw["tied"] = orda_tp.TiedTeacher(tied), tied @ weight.detach().T + bias.detach()
    for width in (20, 12):
        h, w, b = randn(ROWS, width), randn(VOCAB, width) / width**0.5 * 2, randn(VOCAB, scale=0.2)
        teachers[f"separate{width}"], raw[f"separate{width}"] = orda_tp.SeparateTeacher(h, w, b), h @ w.T + b
    logits = randn(ROWS, VOCAB, scale=1.5)
    teachers["logits"], raw["logits"] = orda_tp.PrecomputedTeacher(logits=logits), logits
    h, w = randn(ROWS, 8), randn(VOCAB, 8) / 8**0.5 * 2
    teachers["hidden"], raw["hidden"] = orda_tp.PrecomputedTeacher(teacher_hidden=h, teacher_weight=w), h @ w.T
    ids, logprobs = topk_of(randn(ROWS, VOCAB, scale=2.0), 9)
    teachers["topk"] = orda_tp.PrecomputedTeacher(topk_ids=ids, topk_logprobs=logprobs, tail="uniform", retemper=True)
    raw["topk"] = dense_teacher(ids, logprobs, "uniform", VOCAB)
    return MixtureProblem(hidden, weight, bias, labels, teachers, raw)


def in_float32(teacher: object) -> object:
    """The same teacher with its floating-point tensors in fp32."""
    if isinstance(teacher, orda_tp.TiedTeacher):
        return orda_tp.TiedTeacher(teacher.hidden.float())
    if isinstance(teacher, orda_tp.SeparateTeacher):
        bias = None if teacher.bias is None else teacher.bias.float()
        return orda_tp.SeparateTeacher(teacher.hidden.float(), teacher.weight.float(), bias)
    assert isinstance(teacher, orda_tp.PrecomputedTeacher)
    if teacher.logits is not None:
        return orda_tp.PrecomputedTeacher(logits=teacher.logits.float())
    if teacher.topk_ids is not None and teacher.topk_logprobs is not None:
        logprobs = teacher.topk_logprobs.float()
        return orda_tp.PrecomputedTeacher(
            topk_ids=teacher.topk_ids, topk_logprobs=logprobs, tail="uniform", retemper=True
        )
    assert teacher.teacher_hidden is not None and teacher.teacher_weight is not None
    return orda_tp.PrecomputedTeacher(
        teacher_hidden=teacher.teacher_hidden.float(), teacher_weight=teacher.teacher_weight.float()
    )


def tempered(problem: MixtureProblem, kind: str, kwargs: dict[str, object]) -> Tensor:
    """``v = cap(scale·t)/T_t`` of one teacher from its definition (a cache: ``t/T_t``; top-k: made at 1)."""
    given = kwargs.get("kl_teacher_temperature")
    temperature = float(kwargs.get("kl_temperature", 1.0) if given is None else given)  # type: ignore[arg-type]
    logits = problem.raw[kind]
    if kind in ("tied", "separate20", "separate12", "hidden"):
        logits = logits * float(kwargs.get("teacher_logit_scale", 1.0))  # type: ignore[arg-type]
        cap = kwargs.get("teacher_logit_softcap")
        logits = logits if cap is None else float(cap) * torch.tanh(logits / float(cap))  # type: ignore[arg-type]
    return logits / temperature


def oracle(
    problem: MixtureProblem, kinds: list[str], weights: Tensor, combine: str, kwargs: dict[str, object]
) -> orda_tp.DistillationLossOutput:
    """The mixture's loss from one-teacher reference calls; ``weights`` (rows, n) fp64."""
    call = dict(kwargs, backend="reference", bias=problem.bias, teacher_ce_weight=0.0)
    args = problem.student_hidden, problem.weight, problem.labels
    if combine == "divergences":
        terms = dict(call, kl_weight=0.0)
        out = orda_tp.distillation_loss(*args, problem.teachers[kinds[0]], **terms)
        parts = [out]
        for index, kind in enumerate(kinds):
            given = kwargs.get("token_weights")
            rows = weights[:, index] if given is None else weights[:, index] * given  # type: ignore[operator]
            views = dict(call, token_weights=rows.clone(), **STUDENT_TERMS_OFF)
            parts.append(orda_tp.distillation_loss(*args, problem.teachers[kind], **views))
        return orda_tp.DistillationLossOutput(*(sum(values) for values in zip(*parts)))
    v = torch.stack([tempered(problem, kind, kwargs) for kind in kinds])  # (n, rows, vocab)
    w = weights.T[:, :, None]
    if combine == "log_probabilities":
        block = torch.where(w > 0, w * v, torch.zeros_like(v)).sum(0)
    else:  # a teacher absent on a row (all −inf) is left out, the others' weights renormalized
        present = (v > -math.inf).any(-1, keepdim=True)
        w = torch.where(present, w, torch.zeros_like(w))
        w = w / w.sum(0, keepdim=True).clamp_min(1e-300)
        log_q = torch.where(present, torch.log_softmax(torch.where(present, v, 0.0), -1), -math.inf)
        block = torch.logsumexp(torch.log(w) + log_q, 0)
    block = torch.where((weights > 0).any(1)[:, None], block, -math.inf)
    cache = orda_tp.PrecomputedTeacher(logits=block, logits_temperature=1.0)
    plain = {name: value for name, value in call.items() if name not in TEACHER_KEYWORDS}
    return orda_tp.distillation_loss(*args, cache, **plain)
