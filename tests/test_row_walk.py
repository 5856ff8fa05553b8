"""How the chunked backends walk rows: one walker for every logits source, gradient groups, ignored
rows, value checks that stay off the host (the CUDA default), and where a head weight's gradient is
summed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch

import orda_tp
from orda_tp import KernelConfig, PrecomputedTeacher, TiedTeacher
from orda_tp.engine import fused, gradient_gemms
from orda_tp.engine.block_math import select_backend
from orda_tp.engine.call import Call
from orda_tp.engine.logits import HeadLogits, LogitGrads, PairedLogits, StoredLogits, TiedLogits
from orda_tp.engine.row_walk import GradTarget, row_ranges, walk_rows
from orda_tp.engine.workspace import RowLayout
from orda_tp.parallel.layout import VocabLayout

from .support.cases import (
    COTRAINED,
    TEACHER_MODES,
    NanFilledEmpty,
    call_kwargs,
    loss_and_grads,
    make_problem,
    relative_error,
    separate_problem,
    stable_seed,
)
from .test_merge import make_plan

HOST_CHECKS_OFF = KernelConfig(host_checks=False)  # what a CUDA call does by default


@pytest.fixture
def small_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 5 rows, gradient groups of 10: several groups and a short last chunk."""
    monkeypatch.setattr(fused, "row_layout", lambda *args: RowLayout(chunk_rows=5, group_rows=10))


def problem_for(mode: str, seed: int, dtype: torch.dtype = torch.float64):  # noqa: ANN201
    base = make_problem(rows=23, vocab=203, seed=seed, dtype=dtype)
    return separate_problem(base) if mode == "separate" else base


@pytest.mark.usefixtures("small_groups")
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("mode", TEACHER_MODES)
@pytest.mark.parametrize("variant", ["forward", "skew_js", "dkd", "mutual"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_several_gradient_groups_match_the_reference(variant: str, mode: str, reduction: str, backend: str) -> None:
    if variant in COTRAINED and mode == "precomputed":
        pytest.skip("co-training variants need a trainable teacher")
    dtype = torch.float64 if backend == "torch" else torch.float32
    base = problem_for(mode, stable_seed(variant, mode), dtype)
    exact = base.to(torch.float64)
    kwargs = call_kwargs(variant, mode, reduction)
    upstream = None
    if reduction == "none":
        upstream = torch.rand(23, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    expected, expected_grads = loss_and_grads(exact, mode, upstream, backend="reference", **kwargs)
    actual, actual_grads = loss_and_grads(
        base, mode, None if upstream is None else upstream.to(dtype), backend=backend, **kwargs
    )
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    for field in ("loss", "student_ce", "teacher_ce", "kl"):
        assert relative_error(getattr(actual, field), getattr(expected, field)) <= tolerance, field
    for index, (grad, reference) in enumerate(zip(actual_grads, expected_grads)):
        assert (grad is None) == (reference is None), index
        if grad is not None:
            assert relative_error(grad, reference) <= tolerance, index


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_one_walker_reads_stored_formed_and_tied_logits_alike(backend: str) -> None:
    """The row walk gives the same statistics and logit gradients whether a chunk's logits are
    stored, formed block by block as ``hidden · weightᵀ``, or formed for both sides by one GEMM
    of the stacked rows (a tied head): with the logits as hidden states and the identity as the
    head, all three read the same numbers."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    rows, vocab = 11, 203
    generator = torch.Generator().manual_seed(7)
    student, teacher = (2 * torch.randn(2, rows, vocab, generator=generator, dtype=torch.float64)).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    labels[::4] = -100
    plan = make_plan("jeffreys", vocab, TiedTeacher(teacher))  # both sides trained: two staged gradients
    math = select_backend(backend, student.device.type, dtype)
    assert math is not None
    layout = VocabLayout(
        vocab_start=0,
        vocab_stop=vocab,
        total_columns=vocab,
        vocab_size=vocab,
        max_local_columns=vocab,
        local_columns=vocab,
        real_local_columns=vocab,
    )
    walk = Call(plan, layout, math, None, labels, labels != -100)
    identity = torch.eye(vocab, dtype=dtype)
    sources = [
        PairedLogits(StoredLogits(student), StoredLogits(teacher)),
        PairedLogits(HeadLogits(student, identity), HeadLogits(teacher, identity)),
        TiedLogits(student, teacher, identity),
    ]
    chunks = row_ranges(0, rows, 4)
    walked = []
    for source in sources:
        stats = walk_rows(walk, source, chunks, dtype)
        staging = LogitGrads(torch.empty(rows, vocab, dtype=dtype), torch.empty(rows, vocab, dtype=dtype))
        walk_rows(walk, source, chunks, dtype, stats, GradTarget(staging, 0, torch.ones((), dtype=dtype)))
        walked.append((torch.cat([s.kl for s in stats]), torch.cat([s.student_ce for s in stats]), staging))
    (kl, student_ce, staging), *others = walked
    assert torch.isfinite(kl).any() and staging.teacher is not None
    exactly = {"rtol": 0.0, "atol": 0.0, "equal_nan": True}  # ignored rows' values are NaN
    for other_kl, other_ce, other_staging in others:
        torch.testing.assert_close(other_kl, kl, **exactly)
        torch.testing.assert_close(other_ce, student_ce, **exactly)
        torch.testing.assert_close(other_staging.student, staging.student, **exactly)
        assert other_staging.teacher is not None
        torch.testing.assert_close(other_staging.teacher, staging.teacher, **exactly)


@contextmanager
def no_host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every way Python code reads a tensor's value on the host raises (on CUDA each of them
    would synchronize with the device)."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a tensor value was read on the host")

    with monkeypatch.context() as patch:
        for name in ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "nonzero", "numpy"):
            patch.setattr(torch.Tensor, name, refuse)
        yield


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("mode", TEACHER_MODES)
def test_default_cuda_policy_reads_no_tensor_value(monkeypatch: pytest.MonkeyPatch, mode: str, reduction: str) -> None:
    base = problem_for(mode, 4)
    kwargs = {**call_kwargs("jeffreys", mode, reduction), "config": HOST_CHECKS_OFF}
    if reduction == "mean":
        kwargs["num_valid_tokens"] = torch.tensor(17.0, dtype=torch.float64)
    expected, expected_grads = loss_and_grads(base, mode, None if reduction != "none" else torch.ones(23), **kwargs)
    teacher = base.teacher(mode)
    with no_host_reads(monkeypatch):
        out = orda_tp.distillation_loss(base.student_hidden, base.weight, base.labels, teacher, **kwargs)
        grads = torch.autograd.grad(out.loss.sum(), base.trainable(mode), allow_unused=True)
    assert relative_error(out.loss.sum(), expected.loss.sum()) <= 1e-14
    for grad, reference in zip(grads, expected_grads):
        assert (grad is None) == (reference is None)
        if grad is not None:
            assert relative_error(grad, reference) <= 1e-14


def test_host_checks_off_a_bad_label_makes_its_row_nan_in_loss_and_gradient() -> None:
    p = make_problem(rows=12, ignored_every=0)
    labels = p.labels.clone()
    labels[5] = 203  # one past the vocabulary
    out = orda_tp.distillation_loss(
        p.student_hidden, p.weight, labels, TiedTeacher(p.teacher_hidden), kl_weight=1.0, reduction="none",
        config=HOST_CHECKS_OFF,
    )  # fmt: skip
    assert torch.isnan(out.loss[5]) and torch.isfinite(out.loss[torch.arange(12) != 5]).all()
    grad = torch.autograd.grad(out.loss.nansum(), [p.student_hidden])[0]
    assert torch.isnan(grad[5]).all() and torch.isfinite(grad[torch.arange(12) != 5]).all()
    with pytest.raises(ValueError, match="labels must lie in"):
        orda_tp.distillation_loss(p.student_hidden, p.weight, labels, TiedTeacher(p.teacher_hidden))


def test_host_checks_off_a_non_finite_cache_makes_its_row_nan() -> None:
    p = make_problem(rows=12, ignored_every=0)
    logits = p.teacher_logits.clone()
    logits[3, 7] = float("nan")
    teacher = PrecomputedTeacher(logits=logits)
    out = orda_tp.distillation_loss(
        p.student_hidden, p.weight, p.labels, teacher, kl_weight=1.0, reduction="none", config=HOST_CHECKS_OFF
    )
    assert torch.isnan(out.kl[3]) and torch.isfinite(out.kl[torch.arange(12) != 3]).all()
    with pytest.raises(ValueError, match="teacher.logits"):
        orda_tp.distillation_loss(p.student_hidden, p.weight, p.labels, teacher, kl_weight=1.0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("variant", ["forward", "mutual"])
def test_ignored_rows_with_non_finite_hidden_states_get_no_gradient(backend: str, variant: str) -> None:
    """Ignored rows' hidden states are never read into a gradient: with ``mutual`` the tied head's
    weight gradient takes both sides in one GEMM ([dS_s; dS_t]ᵀ·[h_s; h_t]) and the teacher's
    hidden states are trained too."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    p = make_problem(rows=12, ignored_every=4, dtype=dtype)  # rows 0, 4, 8 ignored
    hidden = p.student_hidden.detach().clone()
    hidden[4] = float("nan")
    teacher_hidden = p.teacher_hidden.detach().clone()
    teacher_hidden[8] = float("inf")
    trains_teacher = variant == "mutual"
    hidden.requires_grad_()
    teacher_hidden.requires_grad_(trains_teacher)
    keyword = {"kl_weight": 1.0, "kl_divergence": variant, "backend": backend}
    out = orda_tp.distillation_loss(hidden, p.weight, p.labels, TiedTeacher(teacher_hidden), **keyword)
    inputs = [hidden, p.weight] + ([teacher_hidden] if trains_teacher else [])
    g_hidden, g_weight, *g_teacher = torch.autograd.grad(out.loss, inputs)
    keep = p.labels != -100
    kept_teacher = teacher_hidden.detach()[keep].requires_grad_(trains_teacher)
    clean = orda_tp.distillation_loss(
        hidden.detach()[keep].requires_grad_(), p.weight, p.labels[keep], TiedTeacher(kept_teacher), **keyword
    )
    expected_weight, *expected_teacher = torch.autograd.grad(
        clean.loss, [p.weight] + ([kept_teacher] if trains_teacher else [])
    )
    assert torch.isfinite(out.loss) and relative_error(out.loss, clean.loss) <= 1e-6
    assert torch.all(g_hidden[~keep] == 0) and torch.isfinite(g_hidden).all()
    assert relative_error(g_weight, expected_weight) <= 1e-6
    for got, wanted in zip(g_teacher, expected_teacher):
        assert torch.all(got[~keep] == 0) and torch.isfinite(got).all()
        assert relative_error(got[keep], wanted) <= 1e-6


@pytest.mark.usefixtures("small_groups")
@pytest.mark.parametrize("rows", [23, 0])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize(("variant", "mode"), [("forward", "tied"), ("mutual", "tied"), ("mutual", "separate")])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gradient_buffers_come_unwritten_and_every_element_is_written(
    monkeypatch: pytest.MonkeyPatch, backend: str, variant: str, mode: str, reduction: str, rows: int
) -> None:
    """The gradient GEMMs write the buffers without reading them first (β = 0 for the hidden rows
    and the head's first row group): buffers that come filled with NaN give the gradients of zeroed
    ones bit for bit, over several row groups, a padded vocabulary (``vocab_size`` < the head's rows,
    whose padding rows no GEMM writes), a call with no rows, and the deferred backward of "none"."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    base = problem_for(mode, stable_seed("unwritten", variant, mode), dtype)
    take = slice(0, rows)
    p = replace(
        base,
        student_hidden=base.student_hidden.detach()[take].requires_grad_(),
        teacher_hidden=base.teacher_hidden.detach()[take].requires_grad_(),
        labels=base.labels[take].clamp(max=180),
        teacher_logits=base.teacher_logits[take],
    )
    kwargs = {**call_kwargs(variant, mode, reduction), "backend": backend, "vocab_size": 190}
    upstream = None
    if reduction == "none":
        upstream = torch.rand(rows, dtype=dtype, generator=torch.Generator().manual_seed(3))

    def grads() -> list[torch.Tensor | None]:
        return loss_and_grads(p, mode, upstream, **kwargs)[1]

    zeroed = grads()
    monkeypatch.setattr(gradient_gemms, "torch", NanFilledEmpty())
    unwritten = grads()
    assert any(grad is not None for grad in zeroed)
    for index, (got, expected) in enumerate(zip(unwritten, zeroed)):
        assert (got is None) == (expected is None), index
        if got is not None:
            assert torch.equal(got, expected), index
    weight_grad = zeroed[1]
    assert weight_grad is not None and torch.all(weight_grad[190:] == 0)


@pytest.mark.usefixtures("small_groups")
def test_weight_gradient_accumulation_in_the_weights_dtype() -> None:
    base = make_problem(rows=23, dtype=torch.bfloat16)
    exact = base.to(torch.float64)
    reference = orda_tp.distillation_loss(
        exact.student_hidden, exact.weight, exact.labels, TiedTeacher(exact.teacher_hidden.detach()), kl_weight=1.0,
        backend="reference",
    )  # fmt: skip
    expected = torch.autograd.grad(reference.loss, [exact.weight])[0]
    grads = {}
    for accumulation in ("fp32", "compute", "auto"):
        config = KernelConfig(grad_weight_accumulation=accumulation)
        out = orda_tp.distillation_loss(
            base.student_hidden, base.weight, base.labels, TiedTeacher(base.teacher_hidden.detach()), kl_weight=1.0,
            config=config,
        )  # fmt: skip
        grads[accumulation] = torch.autograd.grad(out.loss, [base.weight])[0]
        assert grads[accumulation].dtype == torch.bfloat16
        assert relative_error(grads[accumulation], expected) <= 1e-2
    # "auto" sums a bf16 weight's gradient in bf16; fp32 summation rounds once, at the end.
    assert torch.equal(grads["auto"], grads["compute"])
    assert not torch.equal(grads["fp32"], grads["compute"])
    assert relative_error(grads["fp32"], expected) <= relative_error(grads["compute"], expected)


def test_grad_weight_accumulation_is_validated() -> None:
    with pytest.raises(ValueError, match="grad_weight_accumulation must be one of"):
        KernelConfig(grad_weight_accumulation="bf16")
    with pytest.raises(TypeError, match="host_checks must be a bool"):
        KernelConfig(host_checks="no")  # type: ignore[arg-type]


def test_gradient_gemms_leave_the_reduction_flags_as_they_were() -> None:
    flags = torch.backends.cuda.matmul
    before = (flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction)
    p = make_problem()
    out = orda_tp.distillation_loss(p.student_hidden, p.weight, p.labels, TiedTeacher(p.teacher_hidden), kl_weight=1.0)
    torch.autograd.grad(out.loss, [p.student_hidden, p.weight])
    assert (flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction) == before
