"""The student's entropy output (``student_entropy=True``; docs/reference.md): ``H(p) = −Σ p·log p``
per row of ``p = softmax(cap(s)/T_s)``, the ``p`` of the KL term, written in this file from full
fp64 logits (:func:`oracle`), against the torch backend, the reference backend and (fp32, under
the interpreter) the Triton backend; with every teacher kind, with and without a KL term (round 2
then runs for the entropy alone), for variants whose round 2 has one, two or three sums, the one
that sums round 2 in its gradient pass (``forward``) and the co-training one; every reduction,
token weights and ``num_valid_tokens``. The entropy is detached and changes neither the loss, nor
another component, nor a gradient (bitwise). Under tensor parallelism (gloo, 2 and 3 ranks: uneven
and padded shards, sequence parallelism; torch and Triton) every rank's entropy equals the oracle.
tests/test_tensor_parallel.py compares the TP entropy with one device's for every variant.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

import orda_tp
from orda_tp import PrecomputedTeacher, SeparateTeacher

from .support.cases import SMALL_CHUNKS, Problem, make_problem, relative_error, separate_problem
from .support.distributed import run_distributed
from .support.tp_workers import chunk_ranges, row_range

T_S, T_T, CAP = 2.0, 1.5, 4.0
TEACHERS = ("tied", "separate", "precomputed", "precomputed_hidden", "topk")
#: The KL terms a call may have: none (kl_weight=0), one, two and three round-2 sums (skew_js; dkd,
#: which reads the label), round 2 in the gradient pass (forward), a co-trained teacher (mutual).
KL_TERMS: dict[str, dict[str, Any]] = {
    "no kl": {"kl_weight": 0.0},
    "forward": {"kl_weight": 1.3, "kl_divergence": "forward"},
    "reverse": {"kl_weight": 1.3, "kl_divergence": "reverse"},
    "skew_js": {"kl_weight": 0.8, "kl_divergence": "skew_js", "kl_beta": 0.4},
    "dkd": {"kl_weight": 0.8, "kl_divergence": "dkd", "kl_alpha": 2.0, "kl_beta": 0.5},
    "mutual": {"kl_weight": 0.8, "kl_divergence": "mutual"},
}


def oracle(hidden: Tensor, weight: Tensor, labels: Tensor, cap: float | None = CAP, vocab: int | None = None) -> Tensor:
    """``H(p)`` per row from the full fp64 logits of the first ``vocab`` head rows, ``0·log 0 = 0``;
    0 on ignored rows."""
    logits = hidden.detach().double() @ weight.detach().double()[:vocab].T
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    logp = torch.log_softmax(logits / T_S, dim=-1)
    p = logp.exp()
    rows = -torch.where(p == 0, 0.0, p * logp).sum(-1)
    return torch.where(labels != -100, rows, 0.0)


def reduced(
    rows: Tensor, reduction: str, labels: Tensor, weights: Tensor | None = None, count: float | None = None
) -> Tensor:
    """The rows reduced as the loss reduces a component: "none" as they are (weighted), "sum", or
    "mean" over the valid rows (or ``count``)."""
    rows = rows if weights is None else rows * weights.double()
    if reduction == "none":
        return rows
    total = rows.sum()
    return total if reduction == "sum" else total / (count if count is not None else (labels != -100).sum())


def teacher_of(problem: Problem, kind: str) -> Any:
    """The teacher of ``kind``; a head that is not the student's reads the separate problem's states."""
    if kind == "precomputed_hidden":
        return PrecomputedTeacher(
            teacher_hidden=problem.teacher_hidden.detach(), teacher_weight=problem.teacher_weight.detach()
        )
    return problem.teacher(kind)


def problem_for(kind: str, dtype: torch.dtype, seed: int = 3) -> Problem:
    problem = make_problem(rows=24, vocab=203, seed=seed)
    problem = separate_problem(problem) if kind in ("separate", "precomputed_hidden") else problem
    return problem.to(dtype)


def call(problem: Problem, kind: str, backend: str, **keywords: Any) -> orda_tp.DistillationLossOutput:
    keywords = {"kl_temperature": T_S, "logit_softcap": CAP, "student_ce_weight": 0.7, **keywords}
    if keywords.get("kl_divergence") != "mutual":  # a co-training variant takes one temperature
        keywords.setdefault("kl_teacher_temperature", T_T)
    config = None if backend == "reference" else SMALL_CHUNKS
    teacher = teacher_of(problem, kind)
    return orda_tp.distillation_loss(
        problem.student_hidden, problem.weight, problem.labels, teacher, backend=backend, config=config, **keywords
    )


def _oracle_cases() -> list[Any]:
    cases = []
    for kind in TEACHERS:
        for term in KL_TERMS:
            if term == "mutual" and kind not in ("tied", "separate"):
                continue  # a co-training variant needs a trainable teacher
            for reduction in ("mean", "sum", "none"):
                cases.append(pytest.param(kind, term, reduction, id=f"{kind}-{term}-{reduction}"))
    return cases


@pytest.mark.parametrize(("kind", "term", "reduction"), _oracle_cases())
def test_entropy_is_the_students_at_the_kl_temperature(kind: str, term: str, reduction: str) -> None:
    """torch (fp64) against the oracle; the loss, the other components and the gradients are
    bitwise those of the call without the entropy."""
    problem = problem_for(kind, torch.float64)
    upstream = torch.linspace(0.5, 1.5, 24, dtype=torch.float64) if reduction == "none" else None
    outputs, grads = [], []
    for entropy in (True, False):
        out = call(problem, kind, "torch", reduction=reduction, student_entropy=entropy, **KL_TERMS[term])
        inputs = problem.trainable(kind)
        grads.append(torch.autograd.grad(out.loss, inputs, grad_outputs=upstream, allow_unused=True))
        outputs.append(out)
    with_entropy, without = outputs
    expected = reduced(oracle(problem.student_hidden, problem.weight, problem.labels), reduction, problem.labels)
    assert relative_error(with_entropy.student_entropy, expected) <= 1e-12
    assert not with_entropy.student_entropy.requires_grad and without.student_entropy.abs().max().item() == 0.0
    for name in with_entropy._fields[:-1]:
        assert torch.equal(getattr(with_entropy, name), getattr(without, name)), name
    for grad, other in zip(*grads):
        assert (grad is None and other is None) or torch.equal(grad, other)


@pytest.mark.parametrize("term", ["no kl", "reverse", "forward"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_reference_backend(term: str, reduction: str) -> None:
    problem = problem_for("separate", torch.float64)
    out = call(problem, "separate", "reference", reduction=reduction, student_entropy=True, **KL_TERMS[term])
    expected = reduced(oracle(problem.student_hidden, problem.weight, problem.labels), reduction, problem.labels)
    assert relative_error(out.student_entropy, expected) <= 1e-12 and not out.student_entropy.requires_grad


TRITON_CASES = [
    ("tied", "forward", "mean"),  # round 2 summed by the gradient pass
    ("separate", "reverse", "none"),
    ("tied", "no kl", "sum"),  # round 2 without a teacher block
    ("topk", "skew_js", "sum"),  # a sparse teacher block
    ("precomputed", "dkd", "mean"),
    ("separate", "mutual", "sum"),
]


@pytest.mark.parametrize(("kind", "term", "reduction"), TRITON_CASES)
def test_triton_backend(kind: str, term: str, reduction: str) -> None:
    """fp32 under the interpreter against the oracle; loss and gradients as without the entropy."""
    pytest.importorskip("triton")
    problem = problem_for(kind, torch.float32)
    outputs, grads = [], []
    for entropy in (True, False):
        out = call(problem, kind, "triton", reduction=reduction, student_entropy=entropy, **KL_TERMS[term])
        loss = out.loss.sum() if reduction == "none" else out.loss
        grads.append(torch.autograd.grad(loss, [problem.student_hidden, problem.weight]))
        outputs.append(out)
    expected = reduced(oracle(problem.student_hidden, problem.weight, problem.labels), reduction, problem.labels)
    assert relative_error(outputs[0].student_entropy, expected) <= 1e-5
    assert torch.equal(outputs[0].loss, outputs[1].loss)
    for grad, other in zip(*grads):
        assert torch.equal(grad, other)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_token_weights_num_valid_tokens_and_no_grad(backend: str) -> None:
    """Each row's entropy times its token weight, "mean" over ``num_valid_tokens``; a call without
    grad mode (round 2 in its own pass even for ``forward``)."""
    problem = problem_for("tied", torch.float64)
    weights = torch.rand(24, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    rows = oracle(problem.student_hidden, problem.weight, problem.labels)
    out = call(problem, "tied", backend, token_weights=weights, num_valid_tokens=40.0, student_entropy=True)
    assert relative_error(out.student_entropy, reduced(rows, "mean", problem.labels, weights, 40.0)) <= 1e-12
    with torch.no_grad():
        out = call(problem, "tied", backend, reduction="sum", student_entropy=True, **KL_TERMS["forward"])
    assert relative_error(out.student_entropy, rows.sum()) <= 1e-12


def test_without_a_cap_and_on_near_one_hot_rows() -> None:
    """No soft-cap; logits of ±hundreds, where most ``p`` underflow to 0 (``0·log 0 = 0``, no NaN)."""
    problem = problem_for("tied", torch.float64)
    weight = (problem.weight.detach() * 300).requires_grad_()
    for backend in ("torch", "reference"):
        out = orda_tp.distillation_loss(
            problem.student_hidden, weight, problem.labels, problem.teacher("tied"), kl_temperature=T_S,
            kl_weight=1.0, kl_divergence="reverse", reduction="none", backend=backend, student_entropy=True,
        )  # fmt: skip
        expected = oracle(problem.student_hidden, weight, problem.labels, cap=None)
        assert torch.isfinite(out.student_entropy).all()
        assert (out.student_entropy.double() - expected).abs().max().item() <= 1e-10


def test_module_and_head_forms() -> None:
    """``DistillationLoss(student_entropy=True)`` and a ``DistillationHead``'s per-position output."""
    problem = problem_for("tied", torch.float64)
    rows = oracle(problem.student_hidden, problem.weight, problem.labels, cap=None)
    module = orda_tp.DistillationLoss(student_entropy=True, kl_temperature=T_S, kl_weight=1.0, backend="torch")
    out = module(problem.student_hidden, problem.weight, problem.labels, problem.teacher("tied"))
    assert relative_error(out.student_entropy, rows.sum() / (problem.labels != -100).sum()) <= 1e-12
    head = orda_tp.DistillationHead(16, 203, student_entropy=True, kl_temperature=T_S, reduction="none",
                                    dtype=torch.float64)  # fmt: skip
    with torch.no_grad():
        head.weight.copy_(problem.weight)
    labels = problem.labels.reshape(4, 6)
    out = head(problem.student_hidden.reshape(4, 6, 16), labels=labels)
    assert out.student_entropy.shape == (4, 6)
    assert relative_error(out.student_entropy.reshape(-1), rows) <= 1e-12


# ------------------------------------------------------------------------------ tensor parallelism


def entropy_tp_worker(rank: int, world: int) -> list[str]:
    """Vocabulary shards (uneven; a head padded past ``vocab_size``; sequence parallelism), on the
    torch and the Triton backend, with and without a KL term: every rank's entropy against the
    oracle on the real columns."""
    problems: list[str] = []
    real, total = 150, 160  # 10 padding rows, on the last rank(s)
    generator = torch.Generator().manual_seed(11)
    for backend, dtype, tolerance in (("torch", torch.float64, 1e-12), ("triton", torch.float32, 1e-5)):
        full = make_problem(rows=24, vocab=real, seed=7)
        padding = torch.randn(total - real, 16, generator=generator, dtype=torch.float64) * 3
        padded = torch.cat([full.weight.detach(), padding])
        for layout in ("uneven", "padded", "sequence parallel"):
            for term in ("no kl", "reverse", "forward"):
                label = f"world={world} {backend} {layout} {term}"
                head = padded if layout == "padded" else full.weight.detach()
                start, stop = chunk_ranges(head.shape[0], world)[rank]
                rows = row_range(24, world, rank) if layout == "sequence parallel" else (0, 24)
                keywords: dict[str, Any] = {"tp_group": dist.group.WORLD, "backend": backend}
                if layout == "padded":
                    keywords["vocab_size"] = real
                if layout == "sequence parallel":
                    keywords["sequence_parallel"] = True
                try:
                    out = orda_tp.distillation_loss(
                        full.student_hidden.detach()[rows[0] : rows[1]].to(dtype).requires_grad_(),
                        head[start:stop].to(dtype).requires_grad_(),
                        full.labels,
                        orda_tp.TiedTeacher(full.teacher_hidden.detach()[rows[0] : rows[1]].to(dtype)),
                        kl_temperature=T_S, logit_softcap=CAP, reduction="none", student_entropy=True,
                        config=SMALL_CHUNKS, **KL_TERMS[term], **keywords,
                    )  # fmt: skip
                except Exception as error:  # noqa: BLE001 - reported with the case's label
                    problems.append(f"{label}: raised {type(error).__name__}: {error}")
                    continue
                expected = oracle(full.student_hidden, full.weight, full.labels)
                if (error := relative_error(out.student_entropy, expected)) > tolerance:
                    problems.append(f"{label}: entropy relative error {error:.1e}")
    return problems


@pytest.mark.parametrize("world_size", [2, 3])
def test_tensor_parallel_entropy(world_size: int) -> None:
    pytest.importorskip("triton")
    results = run_distributed(world_size, entropy_tp_worker, timeout=300)
    problems = [f"rank {rank}: {problem}" for rank, found in enumerate(results) for problem in found]
    assert not problems, "\n".join(problems)


def test_the_entropy_alone() -> None:
    """No loss term at all: round 2 runs for the entropy alone, on the student's logits only."""
    problem = problem_for("separate", torch.float64)
    teacher = SeparateTeacher(problem.teacher_hidden.detach(), problem.teacher_weight.detach())
    out = orda_tp.distillation_loss(
        problem.student_hidden, problem.weight, problem.labels, teacher, kl_weight=0.0, student_ce_weight=0.0,
        kl_temperature=T_S, logit_softcap=CAP, reduction="sum", backend="torch", student_entropy=True,
    )  # fmt: skip
    expected = oracle(problem.student_hidden, problem.weight, problem.labels).sum()
    assert relative_error(out.student_entropy, expected) <= 1e-12 and out.loss.item() == 0.0
