"""``TeacherMixture`` on one device (issue 38, parts 1–2): every combine mode against its oracle
(tests/support/mixture_cases.py, one-teacher reference calls composed from the definitions), fp64
≤ 1e-9 for the loss, its components and the gradients to the student's hidden states, head and bias.

The torch backend runs every form: "linear" (``log_probabilities`` with any weights, and rows routed
to one teacher of weight 1 for ``probabilities`` and ``divergences``), "mixed" (dense
``probabilities``) and "views" (dense ``divergences``), as does the reference backend; the Triton
kernels (interpreted on a CPU) too, in fp32. Tensor parallelism: tests/test_mixture_parallel.py."""

from __future__ import annotations

import math

import pytest
import torch

import orda_tp
from orda_tp import KL_VARIANTS

from .support.cases import COTRAINED, SMALL_CHUNKS, VARIANT_KWARGS, relative_error, stable_seed
from .support.mixture_cases import HIDDEN, ROWS, MixtureProblem, in_float32, make_problem, oracle, weights_of

FROZEN_VARIANTS = [variant for variant in KL_VARIANTS if variant not in COTRAINED]
COMBINES = ("divergences", "probabilities", "log_probabilities")


def check(
    problem: MixtureProblem, kinds: list[str], weights: torch.Tensor, combine: str, backend: str,
    scalar: bool = False, float32: bool = False, **kwargs: object,
) -> None:  # fmt: skip
    """The mixture's outputs and gradients equal the oracle's (fp64: 1e-9; ``float32``: its inputs in
    fp32, 2e-5)."""
    given: torch.Tensor | list[float] = [float(w) for w in weights[0]] if scalar else weights
    teachers = [problem.teachers[kind] for kind in kinds]
    exact = [problem.student_hidden, problem.weight, problem.bias]
    leaves = [leaf.detach().float().requires_grad_() for leaf in exact] if float32 else exact
    if float32:
        teachers = [in_float32(teacher) for teacher in teachers]  # type: ignore[misc]
        given = given.float() if isinstance(given, torch.Tensor) else given
    mixture = orda_tp.TeacherMixture(teachers, given, combine=combine)
    config = None if backend == "reference" else SMALL_CHUNKS
    out = orda_tp.distillation_loss(
        leaves[0], leaves[1], problem.labels, mixture, bias=leaves[2], backend=backend, config=config, **kwargs
    )
    expected = oracle(problem, kinds, weights, combine, kwargs)
    tolerance = 2e-5 if float32 else 1e-9
    for name, value, want in zip(expected._fields, out, expected):
        assert relative_error(value, want) <= tolerance, (name, relative_error(value, want))
    upstream = torch.rand(out.loss.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad(out.loss, leaves, upstream.to(out.loss.dtype))
    wanted = torch.autograd.grad(expected.loss, exact, upstream)
    for name, grad, want in zip(("student_hidden", "weight", "bias"), grads, wanted):
        assert relative_error(grad, want) <= tolerance, (name, relative_error(grad, want))


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


@pytest.mark.parametrize("combine", COMBINES)
def test_a_tensor_of_n_weights_is_n_numbers(combine: str) -> None:
    """Weights as a (n,) tensor read as the same n numbers (once, on the host): bitwise the same loss."""
    problem = make_problem(16)
    teachers = [problem.teachers["separate20"], problem.teachers["logits"]]
    args = problem.student_hidden, problem.weight, problem.labels
    kwargs = dict(kl_kwargs("forward"), backend="torch", config=SMALL_CHUNKS)
    numbers = orda_tp.distillation_loss(*args, orda_tp.TeacherMixture(teachers, [0.25, 0.75], combine), **kwargs)
    as_tensor = orda_tp.TeacherMixture(teachers, torch.tensor([0.25, 0.75], dtype=torch.float64), combine)
    assert torch.equal(orda_tp.distillation_loss(*args, as_tensor, **kwargs).loss, numbers.loss)


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


@pytest.mark.parametrize("variant", FROZEN_VARIANTS)
def test_probabilities_dense_every_variant(variant: str) -> None:
    seed = stable_seed("probabilities", variant)
    problem, weights = make_problem(seed), weights_of("dense", 3, seed)
    reduction = ("mean", "sum", "none")[seed % 3]
    check(problem, ["tied", "separate20", "topk"], weights, "probabilities", "torch", **kl_kwargs(variant, reduction))


@pytest.mark.parametrize("variant", FROZEN_VARIANTS)
def test_divergences_dense_every_variant(variant: str) -> None:
    seed = stable_seed("divergences", variant)
    problem, weights = make_problem(seed), weights_of("dense", 3, seed)
    weights[7] *= 2.5  # "divergences" weights need not sum to 1
    reduction = ("mean", "sum", "none")[seed % 3]
    check(problem, ["tied", "separate20", "topk"], weights, "divergences", "torch", **kl_kwargs(variant, reduction))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_divergences_scalar_weights_without_student_terms(reduction: str) -> None:
    problem = make_problem(21)
    weights = weights_of("scalar", 2, 21) * 1.5
    kwargs = dict(kl_kwargs("reverse", reduction), student_ce_weight=0.0, label_smoothing=0.0)
    check(problem, ["separate12", "logits"], weights, "divergences", "torch", scalar=True, **kwargs)


@pytest.mark.parametrize("variant", ["forward", "reverse", "skew_js", "dkd"])
@pytest.mark.parametrize(
    ("combine", "weights", "kinds"),
    [
        ("log_probabilities", "dense", ["separate20", "logits"]),
        ("divergences", "routed", ["tied", "separate12", "topk"]),
        ("probabilities", "routed", ["tied", "hidden"]),
        ("probabilities", "dense", ["separate12", "logits"]),
        ("divergences", "dense", ["tied", "separate20"]),
    ],
)
def test_triton(combine: str, weights: str, kinds: list[str], variant: str) -> None:
    pytest.importorskip("triton")
    seed = stable_seed("triton", combine, variant)
    problem, table = make_problem(seed), weights_of(weights, len(kinds), seed)
    check(problem, kinds, table, combine, "triton", float32=True, **kl_kwargs(variant))


def test_doors_and_teacher_heads() -> None:
    """``DistillationLoss`` and ``DistillationHead`` take a mixture as any teacher; a ``TeacherHead``
    member reads its module's weight and bias (no gradient reaches them: the teachers are frozen)."""
    problem = make_problem(15)
    member = problem.teachers["separate20"]
    assert isinstance(member, orda_tp.SeparateTeacher) and member.bias is not None
    module = torch.nn.Linear(20, member.weight.shape[0], dtype=torch.float64)
    with torch.no_grad():
        module.weight.copy_(member.weight), module.bias.copy_(member.bias)
    weights = weights_of("routed", 2, 15)
    kwargs = dict(kl_kwargs("reverse"), backend="torch", config=SMALL_CHUNKS)
    args = problem.student_hidden, problem.weight, problem.labels
    expected = orda_tp.distillation_loss(
        *args, orda_tp.TeacherMixture([member, problem.teachers["logits"]], weights), **kwargs
    )
    with_head = orda_tp.TeacherMixture(
        [orda_tp.TeacherHead(member.hidden, module), problem.teachers["logits"]], weights
    )
    through_module = orda_tp.DistillationLoss(**kwargs)(*args, with_head)
    assert relative_error(through_module.loss, expected.loss) <= 1e-12
    through_module.loss.backward()
    assert module.weight.grad is None and module.bias.grad is None
    head = orda_tp.DistillationHead(HIDDEN, problem.weight.shape[0], dtype=torch.float64, **kwargs)
    with torch.no_grad():
        head.weight.copy_(problem.weight)
    out = head(problem.student_hidden.detach(), labels=problem.labels, teacher=with_head)
    assert relative_error(out.loss, expected.loss) <= 1e-12


@pytest.mark.parametrize("combine", COMBINES)
def test_a_teacher_absent_on_a_row(combine: str) -> None:
    """A cache row of −inf: "divergences" drops that term, "probabilities" renormalizes over the
    other teachers (here: the row's one teacher is the other), "log_probabilities" vetoes the row."""
    problem = make_problem(16)
    logits = problem.raw["logits"].clone()
    logits[4] = -math.inf
    problem.teachers["logits"], problem.raw["logits"] = orda_tp.PrecomputedTeacher(logits=logits), logits
    weights = weights_of("routed", 2, 16)
    weights[4] = torch.tensor([0.0, 1.0]) if combine != "log_probabilities" else weights[4]
    check(problem, ["separate12", "logits"], weights, combine, "torch", **kl_kwargs("forward"))
    out = orda_tp.distillation_loss(
        problem.student_hidden, problem.weight, problem.labels,
        orda_tp.TeacherMixture([problem.teachers["separate12"], problem.teachers["logits"]], weights, combine),
        backend="torch", **dict(kl_kwargs("forward"), reduction="none"),
    )  # fmt: skip
    assert out.kl[4] == 0.0 or combine == "log_probabilities" and not bool((weights[4] > 0).any())


@pytest.mark.parametrize("combine", COMBINES)
def test_a_teacher_absent_on_a_dense_row(combine: str) -> None:
    """The same on dense weights (the reference backend): the row keeps its other teacher."""
    problem = make_problem(17)
    logits = problem.raw["logits"].clone()
    logits[4] = -math.inf
    problem.teachers["logits"], problem.raw["logits"] = orda_tp.PrecomputedTeacher(logits=logits), logits
    weights = weights_of("dense", 3, 17)
    check(problem, ["separate12", "logits", "tied"], weights, combine, "reference", **kl_kwargs("skew_forward", "none"))


@pytest.mark.parametrize("combine", COMBINES)
def test_token_weights_entropy_and_a_global_mean(combine: str) -> None:
    problem = make_problem(18)
    token_weights = torch.rand(ROWS, dtype=torch.float64, generator=torch.Generator().manual_seed(18))
    kwargs = dict(kl_kwargs("jeffreys"), token_weights=token_weights, student_entropy=True, num_valid_tokens=40.0)
    check(problem, ["tied", "topk"], weights_of("routed", 2, 18), combine, "torch", **kwargs)


def test_a_teacher_reads_only_its_rows() -> None:
    """Per-row weights: only the rows that weigh on a teacher reach its logits (its hidden states
    elsewhere may be anything, NaN here), in runs and in scattered rows alike (the GEMM itself runs
    over those rows alone: ``engine/mixture_blocks.py``, ``_Member.chunk_rows``)."""
    problem = make_problem(19)
    weights = weights_of("routed", 2, 19)
    weights[:8] = torch.tensor([1.0, 0.0])  # a run of rows for teacher 0, then scattered rows
    clean = [problem.teachers["separate20"], problem.teachers["separate12"]]
    poisoned = []
    for index, teacher in enumerate(clean):
        assert isinstance(teacher, orda_tp.SeparateTeacher)
        hidden = teacher.hidden.clone()
        hidden[weights[:, index] == 0] = math.nan
        poisoned.append(orda_tp.SeparateTeacher(hidden, teacher.weight, teacher.bias))
    args = problem.student_hidden, problem.weight, problem.labels
    kwargs = dict(kl_kwargs("forward"), backend="torch", config=SMALL_CHUNKS)
    for combine in COMBINES:
        expected = orda_tp.distillation_loss(*args, orda_tp.TeacherMixture(clean, weights, combine), **kwargs)
        out = orda_tp.distillation_loss(*args, orda_tp.TeacherMixture(poisoned, weights, combine), **kwargs)
        assert relative_error(out.loss, expected.loss) <= 1e-12


def test_forward_divergences_and_probabilities_share_their_gradient() -> None:
    """Σ_i w_i·KL(q_i‖p) = KL(q̄‖p) + a constant of the student (Σ_i w_i = 1): one gradient."""
    problem = make_problem(20)
    weights = weights_of("dense", 3, 20)
    teachers = [problem.teachers[kind] for kind in ("tied", "separate12", "logits")]
    args = problem.student_hidden, problem.weight, problem.labels
    grads = []
    for combine in ("divergences", "probabilities"):
        mixture = orda_tp.TeacherMixture(teachers, weights, combine)
        loss = orda_tp.distillation_loss(*args, mixture, backend="reference", **kl_kwargs("forward")).loss
        grads.append(torch.autograd.grad(loss, [problem.student_hidden, problem.weight]))
    for grad, want in zip(*grads):
        assert relative_error(grad, want) <= 1e-12


@pytest.mark.parametrize(("weights", "scalar"), [("routed", False), ("scalar", True)])
def test_epilogue_accumulation(monkeypatch: pytest.MonkeyPatch, weights: str, scalar: bool) -> None:
    """The linear form adds a head teacher's logits into the block in its GEMM's epilogue (bf16 on
    CUDA: ``logits.addmm_fp32_into``); stood in for here by the same ``β·target + α·left·right`` on
    the CPU, the rows and α it is handed (weight × scale / temperature) must give the oracle's loss."""
    from orda_tp.engine import mixture_blocks

    calls = []

    def epilogue(target: torch.Tensor, left: torch.Tensor, right: torch.Tensor, beta: float, alpha: float) -> bool:
        calls.append(left.shape[0])
        target.mul_(beta).add_(left.to(target.dtype) @ right.to(target.dtype), alpha=alpha)
        return True

    monkeypatch.setattr(mixture_blocks, "addmm_fp32_into", epilogue)
    problem = make_problem(21)
    given = weights_of(weights, 2, 21)
    kwargs = dict(kl_kwargs("reverse"), kl_temperature=1.7, logit_scale=1.3, teacher_logit_scale=1.3)
    check(problem, ["tied", "hidden"], given, "log_probabilities", "torch", scalar=scalar, **kwargs)
    assert calls, "no teacher was added in the epilogue"
