"""Loss semantics (docs/variants.md §1–§2): routing, reductions, ignored rows, zero support, known values."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import orda_tp
from orda_tp import KL_VARIANTS, DistillationLoss, PrecomputedTeacher, SeparateTeacher, TiedTeacher
from orda_tp.engine import fused as chunked

from .support.cases import SMALL_CHUNKS, VARIANT_KWARGS, make_problem, relative_error, separate_problem

BACKENDS = ["torch", "reference"]


def grads_of(loss: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor | None]:
    return list(torch.autograd.grad(loss, tensors, allow_unused=True, retain_graph=True))


# ---------------------------------------------------------------- teacher routing


@pytest.mark.parametrize("backend", BACKENDS)
def test_tied_default_trains_teacher_through_ce_only(backend: str) -> None:
    p = make_problem()
    inputs = [p.student_hidden, p.weight, p.teacher_hidden]
    both = orda_tp.distillation_loss(
        p.student_hidden, p.weight, p.labels, TiedTeacher(p.teacher_hidden), kl_weight=1.0, backend=backend
    )
    student_only = orda_tp.distillation_loss(
        p.student_hidden,
        p.weight,
        p.labels,
        TiedTeacher(p.teacher_hidden),
        teacher_ce_weight=0.0,
        kl_weight=1.0,
        backend=backend,
    )
    teacher_only = orda_tp.distillation_loss(
        p.student_hidden, p.weight, p.labels, TiedTeacher(p.teacher_hidden), student_ce_weight=0.0, backend=backend
    )
    g_both, g_student, g_teacher = (grads_of(o.loss, inputs) for o in (both, student_only, teacher_only))
    # teacher_ce_weight=None means 1.0 for a tied teacher; the KL stays detached from the teacher.
    assert g_student[2] is None
    assert relative_error(g_both[2], g_teacher[2]) <= 1e-12
    # The shared head gets gradient from both halves.
    assert relative_error(g_both[1], g_student[1] + g_teacher[1]) <= 1e-12
    assert relative_error(g_both[0], g_student[0]) <= 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
def test_separate_teacher_is_frozen_by_default(backend: str) -> None:
    p = separate_problem(make_problem())
    out = orda_tp.distillation_loss(
        p.student_hidden,
        p.weight,
        p.labels,
        SeparateTeacher(p.teacher_hidden, p.teacher_weight),
        kl_weight=1.0,
        kl_divergence="jeffreys",
        backend=backend,
    )
    g = grads_of(out.loss, [p.student_hidden, p.weight, p.teacher_hidden, p.teacher_weight])
    assert g[0] is not None and g[1] is not None
    assert g[2] is None and g[3] is None
    assert out.teacher_ce == 0


@pytest.mark.parametrize("variant", ["mutual", "cojeffreys"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_cotraining_variants_train_the_teacher_without_teacher_ce(variant: str, backend: str) -> None:
    p = separate_problem(make_problem())
    out = orda_tp.distillation_loss(
        p.student_hidden,
        p.weight,
        p.labels,
        SeparateTeacher(p.teacher_hidden, p.teacher_weight),
        teacher_ce_weight=0.0,
        kl_weight=1.0,
        kl_divergence=variant,
        backend=backend,
    )
    g = grads_of(out.loss, [p.teacher_hidden, p.teacher_weight])
    assert all(x is not None and x.abs().sum() > 0 for x in g)


def test_mutual_gradients_are_the_two_stop_gradient_halves() -> None:
    """Student gets ∂KL(sg q‖p), teacher ∂KL(sg p‖q): compare with forward/reverse calls."""
    p = separate_problem(make_problem())
    teacher = SeparateTeacher(p.teacher_hidden, p.teacher_weight)
    common = dict(student_ce_weight=0.0, teacher_ce_weight=0.0, kl_weight=1.0, backend="torch")
    mutual = orda_tp.distillation_loss(p.student_hidden, p.weight, p.labels, teacher, kl_divergence="mutual", **common)
    forward = orda_tp.distillation_loss(p.student_hidden, p.weight, p.labels, teacher, **common)
    g_mutual = grads_of(mutual.loss, [p.student_hidden, p.teacher_hidden])
    g_forward = grads_of(forward.loss, [p.student_hidden])
    assert relative_error(g_mutual[0], g_forward[0]) <= 1e-12
    # Teacher side: KL(sg p‖q) is the forward KL with the roles swapped.
    swapped = orda_tp.distillation_loss(
        p.teacher_hidden,
        p.teacher_weight,
        p.labels,
        SeparateTeacher(p.student_hidden.detach(), p.weight.detach()),
        **common,
    )
    assert relative_error(g_mutual[1], grads_of(swapped.loss, [p.teacher_hidden])[0]) <= 1e-12
    jeffreys = orda_tp.distillation_loss(
        p.student_hidden, p.weight, p.labels, teacher, kl_divergence="jeffreys", **common
    )
    assert relative_error(mutual.kl, jeffreys.kl) <= 1e-12


def test_tied_teacher_mode_asserts_the_role() -> None:
    p = make_problem()
    out = orda_tp.distillation_loss(
        p.student_hidden, p.weight, p.labels, TiedTeacher(p.teacher_hidden, mode="frozen"), teacher_ce_weight=0.0
    )
    assert out.teacher_ce == 0
    orda_tp.distillation_loss(p.student_hidden, p.weight, p.labels, TiedTeacher(p.teacher_hidden, mode="trained"))
    orda_tp.distillation_loss(
        p.student_hidden,
        p.weight,
        p.labels,
        TiedTeacher(p.teacher_hidden, mode="cotrained"),
        kl_weight=0.5,
        kl_divergence="cojeffreys",
    )
    with pytest.raises(ValueError, match="mode='frozen'.*'trained'"):
        orda_tp.distillation_loss(p.student_hidden, p.weight, p.labels, TiedTeacher(p.teacher_hidden, mode="frozen"))


# ---------------------------------------------------------------- reductions and ignored rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_reductions_agree(backend: str) -> None:
    p = make_problem()
    kwargs = dict(kl_weight=0.5, kl_divergence="skew_js", backend=backend)
    teacher = TiedTeacher(p.teacher_hidden)
    outs = {
        r: orda_tp.distillation_loss(p.student_hidden, p.weight, p.labels, teacher, reduction=r, **kwargs)
        for r in ("mean", "sum", "none")
    }
    valid = p.labels != -100
    n = int(valid.sum())
    for field in ("loss", "student_ce", "teacher_ce", "kl"):
        none, total, mean = (getattr(outs[r], field) for r in ("none", "sum", "mean"))
        assert none.shape == p.labels.shape
        assert torch.all(none[~valid] == 0)
        assert relative_error(none.sum(), total) <= 1e-12
        assert relative_error(mean * n, total) <= 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
def test_ignored_rows_get_no_gradient_and_ignore_index_is_never_an_index(backend: str) -> None:
    p = make_problem(ignored_every=0)
    labels = p.labels.clone()
    labels[3] = 7
    labels[4] = 7
    out = orda_tp.distillation_loss(
        p.student_hidden,
        p.weight,
        labels,
        TiedTeacher(p.teacher_hidden),
        ignore_index=7,
        kl_weight=1.0,
        reduction="none",
        backend=backend,
    )
    assert out.loss[3] == 0 and out.loss[4] == 0 and torch.all(out.loss[5:] > 0)
    grad = grads_of(out.loss.sum(), [p.student_hidden])[0]
    assert torch.all(grad[3:5] == 0) and torch.all(grad[5:].abs().sum(1) > 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_rows_ignored_and_empty_batch_give_zero(backend: str) -> None:
    p = make_problem()
    for rows in (p.labels.shape[0], 0):
        hidden = p.student_hidden.detach()[:rows].requires_grad_()
        labels = torch.full((rows,), -100)
        out = orda_tp.distillation_loss(
            hidden, p.weight, labels, TiedTeacher(p.teacher_hidden.detach()[:rows]), kl_weight=1.0, backend=backend
        )
        assert out.loss.item() == 0.0 and out.kl.item() == 0.0
        g = torch.autograd.grad(out.loss, [hidden, p.weight])
        assert all(x is not None and torch.all(x == 0) for x in g)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_weights_are_not_computed(backend: str) -> None:
    p = make_problem()
    out = orda_tp.distillation_loss(
        p.student_hidden,
        p.weight,
        p.labels,
        TiedTeacher(p.teacher_hidden),
        student_ce_weight=0.0,
        teacher_ce_weight=0.0,
        kl_weight=0.0,
        backend=backend,
    )
    assert out.loss.item() == 0 and out.student_ce.item() == 0 and out.teacher_ce.item() == 0 and out.kl.item() == 0
    only_kl = orda_tp.distillation_loss(
        p.student_hidden,
        p.weight,
        p.labels,
        TiedTeacher(p.teacher_hidden),
        student_ce_weight=0.0,
        teacher_ce_weight=0.0,
        kl_weight=2.0,
        backend=backend,
    )
    assert only_kl.student_ce.item() == 0 and only_kl.kl.item() > 0
    assert relative_error(only_kl.loss, 2.0 * only_kl.kl) <= 1e-12


def test_num_valid_tokens_accumulates_micro_batches_into_one_batch() -> None:
    p = make_problem(rows=30)
    teacher_hidden = p.teacher_hidden.detach()
    total = int((p.labels != -100).sum())
    big = orda_tp.distillation_loss(
        p.student_hidden, p.weight, p.labels, TiedTeacher(teacher_hidden), kl_weight=1.0, config=SMALL_CHUNKS
    )
    expected = torch.autograd.grad(big.loss, [p.student_hidden, p.weight])
    accumulated = [torch.zeros_like(p.student_hidden), torch.zeros_like(p.weight)]
    for rows, denominator in ((slice(0, 13), total), (slice(13, 30), torch.tensor(float(total)))):
        hidden = p.student_hidden.detach()[rows].requires_grad_()
        out = orda_tp.distillation_loss(
            hidden,
            p.weight,
            p.labels[rows],
            TiedTeacher(teacher_hidden[rows]),
            kl_weight=1.0,
            num_valid_tokens=denominator,
            config=SMALL_CHUNKS,
        )
        g_hidden, g_weight = torch.autograd.grad(out.loss, [hidden, p.weight])
        accumulated[0][rows] += g_hidden
        accumulated[1] += g_weight
    assert relative_error(accumulated[0], expected[0]) <= 1e-12
    assert relative_error(accumulated[1], expected[1]) <= 1e-12


# ---------------------------------------------------------------- autograd behaviour


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_no_gradient_work_without_grad(monkeypatch: pytest.MonkeyPatch, reduction: str) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("gradient work done while grad is disabled")

    monkeypatch.setattr(chunked, "run_gradient_gemms", fail)
    p = make_problem()
    with torch.no_grad():
        out = orda_tp.distillation_loss(
            p.student_hidden, p.weight, p.labels, TiedTeacher(p.teacher_hidden), kl_weight=1.0, reduction=reduction
        )
    assert not out.loss.requires_grad
    frozen = make_problem()
    out = orda_tp.distillation_loss(
        frozen.student_hidden.detach(),
        frozen.weight.detach(),
        frozen.labels,
        TiedTeacher(frozen.teacher_hidden.detach()),
        kl_weight=1.0,
        reduction=reduction,
    )
    assert not out.loss.requires_grad


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_retain_graph_and_second_backward(reduction: str) -> None:
    p = make_problem()
    out = orda_tp.distillation_loss(
        p.student_hidden,
        p.weight,
        p.labels,
        TiedTeacher(p.teacher_hidden),
        kl_weight=1.0,
        reduction=reduction,
        config=SMALL_CHUNKS,
    )
    loss = out.loss.sum()
    loss.backward(retain_graph=True)
    first = p.student_hidden.grad.clone()
    loss.backward()
    assert relative_error(p.student_hidden.grad, 2 * first) <= 1e-14


def test_outputs_only_loss_is_differentiable() -> None:
    p = make_problem()
    out = orda_tp.distillation_loss(p.student_hidden, p.weight, p.labels, TiedTeacher(p.teacher_hidden), kl_weight=1.0)
    assert out.loss.requires_grad
    assert not (out.student_ce.requires_grad or out.teacher_ce.requires_grad or out.kl.requires_grad)
    assert all(t.dim() == 0 for t in out)


# ---------------------------------------------------------------- zero support and non-finite values


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_support_gives_inf_kl_and_drops_only_its_gradient(backend: str) -> None:
    p = make_problem(ignored_every=0)
    logits = p.teacher_logits.clone()
    logits[2, :50] = float("-inf")  # q = 0 on 50 columns of row 2
    teacher = PrecomputedTeacher(logits=logits)
    kwargs = dict(kl_weight=1.0, reduction="none", backend=backend, config=SMALL_CHUNKS)
    reverse = orda_tp.distillation_loss(
        p.student_hidden, p.weight, p.labels, teacher, kl_divergence="reverse", **kwargs
    )
    assert math.isinf(reverse.kl[2].item()) and reverse.kl[2] > 0
    assert torch.isfinite(reverse.kl[torch.arange(24) != 2]).all()
    ce_only = orda_tp.distillation_loss(p.student_hidden, p.weight, p.labels, teacher, **{**kwargs, "kl_weight": 0.0})
    g_reverse = grads_of(reverse.loss[2], [p.student_hidden])[0]
    g_ce = grads_of(ce_only.loss[2], [p.student_hidden])[0]
    assert torch.isfinite(g_reverse).all()
    assert relative_error(g_reverse, g_ce) <= 1e-12  # the KL gradient of that row is dropped, the CE stays
    forward = orda_tp.distillation_loss(
        p.student_hidden, p.weight, p.labels, teacher, kl_divergence="forward", **kwargs
    )
    assert torch.isfinite(forward.kl).all()  # 0·log 0 = 0 on the teacher's empty columns


@pytest.mark.parametrize("variant", KL_VARIANTS)
def test_an_all_neg_inf_teacher_row_contributes_zero(variant: str) -> None:
    if variant in ("mutual", "cojeffreys"):
        return
    p = make_problem(ignored_every=0)
    logits = p.teacher_logits.clone()
    logits[4] = float("-inf")
    for backend in BACKENDS:
        out = orda_tp.distillation_loss(
            p.student_hidden,
            p.weight,
            p.labels,
            PrecomputedTeacher(logits=logits),
            kl_weight=1.0,
            teacher_ce_weight=1.0,
            kl_divergence=variant,
            reduction="none",
            backend=backend,
            **VARIANT_KWARGS[variant],
        )
        assert out.kl[4] == 0 and out.teacher_ce[4] == 0 and out.student_ce[4] > 0
        assert torch.isfinite(out.loss).all()
        grad = grads_of(out.loss.sum(), [p.student_hidden])[0]
        assert torch.isfinite(grad).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_input_makes_its_row_nan(backend: str) -> None:
    p = make_problem(ignored_every=0)
    hidden = p.student_hidden.detach().clone()
    hidden[6, 0] = float("nan")
    out = orda_tp.distillation_loss(
        hidden, p.weight, p.labels, TiedTeacher(p.teacher_hidden), kl_weight=1.0, reduction="none", backend=backend
    )
    assert torch.isnan(out.loss[6]) and torch.isfinite(out.loss[torch.arange(24) != 6]).all()
    mean = orda_tp.distillation_loss(hidden, p.weight, p.labels, TiedTeacher(p.teacher_hidden), kl_weight=1.0)
    assert torch.isnan(mean.loss)


# ---------------------------------------------------------------- known values


def test_matches_torch_cross_entropy_and_kl_div() -> None:
    p = make_problem()
    t_s, t_t = 2.0, 1.5
    out = orda_tp.distillation_loss(
        p.student_hidden,
        p.weight,
        p.labels,
        PrecomputedTeacher(logits=p.teacher_logits),
        teacher_ce_weight=1.0,
        kl_weight=1.0,
        kl_temperature=t_s,
        kl_teacher_temperature=t_t,
        config=SMALL_CHUNKS,
    )
    logits = p.student_hidden @ p.weight.T
    valid = p.labels != -100
    assert relative_error(out.student_ce, F.cross_entropy(logits, p.labels)) <= 1e-12
    assert relative_error(out.teacher_ce, F.cross_entropy(p.teacher_logits, p.labels)) <= 1e-12
    kl = F.kl_div(
        F.log_softmax(logits[valid] / t_s, -1),
        F.log_softmax(p.teacher_logits[valid] / t_t, -1),
        log_target=True,
        reduction="batchmean",
    )
    assert relative_error(out.kl, t_s**2 * kl) <= 1e-12


@pytest.mark.parametrize("variant", KL_VARIANTS)
def test_identical_distributions_have_zero_divergence(variant: str) -> None:
    p = make_problem()
    out = orda_tp.distillation_loss(
        p.student_hidden,
        p.weight,
        p.labels,
        TiedTeacher(p.student_hidden.detach()),
        kl_weight=1.0,
        kl_divergence=variant,
        reduction="none",
        config=SMALL_CHUNKS,
        **VARIANT_KWARGS[variant],
    )
    assert out.kl.abs().max() <= 1e-12
    assert torch.all(out.kl >= 0)


def test_uniform_student_against_a_known_teacher() -> None:
    """Uniform p (zero head) and a teacher with q = (1/2, 1/4, 1/4, 0…): KL(q‖p) = log V − H(q)."""
    vocab = 10
    hidden = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    weight = torch.zeros(vocab, 3, dtype=torch.float64, requires_grad=True)
    logits = torch.full((2, vocab), float("-inf"), dtype=torch.float64)
    logits[:, :3] = torch.log(torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64))
    out = orda_tp.distillation_loss(
        hidden,
        weight,
        torch.tensor([0, 1]),
        PrecomputedTeacher(logits=logits),
        kl_weight=1.0,
    )
    entropy = -(0.5 * math.log(0.5) + 0.5 * math.log(0.25))
    assert abs(out.kl.item() - (math.log(vocab) - entropy)) <= 1e-14
    assert abs(out.student_ce.item() - math.log(vocab)) <= 1e-14
    reverse = orda_tp.distillation_loss(
        hidden,
        weight,
        torch.tensor([0, 1]),
        PrecomputedTeacher(logits=logits),
        kl_weight=1.0,
        kl_divergence="reverse",
    )
    assert math.isinf(reverse.kl.item())


def test_logits_temperature_declares_a_tempered_cache() -> None:
    p = make_problem()
    temperature = 2.5
    raw = orda_tp.distillation_loss(
        p.student_hidden,
        p.weight,
        p.labels,
        PrecomputedTeacher(logits=p.teacher_logits),
        kl_weight=1.0,
        kl_temperature=temperature,
    )
    tempered = orda_tp.distillation_loss(
        p.student_hidden,
        p.weight,
        p.labels,
        PrecomputedTeacher(logits=p.teacher_logits / temperature, logits_temperature=temperature),
        kl_weight=1.0,
        kl_temperature=temperature,
    )
    assert relative_error(tempered.kl, raw.kl) <= 1e-12


def test_precomputed_hidden_and_weight_equal_precomputed_logits() -> None:
    p = separate_problem(make_problem())
    hidden, head = p.teacher_hidden.detach(), p.teacher_weight.detach()
    from_logits = orda_tp.distillation_loss(
        p.student_hidden, p.weight, p.labels, PrecomputedTeacher(logits=hidden @ head.T), kl_weight=1.0
    )
    from_hidden = orda_tp.distillation_loss(
        p.student_hidden,
        p.weight,
        p.labels,
        PrecomputedTeacher(teacher_hidden=hidden, teacher_weight=head),
        kl_weight=1.0,
        config=SMALL_CHUNKS,
    )
    assert relative_error(from_hidden.loss, from_logits.loss) <= 1e-12


# ---------------------------------------------------------------- precision, module, backends


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_keep_fp32_statistics(dtype: torch.dtype) -> None:
    p = make_problem().to(dtype)
    exact = p.to(torch.float64)  # the same rounded values, in fp64
    kwargs = dict(kl_weight=1.0, kl_temperature=2.0, kl_divergence="jeffreys")
    out = orda_tp.distillation_loss(p.student_hidden, p.weight, p.labels, TiedTeacher(p.teacher_hidden), **kwargs)
    ref = orda_tp.distillation_loss(
        exact.student_hidden,
        exact.weight,
        exact.labels,
        TiedTeacher(exact.teacher_hidden),
        backend="reference",
        **kwargs,
    )
    assert out.loss.dtype == torch.float32
    assert relative_error(out.loss, ref.loss) <= 1e-5
    grad = torch.autograd.grad(out.loss, [p.weight])[0]
    assert grad.dtype == dtype
    assert relative_error(grad, torch.autograd.grad(ref.loss, [exact.weight])[0]) <= 1e-2


def test_module_equals_function_and_profiles_agree() -> None:
    p = make_problem()
    teacher = TiedTeacher(p.teacher_hidden)
    module = DistillationLoss(kl_weight=1.0, kl_divergence="renyi", kl_alpha=1.5, reduction="sum")
    expected = orda_tp.distillation_loss(
        p.student_hidden,
        p.weight,
        p.labels,
        teacher,
        kl_weight=1.0,
        kl_divergence="renyi",
        kl_alpha=1.5,
        reduction="sum",
    )
    assert relative_error(module(p.student_hidden, p.weight, p.labels, teacher).loss, expected.loss) <= 1e-14
    for profile in orda_tp.PROFILES:
        out = orda_tp.distillation_loss(
            p.student_hidden,
            p.weight,
            p.labels,
            teacher,
            kl_weight=1.0,
            kl_divergence="renyi",
            kl_alpha=1.5,
            reduction="sum",
            profile=profile,
        )
        assert relative_error(out.loss, expected.loss) <= 1e-12


def test_debug_profile_rejects_non_finite_inputs() -> None:
    p = make_problem()
    hidden = p.student_hidden.detach().clone()
    hidden[3, 1] = float("inf")
    with pytest.raises(ValueError, match="student_hidden must be finite; row 3"):
        orda_tp.distillation_loss(hidden, p.weight, p.labels, TiedTeacher(p.teacher_hidden), profile="debug")


def test_auto_backend_on_cpu_is_the_chunked_backend_and_triton_is_unavailable() -> None:
    p = make_problem()
    teacher = TiedTeacher(p.teacher_hidden)
    auto = orda_tp.distillation_loss(p.student_hidden, p.weight, p.labels, teacher, kl_weight=1.0)
    torch_backend = orda_tp.distillation_loss(
        p.student_hidden, p.weight, p.labels, teacher, kl_weight=1.0, backend="torch"
    )
    assert torch.equal(auto.loss, torch_backend.loss)
    assert orda_tp.is_available() is False
    with pytest.raises(ValueError, match="backend='triton' is unavailable on this machine"):
        orda_tp.distillation_loss(p.student_hidden, p.weight, p.labels, teacher, backend="triton")


def test_autocast_does_not_round_the_logits() -> None:
    p = make_problem(dtype=torch.float32)
    teacher = TiedTeacher(p.teacher_hidden)
    for reduction in ("mean", "none"):
        plain = orda_tp.distillation_loss(
            p.student_hidden, p.weight, p.labels, teacher, kl_weight=1.0, reduction=reduction
        )
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = orda_tp.distillation_loss(
                p.student_hidden, p.weight, p.labels, teacher, kl_weight=1.0, reduction=reduction
            )
            grad = torch.autograd.grad(autocast.loss.sum(), [p.weight])[0]
        assert autocast.loss.dtype == torch.float32
        assert relative_error(autocast.loss, plain.loss) <= 1e-6
        assert relative_error(grad, torch.autograd.grad(plain.loss.sum(), [p.weight])[0]) <= 1e-6


def test_callable_inside_torch_compiled_code() -> None:
    p = make_problem(dtype=torch.float32)

    def step(hidden: torch.Tensor, weight: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        out = orda_tp.distillation_loss(
            hidden, weight, p.labels, TiedTeacher(teacher), kl_weight=1.0, kl_divergence="jeffreys"
        )
        return 2.0 * out.loss

    inputs = [p.student_hidden, p.weight]
    eager = step(p.student_hidden, p.weight, p.teacher_hidden)
    compiled = torch.compile(step, backend="aot_eager")(p.student_hidden, p.weight, p.teacher_hidden)
    assert relative_error(compiled, eager) <= 1e-12
    for grad, expected in zip(torch.autograd.grad(compiled, inputs), torch.autograd.grad(eager, inputs)):
        assert relative_error(grad, expected) <= 1e-12
