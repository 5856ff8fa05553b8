"""The student's loss terms (orda_tp/terms.py): label smoothing and z-loss, against textbook torch.

- ``label_smoothing=ε``: the student CE equals ``torch.nn.functional.cross_entropy(logits, labels,
  label_smoothing=ε)`` over the real vocabulary (padding columns excluded), with ``ignore_index``
  and every reduction; its gradient is autograd's through that formula.
- ``z_loss_weight=w``: ``loss`` gains ``w·LSE(s)²`` per valid row, reduced like the CE; the
  ``z_loss`` component (an attribute beside orda-kernel's four-tuple) is the rows' ``LSE(s)²``.
- Each on the reference, torch and Triton (interpreted) backends, fp64 ≤ 1e-12 on the first two;
  on 2 and 3 gloo ranks equal to the single-device call (tests/term_workers.py); bad values raise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import orda_tp

from .cases import SMALL_CHUNKS, Problem, make_problem, relative_error, stable_seed

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
    """``(loss, student_ce, teacher_ce, kl, z_loss)``: orda-kernel's four, then ``z_loss``, 0
    when its weight is 0."""
    problem = make_problem(rows=8, vocab=VOCAB, seed=2)
    teacher = orda_tp.TiedTeacher(problem.teacher_hidden.detach())
    hidden, weight, labels = problem.student_hidden, problem.weight, problem.labels
    out = orda_tp.distillation_loss(hidden, weight, labels, teacher, teacher_ce_weight=0.0)
    loss, student_ce, teacher_ce, kl, z_loss = out
    assert out._fields == ("loss", "student_ce", "teacher_ce", "kl", "z_loss")
    assert z_loss.item() == 0.0 and not z_loss.requires_grad
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


@pytest.mark.parametrize("world_size", [2, 3])
def test_terms_under_tensor_parallelism(world_size: int) -> None:
    """On 2 and 3 gloo ranks (uneven and padded shards, every teacher mode and reduction, fp64
    and fp32, the Triton kernels too): equal to the single-device call, bitwise across ranks."""
    from . import term_workers
    from .distributed import run_distributed

    reports = run_distributed(world_size, term_workers.terms_worker, timeout=300)
    problems = [f"rank {rank}: {p}" for rank, found in enumerate(reports) for p in found]
    assert not problems, "\n".join(problems[:40])
