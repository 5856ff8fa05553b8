"""``KDLoss`` and ``flash_ce_kd_loss`` (docs/reference.md §10) against fp64 formulas written here from the seeds.

- NeMo's KDLoss (seeds/004): ``T²·KL(q‖p)`` per valid token, ``p = softmax(s/T)``, ``q =
  softmax(t/T)``, mean over valid tokens or sum / ``num_batch_labels``; the other 14 variants from
  the table of docs/variants.md §4, each written out below on full fp64 logits, their gradients by autograd.
- flash_kd (seeds/001): ``ce = LSE(s) − s_y`` (0 at ``ignore_index``), ``kd = KL(q_T‖p_T)`` not
  multiplied by ``T²``, the teacher's logits ``teacher_hidden · weightᵀ``.

Tensor parallelism (TP = 2 and 3 on gloo, against TP = 1) runs in tests/support/logits_workers.py.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

import orda_tp
from orda_tp import KL_VARIANTS, EntropyGate

from .support.cases import VARIANT_KWARGS, relative_error

VOCAB = 37
SHAPE = (2, 5)  # leading dimensions of the logits: 10 rows
TEMPERATURE = 1.5


# ---------------------------------------------------------------------------- fp64 formulas


def kl(log_a: Tensor, log_b: Tensor) -> Tensor:
    """Per row ``KL(a‖b) = Σ a (log a − log b)``."""
    return (log_a.exp() * (log_a - log_b)).sum(-1)


def divergence(variant: str, logp: Tensor, logq: Tensor, labels: Tensor, kwargs: dict[str, object]) -> Tensor:
    """Per-row ``D(p, q)`` of docs/variants.md §4 (rows × V log-probabilities, fp64), without the ``T²``."""
    p, q = logp.exp(), logq.exp()
    alpha, beta = kwargs.get("kl_alpha"), kwargs.get("kl_beta")
    if variant == "forward":
        return kl(logq, logp)
    if variant == "reverse":
        return kl(logp, logq)
    if variant in ("jeffreys", "cojeffreys"):
        return kl(logq, logp) + kl(logp, logq)
    if variant == "mutual":
        # Value: jeffreys. Gradient: of KL(sg q‖p) + KL(sg p‖q), i.e. only the first term's.
        return kl(logq, logp) + kl(logp.detach(), logq)
    if variant == "alpha_divergence":
        return (1 - (p**alpha * q ** (1 - alpha)).sum(-1)) / (alpha * (1 - alpha))
    if variant in ("skew_forward", "skew_reverse", "skew_js"):
        log_m = torch.log((1 - beta) * q + beta * p)
        forward, reverse = kl(logq, log_m), kl(logp, log_m)
        return {"skew_forward": forward, "skew_reverse": reverse, "skew_js": (1 - beta) * forward + beta * reverse}[
            variant
        ]
    if variant == "entropy_adaptive":
        gate: EntropyGate = kwargs["entropy_gate"]  # type: ignore[assignment]
        entropy = -(q * logq).sum(-1)
        gamma = gate.alpha_min + (gate.alpha_max - gate.alpha_min) * torch.sigmoid(
            (entropy / math.log(logp.shape[-1]) - gate.tau) / gate.scale
        )
        return gamma * kl(logq, logp) + (1 - gamma) * kl(logp, logq)
    if variant == "renyi":
        return torch.log((q**alpha * p ** (1 - alpha)).sum(-1)) / (alpha - 1)
    if variant == "renyi_reverse":
        return torch.log((p**alpha * q ** (1 - alpha)).sum(-1)) / (alpha - 1)
    if variant == "dkd":
        target = torch.nn.functional.one_hot(labels, logp.shape[-1]).bool()
        p_y, q_y = p[target], q[target]
        binary = q_y * (q_y.log() - p_y.log()) + (1 - q_y) * (torch.log1p(-q_y) - torch.log1p(-p_y))
        # p̂_i = p_i / (1 − p_y) over the classes i ≠ y (the label column is left out, not logged).
        log_hat_p = torch.where(target, 0.0, logp) - torch.log1p(-p_y)[:, None]
        log_hat_q = torch.where(target, 0.0, logq) - torch.log1p(-q_y)[:, None]
        non_target = torch.where(target, 0.0, log_hat_q.exp() * (log_hat_q - log_hat_p)).sum(-1)
        return alpha * binary + beta * non_target
    if variant == "abkd":
        total = alpha + beta
        terms = p**alpha * q**beta - alpha / total * p**total - beta / total * q**total
        return -terms.sum(-1) / (alpha * beta)
    if variant == "triangular":
        return ((p - q) ** 2 / (p + q)).sum(-1)
    raise AssertionError(variant)


def kd_loss_fp64(
    student: Tensor,
    teacher: Tensor,
    labels: Tensor,
    temperature: float,
    *,
    variant: str = "forward",
    ignore_index: int = -100,
    num_batch_labels: float | None = None,
) -> Tensor:
    """NeMo's loss: ``Σ_valid T²·D(p, q)`` over valid tokens, divided by their count or by
    ``num_batch_labels``; differentiable in ``student``."""
    valid = labels != ignore_index
    logp = torch.log_softmax(student[valid].double() / temperature, dim=-1)
    logq = torch.log_softmax(teacher[valid].double() / temperature, dim=-1)
    per_token = temperature**2 * divergence(variant, logp, logq, labels[valid], VARIANT_KWARGS[variant])
    if num_batch_labels is not None:
        return per_token.sum() / num_batch_labels
    return per_token.mean()


def flash_scores_fp64(
    student: Tensor, hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float, ignore_index: int
) -> tuple[Tensor, Tensor]:
    """flash_kd's ``(ce, kd)`` per token: CE on raw logits (0 at ``ignore_index``), KL(q_T‖p_T)
    without ``T²``."""
    student, teacher = student.double(), hidden.double() @ weight.double().T
    valid = labels != ignore_index
    log_softmax = torch.log_softmax(student, dim=-1)
    ce = -log_softmax.gather(1, torch.where(valid, labels, 0)[:, None]).squeeze(1)
    kd = kl(torch.log_softmax(teacher / temperature, -1), torch.log_softmax(student / temperature, -1))
    return torch.where(valid, ce, 0.0), kd


# ---------------------------------------------------------------------------- problems


def logits_problem(seed: int, dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor, Tensor]:
    """Student logits (a leaf requiring grad), teacher logits and labels of shape SHAPE; rows
    (0, 1) and (1, 3) ignored."""
    generator = torch.Generator().manual_seed(seed)
    student = (2 * torch.randn(*SHAPE, VOCAB, generator=generator, dtype=torch.float64)).to(dtype)
    teacher = (2 * torch.randn(*SHAPE, VOCAB, generator=generator, dtype=torch.float64)).to(dtype)
    labels = torch.randint(0, VOCAB, SHAPE, generator=generator)
    labels[0, 1] = labels[1, 3] = -100
    return student.requires_grad_(), teacher, labels


def variant_kwargs(variant: str) -> dict[str, object]:
    return {"kl_divergence": variant, **VARIANT_KWARGS[variant]}


def loss_and_grad(loss_fn: orda_tp.KDLoss, student: Tensor, teacher: Tensor, labels: Tensor, **call: object):
    loss = loss_fn(student, teacher, labels, **call)
    (grad,) = torch.autograd.grad(loss, student)
    return loss, grad


def expected_loss_and_grad(student: Tensor, teacher: Tensor, labels: Tensor, temperature: float, **kwargs: object):
    leaf = student.detach().double().requires_grad_()
    loss = kd_loss_fp64(leaf, teacher, labels, temperature, **kwargs)  # type: ignore[arg-type]
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss, grad


# ---------------------------------------------------------------------------- KDLoss


@pytest.mark.parametrize("variant", KL_VARIANTS)
def test_kd_loss_every_variant_matches_fp64_formulas(variant: str) -> None:
    """Loss and student gradient of each variant, several row chunks (3 rows) over [2, 5, V] logits."""
    student, teacher, labels = logits_problem(seed=KL_VARIANTS.index(variant))
    loss_fn = orda_tp.KDLoss(temperature=TEMPERATURE, chunk_size=3, **variant_kwargs(variant))
    loss, grad = loss_and_grad(loss_fn, student, teacher, labels)
    expected, expected_grad = expected_loss_and_grad(student, teacher, labels, TEMPERATURE, variant=variant)
    assert loss.dtype == torch.float64 and loss.dim() == 0
    assert relative_error(loss, expected) <= 1e-12
    assert grad.shape == student.shape and relative_error(grad, expected_grad) <= 1e-10


@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("chunk_size", [0, 1, 4, 1000])
def test_kd_loss_is_nemo_forward_kl_for_every_chunk_size(temperature: float, chunk_size: int) -> None:
    """The seed's loss: T²·KL(q‖p) averaged over valid tokens, and sum / num_batch_labels."""
    student, teacher, labels = logits_problem(seed=11)
    loss_fn = orda_tp.KDLoss(temperature=temperature, chunk_size=chunk_size)
    for num_batch_labels in (None, 23):
        loss, grad = loss_and_grad(loss_fn, student, teacher, labels, num_batch_labels=num_batch_labels)
        expected, expected_grad = expected_loss_and_grad(
            student, teacher, labels, temperature, num_batch_labels=num_batch_labels
        )
        assert relative_error(loss, expected) <= 1e-12
        assert relative_error(grad, expected_grad) <= 1e-12


def test_kd_loss_fp32_and_bf16_logits() -> None:
    """Statistics in fp32 whatever the logits' dtype: an fp32 loss within 1e-6 of the fp64
    formula on the same rounded values; the gradient in the logits' dtype."""
    for dtype, grad_tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        student, teacher, labels = logits_problem(seed=5, dtype=dtype)
        loss, grad = loss_and_grad(orda_tp.KDLoss(temperature=2.0, chunk_size=4), student, teacher, labels)
        expected, expected_grad = expected_loss_and_grad(student, teacher, labels, 2.0)
        assert loss.dtype == torch.float32 and grad.dtype == dtype
        assert relative_error(loss, expected) <= 1e-6
        assert relative_error(grad, expected_grad) <= grad_tolerance


def test_num_batch_labels_accumulates_the_gradient_of_one_big_batch() -> None:
    """Micro-batches of a batch, each divided by the batch's valid-token count (a number or a
    tensor), accumulate the loss and the gradient of the whole batch's mean."""
    generator = torch.Generator().manual_seed(3)
    student = torch.randn(12, 4, VOCAB, generator=generator, dtype=torch.float64).requires_grad_()
    teacher = torch.randn(12, 4, VOCAB, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (12, 4), generator=generator)
    labels[labels % 3 == 0] = -100  # a different number of valid tokens per micro-batch
    loss_fn = orda_tp.KDLoss(temperature=2.0, chunk_size=5, kl_divergence="reverse")
    full = loss_fn(student, teacher, labels)
    (full_grad,) = torch.autograd.grad(full, student)
    for count in (int((labels != -100).sum()), (labels != -100).sum()):
        total = torch.zeros((), dtype=torch.float64)
        for rows in (slice(0, 5), slice(5, 7), slice(7, 12)):
            part = loss_fn(student[rows], teacher[rows], labels[rows], num_batch_labels=count)
            part.backward()
            total += part.detach()
        assert relative_error(total, full) <= 1e-12
        assert relative_error(student.grad, full_grad) <= 1e-12
        student.grad = None


def test_only_the_student_logits_receive_a_gradient() -> None:
    student, teacher, labels = logits_problem(seed=2)
    teacher.requires_grad_()
    for variant in ("forward", "mutual", "cojeffreys"):
        student.grad = teacher.grad = None
        orda_tp.KDLoss(kl_divergence=variant)(student, teacher, labels).backward()
        assert teacher.grad is None and student.grad is not None


def test_labels_only_mark_valid_tokens() -> None:
    """As in the seed, a label is read only against ignore_index (dkd alone reads the label
    column, so there it must be a valid id)."""
    student, teacher, labels = logits_problem(seed=4)
    far = torch.where(labels == -100, labels, labels + 10**6)
    loss_fn = orda_tp.KDLoss(temperature=2.0, ignore_index=-100)
    assert torch.equal(loss_fn(student, teacher, far), loss_fn(student, teacher, labels))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 37\) or equal ignore_index=-100"):
        orda_tp.KDLoss(**variant_kwargs("dkd"))(student, teacher, far)


def test_ignored_rows_empty_batches_and_non_finite_rows() -> None:
    student, teacher, labels = logits_problem(seed=6)
    loss_fn = orda_tp.KDLoss(temperature=2.0, chunk_size=3)
    # Every token ignored (or no token): loss 0, connected to the student, zero gradient.
    for rows in (slice(None), slice(0, 0)):
        ignored = torch.full_like(labels[rows], -100)
        loss = loss_fn(student[rows], teacher[rows], ignored)
        (grad,) = torch.autograd.grad(loss, student)
        assert loss.item() == 0.0 and loss.requires_grad and torch.count_nonzero(grad) == 0
    # NaN in an ignored row changes nothing (its gradient is exactly 0); in a valid row it shows.
    poisoned = student.detach().clone()
    poisoned[0, 1, 3] = float("nan")  # row (0, 1) is ignored
    loss, grad = loss_and_grad(loss_fn, poisoned.clone().requires_grad_(), teacher, labels)
    expected, expected_grad = expected_loss_and_grad(student, teacher, labels, 2.0)
    assert relative_error(loss, expected) <= 1e-12 and relative_error(grad, expected_grad) <= 1e-12
    assert torch.count_nonzero(grad[0, 1]) == 0
    poisoned[0, 0, 3] = float("nan")
    assert torch.isnan(loss_fn(poisoned, teacher, labels))


def test_the_gradient_formed_in_forward_is_scaled_by_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """With grad mode on, the student's gradient is formed in forward for a unit upstream gradient
    and scaled in place by backward; a second backward through the same call (``retain_graph``)
    walks the chunks again from the kept statistics; without grad mode no gradient is formed."""
    from orda_tp.engine import row_walk

    student, teacher, labels = logits_problem(seed=31)
    loss_fn = orda_tp.KDLoss(temperature=TEMPERATURE, chunk_size=4, kl_divergence="reverse")
    expected, expected_grad = expected_loss_and_grad(student, teacher, labels, TEMPERATURE, variant="reverse")
    loss = loss_fn(student, teacher, labels)
    assert relative_error(loss, expected) <= 1e-12
    (0.3 * loss).backward(retain_graph=True)
    assert relative_error(student.grad, 0.3 * expected_grad) <= 1e-12
    (0.3 * loss).backward()
    assert relative_error(student.grad, 0.6 * expected_grad) <= 1e-12
    staged: list[int] = []
    stage_grads = row_walk.stage_grads
    monkeypatch.setattr(row_walk, "stage_grads", lambda *args: staged.append(1) or stage_grads(*args))
    with torch.no_grad():
        assert relative_error(loss_fn(student, teacher, labels), expected) <= 1e-12
    assert not staged
    loss_fn(student, teacher, labels)
    assert len(staged) == 3  # with grad mode on: one per chunk (4, 4 and 2 of the 10 rows)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_forward_kl_where_the_student_rules_out_what_the_teacher_gives_mass(backend: str) -> None:
    """``forward`` on given logits sums round 2 in the gradient pass, so round 1 counts the
    columns where the student's logit is −inf and the teacher's is not: such a row has ``D = +inf``
    (its ``kl`` +inf, its KL gradient dropped, docs/variants.md §1), while a column −inf on both
    sides (a masked id) is no such column. The other rows' gradient is ``T·(p − q)/N``."""
    if backend == "triton":
        pytest.importorskip("triton")
    dtype, tolerance = (torch.float64, 1e-12) if backend == "torch" else (torch.float32, 1e-5)
    student, teacher, labels = logits_problem(seed=32, dtype=dtype)
    student, teacher = student.detach().clone(), teacher.clone()
    student[0, 0, 4] = float("-inf")  # the teacher gives column 4 mass: row (0, 0) is +inf
    student[1, 1, :3] = teacher[1, 1, :3] = float("-inf")  # masked on both sides: finite
    student.requires_grad_()
    loss_fn = orda_tp.KDLoss(temperature=TEMPERATURE, chunk_size=4, backend=backend)
    loss, grad = loss_and_grad(loss_fn, student, teacher, labels)
    assert loss.item() == math.inf
    valid = labels != -100
    logp = torch.log_softmax(student.detach().double() / TEMPERATURE, dim=-1)
    logq = torch.log_softmax(teacher.double() / TEMPERATURE, dim=-1)
    expected_grad = TEMPERATURE * (logp.exp() - logq.exp()) / valid.sum()
    expected_grad[~valid] = 0.0
    expected_grad[0, 0] = 0.0  # the +inf row's KL gradient is dropped
    assert relative_error(grad, expected_grad) <= tolerance
    assert torch.count_nonzero(grad[0, 0]) == 0
    q = logq.exp()
    masked_row = TEMPERATURE**2 * torch.where(q > 0, q * (logq - logp), 0.0)[1, 1].sum()
    per_row = orda_tp.KDLoss(temperature=TEMPERATURE, backend=backend)(
        student[1:2, 1:2], teacher[1:2, 1:2], labels[1:2, 1:2]
    )
    assert relative_error(per_row, masked_row) <= tolerance


def test_module_attributes_and_inference_mode() -> None:
    loss_fn = orda_tp.KDLoss(ignore_index=-1, temperature=3.0, fp32_upcast=False, chunk_size=8)
    assert (loss_fn.ignore_index, loss_fn.temperature, loss_fn.fp32_upcast, loss_fn.chunk_size) == (-1, 3.0, False, 8)
    assert loss_fn.tp_group is None and "chunk_size=8" in repr(loss_fn)
    student, teacher, labels = logits_problem(seed=8)
    with torch.no_grad():
        value = loss_fn(student, teacher, labels.clamp(min=-1))
    assert not value.requires_grad
    expected = kd_loss_fp64(student, teacher, labels.clamp(min=-1), 3.0, ignore_index=-1)
    assert relative_error(value, expected) <= 1e-12


ERRORS = [
    ({"temperature": 0.0}, {}, ValueError, "temperature must be a finite real number > 0, got 0.0"),
    ({"chunk_size": -1}, {}, ValueError, "chunk_size must be an int >= 0, got -1"),
    ({"chunk_size": 2.5}, {}, ValueError, "chunk_size must be an int >= 0, got 2.5"),
    ({"fp32_upcast": "no"}, {}, TypeError, "fp32_upcast must be a bool, got 'no'"),
    ({"ignore_index": 1.5}, {}, TypeError, "ignore_index must be an int, got 1.5"),
    ({"kl_divergence": "kl"}, {}, ValueError, "kl_divergence must be one of"),
    ({"kl_alpha": 0.5}, {}, ValueError, "kl_alpha=0.5 is not used by kl_divergence='forward'"),
    ({"kl_divergence": "renyi", "kl_alpha": 3.0}, {}, ValueError, "kl_alpha must lie in"),
    ({"kl_alfa": 0.5}, {}, TypeError, "got an unexpected keyword argument 'kl_alfa' (the variant keywords are"),
    ({"backend": "reference"}, {}, ValueError, "backend must be one of ['auto', 'triton', 'torch'], got 'reference'"),
    ({"tp_group": "world"}, {}, TypeError, "tp_group must be a torch.distributed ProcessGroup or None, got str"),
    ({}, {"teacher": lambda t: t[..., :-1]}, ValueError, "teacher_logits must have student_logits' shape (2, 5, 37)"),
    ({}, {"labels": lambda y: y.reshape(-1)}, ValueError, "labels must have shape (2, 5) (student_logits' leading"),
    ({}, {"labels": lambda y: y.int()}, TypeError, "labels must have dtype torch.long (int64), got torch.int32"),
    ({}, {"student": lambda s: s.long()}, TypeError, "student_logits must be a floating-point tensor"),
    (
        {},
        {"teacher": lambda t: t.tolist()},
        TypeError,
        "teacher_logits must be a torch.Tensor of shape [..., vocab], got list",
    ),
    ({}, {"num_batch_labels": 0}, ValueError, "num_batch_labels must be finite and > 0, got 0"),
    (
        {},
        {"num_batch_labels": True},
        TypeError,
        "num_batch_labels must be a number, a one-element tensor or None, got bool",
    ),
    ({}, {"num_batch_labels": torch.ones(2)}, ValueError, "num_batch_labels must be a real one-element tensor"),
]


@pytest.mark.parametrize(("init", "call", "error", "message"), ERRORS)
def test_kd_loss_errors(init: dict, call: dict, error: type[Exception], message: str) -> None:
    student, teacher, labels = logits_problem(seed=1)
    tensors = {"student": student, "teacher": teacher, "labels": labels}
    extra = {}
    for name, change in call.items():
        if name in tensors:
            tensors[name] = change(tensors[name].detach())
        else:
            extra[name] = change
    with pytest.raises(error) as raised:
        orda_tp.KDLoss(**init)(tensors["student"], tensors["teacher"], tensors["labels"], **extra)
    assert message in str(raised.value)


# ---------------------------------------------------------------------------- flash_ce_kd_loss


def scoring_problem(seed: int, rows: int = 9, vocab: int = 50, width: int = 6):
    generator = torch.Generator().manual_seed(seed)
    student = 2 * torch.randn(rows, vocab, generator=generator, dtype=torch.float64)
    hidden = torch.randn(rows, width, generator=generator, dtype=torch.float64)
    weight = torch.randn(vocab, width, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    labels[[2, 5]] = -1
    return student, hidden, weight, labels


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("chunk_size", [16, 16384])
def test_flash_scores_match_fp64_formulas(temperature: float, chunk_size: int) -> None:
    student, hidden, weight, labels = scoring_problem(seed=int(temperature) + chunk_size)
    ce, kd = orda_tp.flash_ce_kd_loss(student, hidden, weight, labels, temperature=temperature, chunk_size=chunk_size)
    expected_ce, expected_kd = flash_scores_fp64(student, hidden, weight, labels, temperature, -1)
    assert ce.shape == kd.shape == labels.shape and ce.dtype == kd.dtype == torch.float64
    assert torch.equal(ce[labels == -1], torch.zeros(2, dtype=torch.float64))
    assert relative_error(ce, expected_ce) <= 1e-12 and relative_error(kd, expected_kd) <= 1e-12


def test_flash_scores_precision_and_no_gradient() -> None:
    """fp32 accumulation by default (also for bf16 logits), the logits' dtype with upcast=False;
    no gradient is formed or kept even for inputs that require one."""
    student, hidden, weight, labels = scoring_problem(seed=4)
    student16 = student.to(torch.bfloat16).requires_grad_()
    hidden32, weight32 = hidden.float().requires_grad_(), weight.float()
    expected_ce, expected_kd = flash_scores_fp64(student16.detach(), hidden32.detach(), weight32, labels, 2.0, -1)
    ce, kd = orda_tp.flash_ce_kd_loss(student16, hidden32, weight32, labels, temperature=2.0)
    assert ce.dtype == kd.dtype == torch.float32 and not ce.requires_grad and not kd.requires_grad
    assert relative_error(ce, expected_ce) <= 1e-6 and relative_error(kd, expected_kd) <= 1e-6
    rounded = orda_tp.flash_ce_kd_loss(student16, hidden32, weight32, labels, temperature=2.0, upcast=False)
    assert all(value.dtype == torch.bfloat16 for value in rounded)
    assert torch.equal(rounded[0], ce.to(torch.bfloat16)) and torch.equal(rounded[1], kd.to(torch.bfloat16))


FLASH_ERRORS = [
    ({"chunk_size": 0}, ValueError, "chunk_size must be an int >= 1, got 0"),
    ({"upcast": 1}, TypeError, "upcast must be a bool, got 1"),
    ({"temperature": -1.0}, ValueError, "temperature must be a finite real number > 0, got -1.0"),
    ({"weight": lambda w: w[:-1]}, ValueError, "teacher_lm_head_weight must have shape (50, 6)"),
    ({"hidden": lambda h: h[:-1]}, ValueError, "teacher_hidden must have shape (9, D)"),
    ({"student": lambda s: s[None]}, ValueError, "student_logits must be 2-D, got shape (1, 9, 50)"),
    ({"labels": lambda y: y + 100}, ValueError, "labels must lie in [0, 50) or equal ignore_index=-1"),
]


@pytest.mark.parametrize(("change", "error", "message"), FLASH_ERRORS)
def test_flash_errors(change: dict, error: type[Exception], message: str) -> None:
    student, hidden, weight, labels = scoring_problem(seed=1)
    tensors = {"student": student, "hidden": hidden, "weight": weight, "labels": labels}
    keywords = {}
    for name, value in change.items():
        if name in tensors:
            tensors[name] = value(tensors[name])
        else:
            keywords[name] = value
    with pytest.raises(error) as raised:
        orda_tp.flash_ce_kd_loss(
            tensors["student"], tensors["hidden"], tensors["weight"], tensors["labels"], **keywords
        )
    assert message in str(raised.value)


# ---------------------------------------------------------------------------- Triton kernels


@pytest.mark.parametrize("variant", ["forward", "skew_js", "dkd"])
def test_triton_kernels_read_logits_tiles(variant: str) -> None:
    """``backend="triton"`` (under Triton's interpreter on CPU) reads fp32 and bf16 logits as
    stored and writes the gradient in their dtype: the fp64 formulas on the same rounded values."""
    pytest.importorskip("triton")
    for dtype, grad_tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        student, teacher, labels = logits_problem(seed=20, dtype=dtype)
        loss_fn = orda_tp.KDLoss(temperature=TEMPERATURE, chunk_size=4, backend="triton", **variant_kwargs(variant))
        loss, grad = loss_and_grad(loss_fn, student, teacher, labels)
        expected, expected_grad = expected_loss_and_grad(student, teacher, labels, TEMPERATURE, variant=variant)
        assert loss.dtype == torch.float32 and grad.dtype == dtype
        assert relative_error(loss, expected) <= 1e-5
        assert relative_error(grad, expected_grad) <= grad_tolerance
    # Logits whose columns are not contiguous (a transposed view): the kernels get each block copied.
    student, teacher, labels = logits_problem(seed=22, dtype=torch.float32)
    student_t = student.detach().reshape(-1, VOCAB).T.contiguous().T.requires_grad_()
    teacher_t = teacher.reshape(-1, VOCAB).T.contiguous().T
    assert student_t.stride(1) != 1
    loss_fn = orda_tp.KDLoss(temperature=TEMPERATURE, chunk_size=4, backend="triton")
    loss, grad = loss_and_grad(loss_fn, student_t, teacher_t, labels.reshape(-1))
    expected, expected_grad = expected_loss_and_grad(student_t, teacher_t, labels.reshape(-1), TEMPERATURE)
    assert relative_error(loss, expected) <= 1e-5 and relative_error(grad, expected_grad) <= 1e-5
    student, hidden, weight, labels = scoring_problem(seed=21)
    scores = orda_tp.flash_ce_kd_loss(student.float(), hidden.float(), weight.float(), labels, backend="triton")
    for value, expected in zip(
        scores, flash_scores_fp64(student.float(), hidden.float(), weight.float(), labels, 1, -1)
    ):
        assert relative_error(value, expected) <= 1e-5


# ---------------------------------------------------------------------------- tensor parallelism


@pytest.mark.parametrize("world_size", [2, 3])
def test_tensor_parallel_equals_single_device(world_size: int) -> None:
    """Vocabulary-sharded logits (plain shards with tp_group, DTensors with the group inferred),
    every variant, several row chunks: the loss bitwise identical on every rank and equal to TP =
    1, each rank's gradient its slice; flash scores likewise; a bad shard on one rank raises the
    same error everywhere (tests/support/logits_workers.py)."""
    from .support import logits_workers
    from .support.distributed import run_distributed

    reports = run_distributed(world_size, logits_workers.tensor_parallel_worker, timeout=180)
    problems = [f"rank {rank}: {problem}" for rank, report in enumerate(reports) for problem in report]
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------- memory


def test_memory_script_kd_loss_workspace_below_one_fp32_copy() -> None:
    """benchmarks/measure_logits_memory.py on a small shape: KDLoss with chunk_size set adds, forward
    and backward (beyond the student's gradient), less than one fp32 copy of the logits."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "measure_logits_memory.py"
    command = [sys.executable, str(script), "--bt", "1024", "--vocab", "4096", "--chunk-size", "64"]
    completed = subprocess.run([*command, "--dtype", "float32"], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    verdict = re.search(r"^KDLoss float32: workspace ([0-9.]+) MiB = ([0-9.]+) fp32 copies OK$", completed.stdout, re.M)
    assert verdict is not None and float(verdict.group(2)) < 1.0, completed.stdout
