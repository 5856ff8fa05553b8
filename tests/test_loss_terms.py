"""The student's loss terms (orda_tp/divergences/terms.py): label smoothing and z-loss, against textbook torch.

- ``label_smoothing=ε``: the student CE equals ``torch.nn.functional.cross_entropy(logits, labels,
  label_smoothing=ε)`` over the real vocabulary (padding columns excluded), with ``ignore_index``
  and every reduction; its gradient is autograd's through that formula.
- ``z_loss_weight=w``: ``loss`` gains ``w·LSE(s)²`` per valid row, reduced like the CE; the
  ``z_loss`` component (an attribute beside orda-kernel's four-tuple) is the rows' ``LSE(s)²``.
- ``token_weights=w`` (BT,): every row's loss and components times ``w_i``, the normalizer unchanged.
- ``logit_softcap=c``, ``teacher_logit_softcap=c_t``: each side's logits ``c·tanh(z/c)`` before
  every term, gradients through the cap (a teacher cache of logits is taken as capped).
- Each on the reference, torch and Triton (interpreted) backends, fp64 ≤ 1e-12 on the first two;
  on 2 and 3 gloo ranks equal to the single-device call (tests/support/term_workers.py); bad values raise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import orda_tp

from .support.cases import SMALL_CHUNKS, Problem, make_problem, relative_error, separate_problem, stable_seed

IGNORE = -100
VOCAB = 203


def textbook(
    problem: Problem, reduction: str, vocab_size: int, *, ce: float, smoothing: float, z: float, kl: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, student_ce, z_loss)`` from full logits with torch's own functions; ``kl``: the
    call's KL component, added as it is (the KL has its own tests)."""
    logits = (problem.student_hidden @ problem.weight.T)[:, :vocab_size]
    student_ce = F.cross_entropy(
        logits, problem.labels, ignore_index=IGNORE, label_smoothing=smoothing, reduction=reduction
    )
    valid = problem.labels != IGNORE
    z_rows = torch.where(valid, torch.logsumexp(logits, dim=-1) ** 2, 0.0)
    z_loss = {"none": z_rows, "sum": z_rows.sum(), "mean": z_rows.sum() / valid.sum()}[reduction]
    loss = ce * student_ce + z * z_loss + (0.0 if kl is None else kl)
    return loss, student_ce, z_loss


CASES = {
    "smoothing": dict(label_smoothing=0.1),
    "z-loss": dict(z_loss_weight=0.02),
    "both": dict(label_smoothing=0.3, z_loss_weight=0.5, student_ce_weight=0.7),
    "z-loss only": dict(z_loss_weight=0.2, student_ce_weight=0.0),
}


def compare(backend: str, case: str, reduction: str, *, kl_weight: float, padded: bool, dtype: torch.dtype) -> None:
    """One call against the textbook formulas: values, and gradients through ``upstream``."""
    problem = make_problem(rows=24, vocab=VOCAB, seed=stable_seed(backend, case, reduction)).to(dtype)
    vocab_size = VOCAB - 23 if padded else VOCAB
    if padded:
        problem.labels[problem.labels >= vocab_size] = vocab_size - 1
    keywords = CASES[case]
    teacher = orda_tp.TiedTeacher(problem.teacher_hidden.detach())
    config = SMALL_CHUNKS if backend != "reference" else None
    out = orda_tp.distillation_loss(
        problem.student_hidden, problem.weight, problem.labels, teacher, kl_weight=kl_weight, reduction=reduction,
        teacher_ce_weight=0.0, backend=backend, config=config, vocab_size=vocab_size if padded else None,
        **keywords,  # type: ignore[arg-type]
    )  # fmt: skip
    exact = problem.to(torch.float64)
    ce, smoothing = float(keywords.get("student_ce_weight", 1.0)), float(keywords.get("label_smoothing", 0.0))
    z = float(keywords.get("z_loss_weight", 0.0))
    kl = kl_weight * out.kl.double() if kl_weight else None
    loss, student_ce, z_loss = textbook(exact, reduction, vocab_size, ce=ce, smoothing=smoothing, z=z, kl=kl)
    tolerance = 1e-12 if dtype == torch.float64 else 2e-5
    if ce > 0:
        assert relative_error(out.student_ce, student_ce) <= tolerance
    assert relative_error(out.z_loss, z_loss if z > 0 else torch.zeros_like(z_loss)) <= tolerance
    assert relative_error(out.loss, loss) <= tolerance
    if kl_weight:
        return  # the KL's gradient is the equivalence tests'; here the terms' alone
    upstream = torch.rand(out.loss.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    inputs = [problem.student_hidden, problem.weight]
    grads = torch.autograd.grad(out.loss, inputs, upstream.to(dtype))
    expected = torch.autograd.grad(loss, [exact.student_hidden, exact.weight], upstream)
    for grad, want in zip(grads, expected):
        assert relative_error(grad, want) <= tolerance * 10


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_terms_equal_textbook_torch(backend: str, case: str, reduction: str) -> None:
    compare(backend, case, reduction, kl_weight=0.0, padded=False, dtype=torch.float64)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_terms_exclude_vocabulary_padding_and_sit_beside_a_kl(backend: str, case: str) -> None:
    """``vocab_size`` below the head's rows: the smoothing's uniform part and the z-loss's
    partition run over the real columns only; with a KL term the loss adds it unchanged."""
    compare(backend, case, "mean", kl_weight=0.0, padded=True, dtype=torch.float64)
    compare(backend, case, "sum", kl_weight=1.3, padded=True, dtype=torch.float64)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_triton_terms_equal_textbook_torch(case: str, reduction: str) -> None:
    pytest.importorskip("triton")
    compare("triton", case, reduction, kl_weight=0.0, padded=case == "both", dtype=torch.float32)
    compare("triton", case, reduction, kl_weight=0.5, padded=False, dtype=torch.float32)


def test_upstream_scale_reaches_the_terms() -> None:
    """``(3·loss).backward()`` gives 3× the unit gradient (the terms' part of the row scale)."""
    problem = make_problem(rows=16, vocab=VOCAB, seed=4)
    teacher = orda_tp.TiedTeacher(problem.teacher_hidden.detach())
    grads = []
    for factor in (1.0, 3.0):
        out = orda_tp.distillation_loss(
            problem.student_hidden, problem.weight, problem.labels, teacher, backend="torch",
            label_smoothing=0.2, z_loss_weight=0.1, kl_weight=0.5, teacher_ce_weight=0.0, config=SMALL_CHUNKS,
        )  # fmt: skip
        grads.append(torch.autograd.grad(factor * out.loss, [problem.student_hidden, problem.weight]))
    for unit, scaled in zip(*grads):
        assert relative_error(scaled, 3 * unit) <= 1e-14


def test_output_holds_the_z_loss_after_orda_kernels_four() -> None:
    """``(loss, student_ce, teacher_ce, kl, z_loss, student_entropy)``: orda-kernel's four, then
    ``z_loss``, 0 when its weight is 0, and ``student_entropy``, 0 unless asked for."""
    problem = make_problem(rows=8, vocab=VOCAB, seed=2)
    teacher = orda_tp.TiedTeacher(problem.teacher_hidden.detach())
    hidden, weight, labels = problem.student_hidden, problem.weight, problem.labels
    out = orda_tp.distillation_loss(hidden, weight, labels, teacher, teacher_ce_weight=0.0)
    loss, student_ce, teacher_ce, kl, z_loss, student_entropy = out
    assert out._fields == ("loss", "student_ce", "teacher_ce", "kl", "z_loss", "student_entropy")
    assert z_loss.item() == 0.0 and not z_loss.requires_grad
    assert student_entropy.item() == 0.0 and not student_entropy.requires_grad
    assert torch.equal(loss, out.loss) and torch.equal(student_ce, out.student_ce)
    module = orda_tp.DistillationLoss(z_loss_weight=0.1, teacher_ce_weight=0.0, backend="torch")
    with_z = module(problem.student_hidden, problem.weight, problem.labels, teacher)
    assert with_z.z_loss.item() > 0
    assert relative_error(with_z.loss, out.loss + 0.1 * with_z.z_loss) <= 1e-14


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"label_smoothing": -0.1}, "label_smoothing must be a finite real number >= 0, got -0.1"),
        ({"label_smoothing": 1.0}, r"label_smoothing must be in \[0, 1\), got 1.0"),
        ({"label_smoothing": float("nan")}, "label_smoothing must be a finite real number >= 0, got nan"),
        ({"label_smoothing": "0.1"}, "label_smoothing must be a finite real number >= 0, got '0.1'"),
        ({"z_loss_weight": -1e-4}, "z_loss_weight must be a finite real number >= 0, got -0.0001"),
        ({"z_loss_weight": float("inf")}, "z_loss_weight must be a finite real number >= 0, got inf"),
    ],
)
def test_bad_term_values_raise_naming_the_argument(keywords: dict[str, object], message: str) -> None:
    """Checked when the options are built, before any collective: under ``tp_group`` every rank
    raises the same error (the module form raises at construction)."""
    problem = make_problem(rows=4, vocab=VOCAB, seed=1)
    teacher = orda_tp.TiedTeacher(problem.teacher_hidden.detach())
    with pytest.raises(ValueError, match=message):
        orda_tp.distillation_loss(problem.student_hidden, problem.weight, problem.labels, teacher, **keywords)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        orda_tp.DistillationLoss(**keywords)


def weights_for(rows: int, seed: int) -> Tensor:
    """Per-row weights in [-0.5, 1.5): negative ones too (RL advantages)."""
    return torch.rand(rows, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * 2 - 0.5


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_token_weights_scale_each_rows_loss_and_components(backend: str, reduction: str) -> None:
    """Against textbook torch: CE, z-loss and forward KL per row, times the row's weight, summed
    over valid rows and divided by the valid-row count (or ``num_valid_tokens``) for "mean"."""
    if backend == "triton":
        pytest.importorskip("triton")
    dtype, tolerance = (torch.float32, 2e-5) if backend == "triton" else (torch.float64, 1e-12)
    problem = make_problem(rows=24, vocab=VOCAB, seed=stable_seed("weights", backend, reduction)).to(dtype)
    weights = weights_for(24, 7)
    teacher = orda_tp.TiedTeacher(problem.teacher_hidden.detach())
    denominator = {"num_valid_tokens": 40.0} if reduction == "mean" else {}
    out = orda_tp.distillation_loss(
        problem.student_hidden, problem.weight, problem.labels, teacher, teacher_ce_weight=0.0, kl_weight=0.6,
        z_loss_weight=0.05, label_smoothing=0.1, reduction=reduction, backend=backend,
        config=None if backend == "reference" else SMALL_CHUNKS, token_weights=weights.to(dtype), **denominator,
    )  # fmt: skip
    exact = problem.to(torch.float64)
    student = exact.student_hidden @ exact.weight.T
    teacher_logits = exact.teacher_hidden.detach() @ exact.weight.detach().T  # a frozen teacher
    valid = exact.labels != IGNORE
    safe = torch.where(valid, exact.labels, 0)
    rows = {
        "student_ce": F.cross_entropy(student, safe, label_smoothing=0.1, reduction="none"),
        "z_loss": torch.logsumexp(student, -1) ** 2,
        "kl": (
            torch.softmax(teacher_logits, -1) * (torch.log_softmax(teacher_logits, -1) - torch.log_softmax(student, -1))
        ).sum(-1),
    }
    rows = {name: torch.where(valid, values * weights, 0.0) for name, values in rows.items()}
    rows["loss"] = rows["student_ce"] + 0.05 * rows["z_loss"] + 0.6 * rows["kl"]
    reduce = {"none": lambda v: v, "sum": lambda v: v.sum(), "mean": lambda v: v.sum() / 40.0}[reduction]
    for name in ("loss", "student_ce", "z_loss", "kl"):
        assert relative_error(getattr(out, name), reduce(rows[name])) <= tolerance, name
    upstream = torch.rand(out.loss.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad(out.loss, [problem.student_hidden, problem.weight], upstream.to(dtype))
    expected = torch.autograd.grad(reduce(rows["loss"]), [exact.student_hidden, exact.weight], upstream)
    for grad, want in zip(grads, expected):
        assert relative_error(grad, want) <= tolerance * 10


@pytest.mark.parametrize(
    ("weights", "error", "message"),
    [
        (torch.ones(5), ValueError, r"token_weights must have shape \(8,\), one weight per label, got \(5,\)"),
        (torch.ones(8, 1), ValueError, r"token_weights must have shape \(8,\)"),
        (
            torch.ones(8, dtype=torch.long),
            TypeError,
            "token_weights must be a floating-point tensor or None, got dtype",
        ),
        ([1.0] * 8, TypeError, "token_weights must be a floating-point tensor or None, got list"),
        (torch.ones(8, requires_grad=True), ValueError, "token_weights must not require grad"),
        (torch.tensor([1.0] * 7 + [float("nan")]), ValueError, "token_weights must be finite; row 7 holds nan"),
    ],
)
def test_bad_token_weights_raise_naming_the_argument(weights: object, error: type, message: str) -> None:
    problem = make_problem(rows=8, vocab=VOCAB, seed=1)
    teacher = orda_tp.TiedTeacher(problem.teacher_hidden.detach())
    with pytest.raises(error, match=message):
        orda_tp.distillation_loss(
            problem.student_hidden,
            problem.weight,
            problem.labels,
            teacher,
            token_weights=weights,  # type: ignore[arg-type]
        )


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kdloss_token_weights_scale_each_rows_kl(backend: str) -> None:
    """``KDLoss(...)(s, t, labels, token_weights=w)`` (w of the labels' shape) against textbook
    torch: ``Σ_valid w_i·T²·KL(q_i‖p_i) / N``, and its gradient."""
    if backend == "triton":
        pytest.importorskip("triton")
    dtype, tolerance = (torch.float32, 2e-5) if backend == "triton" else (torch.float64, 1e-12)
    generator = torch.Generator().manual_seed(4)
    student = torch.randn(2, 7, VOCAB, generator=generator, dtype=torch.float64)
    teacher = torch.randn(2, 7, VOCAB, generator=generator, dtype=torch.float64) * 2
    labels = torch.randint(0, VOCAB, (2, 7), generator=generator)
    labels[0, ::3] = IGNORE
    weights = weights_for(14, 3).reshape(2, 7)
    given = student.to(dtype).requires_grad_()
    loss = orda_tp.KDLoss(temperature=2.0, chunk_size=5, backend=backend)(
        given, teacher.to(dtype), labels, token_weights=weights.to(dtype)
    )
    exact = student.requires_grad_()
    kl = torch.softmax(teacher / 2, -1) * (torch.log_softmax(teacher / 2, -1) - torch.log_softmax(exact / 2, -1))
    valid = labels != IGNORE
    expected = torch.where(valid, 4.0 * kl.sum(-1) * weights, 0.0).sum() / valid.sum()
    assert relative_error(loss, expected) <= tolerance
    (grad,) = torch.autograd.grad(loss, given)
    (want,) = torch.autograd.grad(expected, exact)
    assert relative_error(grad, want) <= tolerance * 10
    with pytest.raises(ValueError, match=r"token_weights must have shape \(14,\), one weight per label, got \(2, 6\)"):
        orda_tp.KDLoss()(student, teacher, labels, token_weights=weights[:, :6])


def capped(logits: Tensor, cap: float) -> Tensor:
    return cap * torch.tanh(logits / cap)


@pytest.mark.parametrize("mode", ["tied", "separate", "hidden cache"])
@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_softcaps_equal_textbook_torch_on_capped_logits(backend: str, mode: str) -> None:
    """Student CE (smoothed), z-loss, teacher CE and forward KL (T = 2) of capped logits, with
    autograd through the caps: the tied teacher is trained by its CE, so its gradient goes through
    the teacher's cap too."""
    if backend == "triton":
        pytest.importorskip("triton")
    dtype, tolerance = (torch.float32, 2e-5) if backend == "triton" else (torch.float64, 1e-12)
    base = make_problem(rows=24, vocab=VOCAB, seed=stable_seed("cap", backend, mode))
    problem = (separate_problem(base) if mode != "tied" else base).to(dtype)
    teacher: orda_tp.TiedTeacher | orda_tp.SeparateTeacher | orda_tp.PrecomputedTeacher
    exact = problem.to(torch.float64)
    if mode == "tied":
        teacher, inputs = orda_tp.TiedTeacher(problem.teacher_hidden), problem.trainable("tied")
        exact_inputs, teacher_head, w_t = exact.trainable("tied"), exact.weight, 0.3
    else:
        frozen_hidden, frozen_weight = problem.teacher_hidden.detach(), problem.teacher_weight.detach()
        teacher = (
            orda_tp.SeparateTeacher(frozen_hidden, frozen_weight)
            if mode == "separate"
            else orda_tp.PrecomputedTeacher(teacher_hidden=frozen_hidden, teacher_weight=frozen_weight)
        )
        inputs, exact_inputs = [problem.student_hidden, problem.weight], [exact.student_hidden, exact.weight]
        teacher_head, w_t = exact.teacher_weight.detach(), 0.0
    out = orda_tp.distillation_loss(
        problem.student_hidden, problem.weight, problem.labels, teacher, teacher_ce_weight=w_t, kl_weight=0.8,
        kl_temperature=2.0, z_loss_weight=0.05, label_smoothing=0.1, logit_softcap=4.0, teacher_logit_softcap=3.0,
        backend=backend, config=None if backend == "reference" else SMALL_CHUNKS,
    )  # fmt: skip
    student = capped(exact.student_hidden @ exact.weight.T, 4.0)
    teacher_hidden = exact.teacher_hidden if mode == "tied" else exact.teacher_hidden.detach()
    teacher_logits = capped(teacher_hidden @ teacher_head.T, 3.0)
    valid = exact.labels != IGNORE
    safe = torch.where(valid, exact.labels, 0)
    frozen = teacher_logits.detach()
    kl = torch.softmax(frozen / 2, -1) * (torch.log_softmax(frozen / 2, -1) - torch.log_softmax(student / 2, -1))
    rows = {
        "student_ce": F.cross_entropy(student, safe, label_smoothing=0.1, reduction="none"),
        "z_loss": torch.logsumexp(student, -1) ** 2,
        "teacher_ce": F.cross_entropy(teacher_logits, safe, reduction="none"),
        "kl": 4.0 * kl.sum(-1),
    }
    means = {name: torch.where(valid, values, 0.0).sum() / valid.sum() for name, values in rows.items()}
    loss = means["student_ce"] + 0.05 * means["z_loss"] + w_t * means["teacher_ce"] + 0.8 * means["kl"]
    assert relative_error(out.loss, loss) <= tolerance
    for name in ("student_ce", "z_loss", "kl") + (("teacher_ce",) if w_t else ()):
        assert relative_error(getattr(out, name), means[name]) <= tolerance, name
    grads = torch.autograd.grad(out.loss, inputs)
    for grad, want in zip(grads, torch.autograd.grad(loss, exact_inputs)):
        assert relative_error(grad, want) <= tolerance * 10


def test_softcapped_cotrained_teacher_matches_the_reference() -> None:
    """``mutual`` sends the KL gradient to the teacher, through its cap (torch against reference)."""
    problem = make_problem(rows=16, vocab=VOCAB, seed=8)
    results = []
    for backend in ("reference", "torch"):
        fresh = problem.to(torch.float64)
        out = orda_tp.distillation_loss(
            fresh.student_hidden, fresh.weight, fresh.labels, orda_tp.TiedTeacher(fresh.teacher_hidden),
            kl_weight=1.0, kl_divergence="mutual", logit_softcap=2.5, teacher_logit_softcap=2.0, backend=backend,
            config=None if backend == "reference" else SMALL_CHUNKS,
        )  # fmt: skip
        results.append([out.loss, *torch.autograd.grad(out.loss, fresh.trainable("tied"))])
    for actual, expected in zip(*results):
        assert relative_error(actual, expected) <= 1e-12


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"logit_softcap": 0.0}, "logit_softcap must be a finite real number > 0, got 0.0"),
        ({"logit_softcap": -30.0}, "logit_softcap must be a finite real number > 0, got -30.0"),
        ({"teacher_logit_softcap": float("nan")}, "teacher_logit_softcap must be a finite real number > 0, got nan"),
    ],
)
def test_bad_softcaps_raise_naming_the_argument(keywords: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        orda_tp.DistillationLoss(**keywords)


def test_a_logits_cache_is_taken_as_capped() -> None:
    problem = make_problem(rows=6, vocab=VOCAB, seed=1)
    cache = orda_tp.PrecomputedTeacher(logits=problem.teacher_logits)
    with pytest.raises(ValueError, match="teacher_logit_softcap=30.0 caps logits a teacher head forms, but this"):
        orda_tp.distillation_loss(
            problem.student_hidden, problem.weight, problem.labels, cache, kl_weight=1.0, teacher_logit_softcap=30.0
        )
    capped_cache = orda_tp.PrecomputedTeacher(logits=capped(problem.teacher_logits, 30.0))
    out = orda_tp.distillation_loss(
        problem.student_hidden, problem.weight, problem.labels, capped_cache, kl_weight=1.0, logit_softcap=30.0
    )
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("world_size", [2, 3])
def test_terms_under_tensor_parallelism(world_size: int) -> None:
    """On 2 and 3 gloo ranks (uneven and padded shards, every teacher mode and reduction, fp64
    and fp32, the Triton kernels too): equal to the single-device call, bitwise across ranks."""
    from .support import term_workers
    from .support.distributed import run_distributed

    reports = run_distributed(world_size, term_workers.terms_worker, timeout=300)
    problems = [f"rank {rank}: {p}" for rank, found in enumerate(reports) for p in found]
    assert not problems, "\n".join(problems[:40])
