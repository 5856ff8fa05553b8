"""``TeacherMixture`` on one device (issue 38, parts 1–2): every combine mode against its oracle
(tests/support/mixture_cases.py, one-teacher reference calls composed from the definitions), fp64
≤ 1e-9 for the loss, its components and the gradients to the student's hidden states, head and bias.

The torch backend runs the "linear" form: ``log_probabilities`` with any weights, and rows routed to
one teacher of weight 1 for ``probabilities`` and ``divergences``; the reference backend runs every
form. What is not built yet raises (dense ``probabilities``/``divergences`` weights on a chunked
backend, the Triton kernels, tensor parallelism)."""

from __future__ import annotations

import pytest
import torch

import orda_tp
from orda_tp import KL_VARIANTS

from .support.cases import COTRAINED, SMALL_CHUNKS, VARIANT_KWARGS, relative_error, stable_seed
from .support.mixture_cases import ROWS, MixtureProblem, make_problem, oracle

FROZEN_VARIANTS = [variant for variant in KL_VARIANTS if variant not in COTRAINED]
COMBINES = ("divergences", "probabilities", "log_probabilities")


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


def check(
    problem: MixtureProblem, kinds: list[str], weights: torch.Tensor, combine: str, backend: str,
    scalar: bool = False, **kwargs: object,
) -> None:  # fmt: skip
    """The mixture's outputs and gradients equal the oracle's (fp64, 1e-9)."""
    given: torch.Tensor | list[float] = [float(w) for w in weights[0]] if scalar else weights
    mixture = orda_tp.TeacherMixture([problem.teachers[kind] for kind in kinds], given, combine=combine)
    config = None if backend == "reference" else SMALL_CHUNKS
    args = problem.student_hidden, problem.weight, problem.labels
    out = orda_tp.distillation_loss(*args, mixture, bias=problem.bias, backend=backend, config=config, **kwargs)
    expected = oracle(problem, kinds, weights, combine, kwargs)
    for name, value, want in zip(expected._fields, out, expected):
        assert relative_error(value, want) <= 1e-9, (name, relative_error(value, want))
    upstream = torch.rand(out.loss.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    leaves = [problem.student_hidden, problem.weight, problem.bias]
    grads = torch.autograd.grad(out.loss, leaves, upstream)
    wanted = torch.autograd.grad(expected.loss, leaves, upstream)
    for name, grad, want in zip(("student_hidden", "weight", "bias"), grads, wanted):
        assert relative_error(grad, want) <= 1e-9, (name, relative_error(grad, want))


def kl_kwargs(variant: str, reduction: str = "mean") -> dict[str, object]:
    return dict(
        kl_weight=1.3, kl_divergence=variant, kl_temperature=2.0, kl_teacher_temperature=1.5, label_smoothing=0.1,
        reduction=reduction, **VARIANT_KWARGS[variant],
    )  # fmt: skip


@pytest.mark.parametrize("variant", FROZEN_VARIANTS)
def test_log_probabilities_every_variant(variant: str) -> None:
    seed = stable_seed("log_probabilities", variant)
    problem, weights = make_problem(seed), weights_of("dense", 2, seed)
    check(problem, ["separate20", "logits"], weights, "log_probabilities", "torch", **kl_kwargs(variant))


@pytest.mark.parametrize("variant", ["forward", "reverse", "skew_js", "dkd", "entropy_adaptive", "renyi"])
@pytest.mark.parametrize("combine", ["divergences", "probabilities"])
def test_routed_rows(combine: str, variant: str) -> None:
    seed = stable_seed("routed", combine, variant)
    problem, weights = make_problem(seed), weights_of("routed", 3, seed)
    check(problem, ["tied", "separate12", "topk"], weights, combine, "torch", **kl_kwargs(variant))


@pytest.mark.parametrize(
    "kinds", [["tied", "separate20"], ["separate12", "hidden"], ["logits", "topk"], ["tied", "logits", "separate20"]]
)
@pytest.mark.parametrize("weights", ["scalar", "dense", "routed"])
def test_teacher_kinds_log_probabilities(kinds: list[str], weights: str) -> None:
    seed = stable_seed("kinds", *kinds, weights)
    problem = make_problem(seed)
    table = weights_of(weights, len(kinds), seed)
    check(problem, kinds, table, "log_probabilities", "torch", scalar=weights == "scalar", **kl_kwargs("jeffreys"))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("combine", COMBINES)
def test_reductions_caps_and_scales(combine: str, reduction: str) -> None:
    seed = stable_seed("caps", combine, reduction)
    problem, weights = make_problem(seed), weights_of("routed", 2, seed)
    kwargs = dict(
        kl_kwargs("forward", reduction), teacher_logit_softcap=3.0, teacher_logit_scale=1.7, z_loss_weight=0.1
    )
    check(problem, ["separate20", "hidden"], weights, combine, "torch", **kwargs)


@pytest.mark.parametrize("variant", ["forward", "reverse", "skew_reverse", "dkd", "entropy_adaptive", "abkd"])
@pytest.mark.parametrize("combine", COMBINES)
def test_reference_backend_every_form(combine: str, variant: str) -> None:
    seed = stable_seed("reference", combine, variant)
    problem, weights = make_problem(seed), weights_of("dense", 3, seed)
    check(problem, ["tied", "separate12", "logits"], weights, combine, "reference", **kl_kwargs(variant, "sum"))


@pytest.mark.parametrize("combine", COMBINES)
def test_scalar_weights_on_the_reference(combine: str) -> None:
    seed = stable_seed("scalar", combine)
    problem, weights = make_problem(seed), weights_of("scalar", 2, seed)
    check(problem, ["separate20", "topk"], weights, combine, "reference", scalar=True, **kl_kwargs("skew_js"))


def test_one_hot_rows_give_one_loss_in_every_mode() -> None:
    problem = make_problem(11)
    weights = weights_of("routed", 2, 11)
    teachers = [problem.teachers["separate20"], problem.teachers["logits"]]
    args = problem.student_hidden, problem.weight, problem.labels
    losses = [
        orda_tp.distillation_loss(*args, orda_tp.TeacherMixture(teachers, weights, combine), config=SMALL_CHUNKS,
                                  backend="torch", **kl_kwargs("reverse")).loss
        for combine in COMBINES
    ]  # fmt: skip
    for loss in losses[1:]:
        assert relative_error(loss, losses[0]) <= 1e-12


def test_one_teacher_mixture_is_the_teacher() -> None:
    problem = make_problem(12)
    args = problem.student_hidden, problem.weight, problem.labels
    kwargs = dict(kl_kwargs("alpha_divergence"), backend="torch", config=SMALL_CHUNKS, teacher_ce_weight=0.0)
    alone = orda_tp.distillation_loss(*args, problem.teachers["tied"], **kwargs)
    for combine in COMBINES:
        mixed = orda_tp.distillation_loss(
            *args, orda_tp.TeacherMixture([problem.teachers["tied"]], [1.0], combine), **kwargs
        )
        for value, want in zip(mixed, alone):
            assert relative_error(value, want) <= 1e-12


@pytest.mark.parametrize("combine", ["divergences", "probabilities"])
def test_dense_weights_on_a_chunked_backend_are_not_built_yet(combine: str) -> None:
    problem = make_problem(13)
    mixture = orda_tp.TeacherMixture([problem.teachers["separate20"], problem.teachers["logits"]], [0.5, 0.5], combine)
    with pytest.raises(ValueError, match="not supported yet by the chunked backends"):
        orda_tp.distillation_loss(problem.student_hidden, problem.weight, problem.labels, mixture, backend="torch")


def test_triton_is_not_built_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    # As on a machine where the kernels run (CUDA), so that the mixture's refusal is what raises.
    monkeypatch.setattr(orda_tp.engine.block_math, "unavailable_reason", lambda device, dtype: None)
    problem = make_problem(14)
    mixture = orda_tp.TeacherMixture([problem.teachers["separate20"]], [1.0], "log_probabilities")
    with pytest.raises(ValueError, match="TeacherMixture is not built for the Triton kernels yet"):
        orda_tp.distillation_loss(problem.student_hidden, problem.weight, problem.labels, mixture, backend="triton")
