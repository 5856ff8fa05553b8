"""TRL's JSD(β) by name: ``kl_divergence="generalized_jsd"`` with ``kl_beta = β`` in [0, 1], the
teacher's weight in the mixture (docs/variants.md, "TRL's generalized JSD").

- Against a hand-written fp64 oracle (:func:`trl_divergence`, full logits in this file):
  ``β·KL(q‖m) + (1−β)·KL(p‖m)``, ``m = β·q + (1−β)·p``, and TRL's special cases ``KL(q‖p)`` at
  β = 0 and ``KL(p‖q)`` at β = 1; the ``kl`` component is ``T_s²·D`` (orda's convention), the loss
  and its gradients by autograd through the oracle; torch, reference and Triton (interpreted) backends,
  every reduction; ``KDLoss`` on given logits.
- The identity the alias rests on: β = 0 is ``forward``, β = 1 ``reverse``, 0 < β < 1 ``skew_js``
  with ``kl_beta = 1 − β``, bitwise.
- The options keep the name and β as given (so that ``replace`` rebuilds the same loss); gloo
  ranks (2 and 3) give the single-device value. Its errors: tests/test_errors_variants.py.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

import orda_tp
from orda_tp.arguments.options import LossOptions

from .support.cases import SMALL_CHUNKS, make_problem, relative_error, separate_problem
from .support.distributed import run_distributed
from .support.tp_workers import chunk_ranges

BETAS = (0.0, 0.1, 0.5, 0.9, 1.0)
T_S = 2.0


def _kl(x: Tensor, log_x: Tensor, log_y: Tensor) -> Tensor:
    return torch.where(x == 0, 0.0, x * (log_x - log_y)).sum(-1)


def trl_divergence(student: Tensor, teacher: Tensor, beta: float, temperature: float) -> Tensor:
    """TRL's per-row divergence (``trl/kernels/chunked_divergence.py``) from full logits."""
    logp = torch.log_softmax(student / temperature, -1)
    logq = torch.log_softmax(teacher / temperature, -1)
    p, q = logp.exp(), logq.exp()
    if beta == 0.0:
        return _kl(q, logq, logp)
    if beta == 1.0:
        return _kl(p, logp, logq)
    log_m = torch.log(beta * q + (1 - beta) * p)
    return beta * _kl(q, logq, log_m) + (1 - beta) * _kl(p, logp, log_m)


def oracle(problem: Any, beta: float, reduction: str) -> tuple[Tensor, Tensor, list[Tensor]]:
    """``(loss, kl, [∂loss/∂h_s, ∂loss/∂W])`` of ``kl_weight = 0.6`` times ``T²·JSD(β)`` alone."""
    hidden = problem.student_hidden.detach().double().requires_grad_()
    weight = problem.weight.detach().double().requires_grad_()
    teacher = problem.teacher_hidden.detach().double() @ problem.teacher_weight.detach().double().T
    valid = problem.labels != -100
    rows = torch.where(valid, T_S**2 * trl_divergence(hidden @ weight.T, teacher, beta, T_S), 0.0)
    kl = {"none": rows, "sum": rows.sum(), "mean": rows.sum() / valid.sum()}[reduction]
    loss = 0.6 * kl
    grads = torch.autograd.grad(loss.sum(), [hidden, weight])
    return loss.detach(), kl.detach(), list(grads)


def jsd_call(problem: Any, backend: str, **keywords: Any) -> orda_tp.DistillationLossOutput:
    teacher = orda_tp.SeparateTeacher(problem.teacher_hidden.detach(), problem.teacher_weight.detach())
    return orda_tp.distillation_loss(
        problem.student_hidden, problem.weight, problem.labels, teacher, student_ce_weight=0.0, kl_weight=0.6,
        kl_temperature=T_S, backend=backend, config=None if backend == "reference" else SMALL_CHUNKS, **keywords,
    )  # fmt: skip


def _problem(dtype: torch.dtype) -> Any:
    return separate_problem(make_problem(rows=24, vocab=203, seed=9)).to(dtype)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("backend", ["torch", "reference", "triton"])
def test_generalized_jsd_is_trls(beta: float, reduction: str, backend: str) -> None:
    if backend == "triton":
        pytest.importorskip("triton")
        if reduction != "mean":
            pytest.skip("the interpreter is slow: one reduction suffices for the kernels")
    dtype, tolerance = (torch.float32, 2e-5) if backend == "triton" else (torch.float64, 1e-11)
    problem = _problem(dtype)
    out = jsd_call(problem, backend, kl_divergence="generalized_jsd", kl_beta=beta, reduction=reduction)
    loss, kl, grads = oracle(problem, beta, reduction)
    assert relative_error(out.loss, loss) <= tolerance and relative_error(out.kl, kl) <= tolerance
    mine = torch.autograd.grad(out.loss.sum(), [problem.student_hidden, problem.weight])
    for grad, want in zip(mine, grads):
        assert relative_error(grad, want) <= tolerance


@pytest.mark.parametrize("beta", BETAS)
def test_the_alias_is_forward_reverse_or_skew_js(beta: float) -> None:
    """Bitwise the variant the alias stands for: orda's ``skew_js`` ``kl_beta`` weights the student."""
    problem = _problem(torch.float64)
    variant: dict[str, Any] = {0.0: {"kl_divergence": "forward"}, 1.0: {"kl_divergence": "reverse"}}.get(
        beta, {"kl_divergence": "skew_js", "kl_beta": 1.0 - beta}
    )
    alias = jsd_call(problem, "torch", kl_divergence="generalized_jsd", kl_beta=beta)
    same = jsd_call(problem, "torch", **variant)
    for name in alias._fields:
        assert torch.equal(getattr(alias, name), getattr(same, name)), name
    grads = [torch.autograd.grad(out.loss, [problem.student_hidden, problem.weight]) for out in (alias, same)]
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_default_beta_and_kept_options() -> None:
    """kl_beta=None is 0.5 (TRL's DistillationConfig defaults to 1.0, GKD to 0.5); the options
    keep the name and β as given, so that replace (a per-call precision) rebuilds the same loss."""
    options = LossOptions(kl_divergence="generalized_jsd", kl_weight=1.0)
    assert options.divergence.name == "skew_js" and dict(options.params) == {"kl_beta": 0.5}
    for beta, name in ((0.0, "forward"), (0, "forward"), (1, "reverse"), (0.25, "skew_js")):
        options = LossOptions(kl_divergence="generalized_jsd", kl_beta=beta)
        assert (options.kl_divergence, options.kl_beta, options.divergence.name) == ("generalized_jsd", beta, name)
        rebuilt = dataclasses.replace(options, reduction="sum")
        assert (rebuilt.divergence, rebuilt.params) == (options.divergence, options.params)
    assert dict(LossOptions(kl_divergence="generalized_jsd", kl_beta=0.25).params) == {"kl_beta": 0.75}
    module = orda_tp.DistillationLoss(kl_divergence="generalized_jsd", kl_beta=0.0)
    assert "kl_divergence='generalized_jsd'" in repr(module)


def test_unread_keywords_warn_or_raise_as_for_a_variant() -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        options = LossOptions(kl_divergence="generalized_jsd", kl_beta=0.0, kl_alpha=0.3)
    assert [str(w.message) for w in record] == [
        "kl_alpha=0.3 is ignored: kl_divergence='generalized_jsd' reads only kl_beta; "
        "leave kl_alpha=None to silence this warning"
    ]
    assert options.kl_alpha is None and options.kl_beta == 0.0
    with pytest.raises(ValueError, match="kl_alpha=0.3 is not used by kl_divergence='generalized_jsd'"):
        orda_tp.KDLoss(kl_divergence="generalized_jsd", kl_alpha=0.3)


@pytest.mark.parametrize("beta", BETAS)
def test_kd_loss_on_given_logits(beta: float) -> None:
    """KDLoss's mean over the valid rows of ``T²·JSD(β)``."""
    generator = torch.Generator().manual_seed(2)
    student = torch.randn(12, 50, generator=generator, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(12, 50, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 50, (12,), generator=generator)
    labels[::4] = -100
    loss = orda_tp.KDLoss(temperature=T_S, kl_divergence="generalized_jsd", kl_beta=beta, backend="torch")(
        student, teacher, labels
    )
    valid = labels != -100
    expected = T_S**2 * trl_divergence(student[valid], teacher[valid], beta, T_S).mean()
    assert relative_error(loss, expected) <= 1e-12
    (grad,) = torch.autograd.grad(loss, student)
    (want,) = torch.autograd.grad(expected, student)
    assert relative_error(grad, want) <= 1e-12


def jsd_tp_worker(rank: int, world: int) -> list[str]:
    """β ∈ {0, 0.3, 1} on uneven vocabulary shards against the oracle on one device."""
    problem = _problem(torch.float64)
    start, stop = chunk_ranges(203, world)[rank]
    problems = []
    for beta in (0.0, 0.3, 1.0):
        hidden = problem.student_hidden.detach().clone().requires_grad_()
        weight = problem.weight.detach()[start:stop].clone().requires_grad_()
        teacher = orda_tp.SeparateTeacher(problem.teacher_hidden.detach(), problem.teacher_weight.detach()[start:stop])
        out = orda_tp.distillation_loss(
            hidden, weight, problem.labels, teacher, student_ce_weight=0.0, kl_weight=0.6, kl_temperature=T_S,
            kl_divergence="generalized_jsd", kl_beta=beta, backend="torch", config=SMALL_CHUNKS,
            tp_group=dist.group.WORLD,
        )  # fmt: skip
        loss, _, grads = oracle(problem, beta, "mean")
        mine = torch.autograd.grad(out.loss, [hidden, weight])
        errors = [
            relative_error(out.loss, loss),
            relative_error(mine[0], grads[0]),
            relative_error(mine[1], grads[1][start:stop]),
        ]
        if max(errors) > 1e-11:
            problems.append(f"world={world} beta={beta}: errors {errors}")
    return problems


@pytest.mark.parametrize("world_size", [2, 3])
def test_tensor_parallel(world_size: int) -> None:
    results = run_distributed(world_size, jsd_tp_worker, timeout=180)
    problems = [f"rank {rank}: {problem}" for rank, found in enumerate(results) for problem in found]
    assert not problems, "\n".join(problems)
