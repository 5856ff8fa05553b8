"""Per-side logit scales (``logit_scale``, ``teacher_logit_scale``) and LM-head biases (``bias=``,
``SeparateTeacher(bias=)``, a ``TeacherHead``'s ``head.bias``, ``PrecomputedTeacher(teacher_bias=)``).

- Each side's logits are ``cap(scale·(h·Wᵀ + b))`` (TRL's and the model configs' order: the bias,
  the scale, the soft-cap, then ``/T``) for every term: student CE (label-smoothed), z-loss,
  teacher CE and the KL (forward, reverse, skew_js, alpha_divergence; mutual co-trains the teacher).
  Compared with logits formed by hand in fp64 (tests/support/scale_bias.py), for every teacher kind
  (tied, separate, TeacherHead, hidden-state cache, logits cache, top-k cache), every reduction
  (``"none"``: the deferred gradient), on the reference and torch backends (fp64, ≤ 1e-11) and the
  Triton kernels (interpreted, fp32): values and the gradients of the hidden states, weights and
  biases, the teacher's where it is trained.
- Vocabulary padding stays out of every term whatever its bias; its bias gradient is 0.
- A bias's gradient comes back in its dtype; a scale of 1 and no bias is the call without them.
- Bad scales, biases and their combinations with teachers raise naming the argument.
- Tensor parallelism (2 and 3 gloo ranks: uneven, padded and DTensor shards of weight and bias,
  sequence parallelism) equals the single-device call; a TeacherHead under FSDP2 gathers its bias.
"""

from __future__ import annotations

import pytest
import torch

import orda_tp

from .support.cases import SMALL_CHUNKS, relative_error, stable_seed
from .support.scale_bias import (
    KINDS,
    VOCAB,
    Biased,
    keywords,
    make_biased,
    oracle,
    teacher_of,
)

COMPONENTS = ("loss", "student_ce", "teacher_ce", "kl", "z_loss")


def check_call(backend: str, kind: str, variant: str, reduction: str, *, caps: bool = True, padding: int = 0) -> None:
    """One call against the oracle: outputs, then gradients for a random upstream gradient."""
    triton = backend == "triton"
    dtype, tolerance = (torch.float32, 2e-5) if triton else (torch.float64, 1e-11)
    base = make_biased(stable_seed(backend, kind, variant, reduction, caps, padding), padded_to=VOCAB + padding)
    problem, exact = base.to(dtype), base.to(torch.float64)
    teacher, trained = teacher_of(problem, kind, VOCAB)
    kw = keywords(kind, variant, reduction, caps)
    out = orda_tp.distillation_loss(
        problem.hidden, problem.weight, problem.labels, teacher, bias=problem.bias, backend=backend,
        config=None if backend == "reference" else SMALL_CHUNKS, vocab_size=VOCAB if padding else None, **kw,
    )  # fmt: skip
    want = oracle(exact, kind, kw)
    for name, value in zip(COMPONENTS, out):
        assert relative_error(value, want[name]) <= tolerance, (name, relative_error(value, want[name]))
    upstream = torch.rand(out.loss.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    inputs = [problem.hidden, problem.weight, problem.bias, *trained]
    exact_inputs = [exact.hidden, exact.weight, exact.bias]
    exact_inputs += {"tied": [exact.tied_hidden], "hidden_cache": [], "logits_cache": [], "topk": []}.get(
        kind, [exact.teacher_hidden, exact.teacher_weight, exact.teacher_bias]
    )
    grads = torch.autograd.grad(out.loss, inputs, upstream.to(dtype), allow_unused=True)
    expected = torch.autograd.grad(want["loss"], exact_inputs, upstream, allow_unused=True)
    names = ["hidden", "weight", "bias", "teacher hidden", "teacher weight", "teacher bias"]
    for name, grad, wanted, tensor in zip(names, grads, expected, inputs):
        grad = torch.zeros_like(tensor) if grad is None else grad
        wanted = torch.zeros_like(grad, dtype=torch.float64) if wanted is None else wanted
        assert grad.dtype == tensor.dtype, name
        assert relative_error(grad, wanted) <= tolerance * 10, (name, relative_error(grad, wanted))
    if padding:  # the padded columns' bias reaches no term: their gradient is exactly 0
        assert torch.equal(grads[2][VOCAB:], torch.zeros_like(grads[2][VOCAB:]))


@pytest.mark.parametrize("variant", ["forward", "reverse", "skew_js", "alpha_divergence"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_scaled_biased_logits_equal_the_oracle(backend: str, kind: str, reduction: str, variant: str) -> None:
    """Every teacher kind × reduction × variant, with and without the soft-caps (by variant)."""
    check_call(backend, kind, variant, reduction, caps=variant in ("forward", "skew_js"))


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("kind", ["tied", "separate", "head"])
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_a_cotrained_teacher_trains_its_head_and_bias(backend: str, kind: str, reduction: str) -> None:
    """``mutual``: the KL's gradient reaches the teacher's hidden states, head and bias (a tied
    teacher's: the student's head and bias), through its scale and cap."""
    check_call(backend, kind, "mutual", reduction)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("kind", ["tied", "separate", "logits_cache", "topk"])
def test_vocabulary_padding_stays_masked_whatever_its_bias(backend: str, kind: str) -> None:
    """Head rows past ``vocab_size`` with a bias of 40: no term reads them, their gradients are 0."""
    check_call(backend, kind, "forward", "mean", padding=13)
    check_call(backend, kind, "skew_js", "none", padding=13)


TRITON_CASES = [
    ("tied", "forward", "mean"),
    ("separate", "skew_js", "none"),
    ("separate", "mutual", "mean"),
    ("head", "reverse", "sum"),
    ("hidden_cache", "alpha_divergence", "none"),
    ("logits_cache", "forward", "none"),
    ("topk", "reverse", "mean"),
]


@pytest.mark.parametrize(("kind", "variant", "reduction"), TRITON_CASES)
def test_triton_kernels_read_the_scaled_biased_logits(kind: str, variant: str, reduction: str) -> None:
    """The kernels cap what the logits source formed (bias, then scale): fp32 against the oracle."""
    pytest.importorskip("triton")
    check_call("triton", kind, variant, reduction, caps=kind != "head")
    if kind == "separate" and variant == "skew_js":
        check_call("triton", kind, variant, reduction, padding=13)


def test_bias_gradient_in_its_own_dtype() -> None:
    """A bf16 or fp16 bias beside fp32 heads: its gradient is summed in fp32 and returned in its dtype,
    close to the fp64 oracle's on the rounded bias."""
    for dtype in (torch.bfloat16, torch.float16):
        base = make_biased(11)
        base.bias = base.bias.to(dtype).double()  # the values the call reads
        problem, exact = base.to(torch.float32), base.to(torch.float64)
        bias = problem.bias.detach().to(dtype).requires_grad_()
        teacher, _ = teacher_of(problem, "separate", VOCAB)
        kw = keywords("separate", "forward", "mean")
        out = orda_tp.distillation_loss(
            problem.hidden, problem.weight, problem.labels, teacher, bias=bias, backend="torch", **kw
        )
        (grad,) = torch.autograd.grad(out.loss, [bias])
        (want,) = torch.autograd.grad(oracle(exact, "separate", kw)["loss"], [exact.bias])
        assert grad.dtype == dtype
        assert relative_error(grad, want) <= 1e-2


def test_unit_scales_and_no_bias_are_the_call_without_them() -> None:
    """``logit_scale=1.0``, ``teacher_logit_scale=1.0`` and ``bias=None`` change no bit; a zero bias
    changes none of the values either (it adds exact zeros)."""
    problem = make_biased(12)
    teacher, _ = teacher_of(problem, "separate", VOCAB)
    kw = dict(kl_weight=1.0, kl_temperature=2.0, backend="torch", config=SMALL_CHUNKS, teacher_ce_weight=0.3)
    args = (problem.hidden, problem.weight, problem.labels, teacher)
    plain = orda_tp.distillation_loss(*args, **kw)
    explicit = orda_tp.distillation_loss(*args, logit_scale=1.0, teacher_logit_scale=1.0, bias=None, **kw)
    zero = orda_tp.distillation_loss(*args, bias=torch.zeros(VOCAB, dtype=torch.float64), **kw)
    for a, b, c in zip(plain, explicit, zero):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_the_module_takes_the_bias_per_call() -> None:
    """``DistillationLoss(**keywords)(..., bias=b)`` is ``distillation_loss(..., bias=b, **keywords)``."""
    problem = make_biased(14)
    teacher, _ = teacher_of(problem, "separate", VOCAB)
    kw = {**keywords("separate", "reverse", "none"), "backend": "torch", "config": SMALL_CHUNKS}
    args = (problem.hidden, problem.weight, problem.labels, teacher)
    module = orda_tp.DistillationLoss(**kw)(*args, bias=problem.bias)
    function = orda_tp.distillation_loss(*args, bias=problem.bias, **kw)
    for a, b in zip(module, function):
        assert torch.equal(a, b)


def test_a_scale_is_a_factor_of_the_hidden_states_and_bias_without_a_cap() -> None:
    """Without a soft-cap, ``logit_scale=a`` is the call on ``a·h`` and ``a·b`` (the same logits)."""
    problem = make_biased(13)
    teacher = orda_tp.SeparateTeacher(problem.teacher_hidden.detach(), problem.teacher_weight.detach())
    kw = dict(kl_weight=1.0, kl_temperature=2.0, backend="torch", config=SMALL_CHUNKS, kl_divergence="reverse")
    hidden = problem.hidden.detach()
    scaled = orda_tp.distillation_loss(
        hidden, problem.weight.detach(), problem.labels, teacher, bias=problem.bias.detach(), logit_scale=0.6, **kw
    )
    folded = orda_tp.distillation_loss(
        0.6 * hidden, problem.weight.detach(), problem.labels, teacher, bias=0.6 * problem.bias.detach(), **kw
    )
    for a, b in zip(scaled, folded):
        assert relative_error(a, b) <= 1e-13


# ------------------------------------------------------------------------------------- errors


def _call(problem: Biased, teacher: object, **kw: object) -> orda_tp.DistillationLossOutput:
    return orda_tp.distillation_loss(problem.hidden, problem.weight, problem.labels, teacher, kl_weight=1.0, **kw)


@pytest.mark.parametrize("name", ["logit_scale", "teacher_logit_scale"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf"), "2", True])
def test_bad_scales_raise_naming_the_argument(name: str, value: object) -> None:
    message = f"{name} must be a finite real number > 0, got {value!r}"
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        orda_tp.DistillationLoss(**{name: value})
    problem = make_biased(1)
    with pytest.raises(ValueError, match=name):
        _call(problem, orda_tp.SeparateTeacher(problem.teacher_hidden, problem.teacher_weight), **{name: value})


def _bias_cases(problem: Biased) -> list[tuple[object, type, str]]:
    bias = problem.bias.detach()
    return [
        (bias[:-1], ValueError, r"bias must have shape \(203,\) \(one entry per row of weight\), got \(202,\)"),
        (bias[:, None], ValueError, r"bias must be 1-D, got shape \(203, 1\)"),
        (bias.long(), TypeError, "bias must be a floating-point tensor"),
        (bias.to("meta"), ValueError, "bias must be on student_hidden's device cpu, got meta"),
        (bias.tolist(), TypeError, "bias must be a torch.Tensor"),
    ]


def test_bad_biases_raise_naming_the_argument() -> None:
    problem = make_biased(2)
    for bias, error, message in _bias_cases(problem):
        with pytest.raises(error, match=message):
            _call(problem, orda_tp.TiedTeacher(problem.tied_hidden), bias=bias)
    hidden, weight, bias = problem.teacher_hidden, problem.teacher_weight, problem.teacher_bias
    with pytest.raises(ValueError, match=r"teacher.bias must have shape \(203,\) \(one entry per row of the head"):
        _call(problem, orda_tp.SeparateTeacher(hidden, weight, bias[:-2]))
    with pytest.raises(ValueError, match="SeparateTeacher.bias must be 1-D"):
        orda_tp.SeparateTeacher(hidden, weight, bias[None])
    with pytest.raises(TypeError, match="SeparateTeacher.bias must be a floating-point tensor"):
        orda_tp.SeparateTeacher(hidden, weight, bias.long())
    with pytest.raises(ValueError, match="teacher.bias must be on student_hidden's device cpu, got meta"):
        _call(problem, orda_tp.SeparateTeacher(hidden, weight, bias.detach().to("meta")))
    with pytest.raises(ValueError, match=r"teacher.teacher_bias must have shape \(203,\)"):
        _call(problem, orda_tp.PrecomputedTeacher(teacher_hidden=hidden.detach(), teacher_weight=weight.detach(),
                                                  teacher_bias=bias.detach()[1:]))  # fmt: skip
    with pytest.raises(ValueError, match="PrecomputedTeacher.teacher_bias is teacher_weight's bias"):
        orda_tp.PrecomputedTeacher(logits=torch.zeros(problem.labels.shape[0], VOCAB), teacher_bias=bias.detach())
    with pytest.raises(ValueError, match="PrecomputedTeacher.teacher_bias must not require grad"):
        orda_tp.PrecomputedTeacher(
            teacher_hidden=hidden.detach(), teacher_weight=weight.detach(), teacher_bias=bias.detach().requires_grad_()
        )
    head = torch.nn.Linear(3, 5)
    head.bias = torch.nn.Parameter(torch.zeros(5, 1))
    with pytest.raises(ValueError, match="TeacherHead.head.bias must be 1-D"):
        orda_tp.TeacherHead(torch.zeros(4, 3), head)


def test_scales_a_teacher_cannot_take_raise() -> None:
    """A cache holds formed logits: a teacher scale would be silently lost, so it raises (like a
    soft-cap); a tied teacher reads the student's head, whose logits have one scale."""
    problem = make_biased(3)
    logits = orda_tp.PrecomputedTeacher(logits=torch.zeros(problem.labels.shape[0], VOCAB, dtype=torch.float64))
    topk, _ = teacher_of(problem, "topk", VOCAB)
    for cache, kind in ((logits, "precomputed_logits"), (topk, "precomputed_topk")):
        message = f"teacher_logit_scale=2.0 scales logits a teacher head forms, but this {kind} cache"
        with pytest.raises(ValueError, match=message):
            _call(problem, cache, teacher_logit_scale=2.0, teacher_ce_weight=0.0)
        _call(problem, cache, logit_scale=2.0, teacher_ce_weight=0.0)  # the student's scale is the student's
    tied = orda_tp.TiedTeacher(problem.tied_hidden)
    with pytest.raises(ValueError, match="a TiedTeacher reads the student's head, whose logits have one scale; got "
                       "teacher_logit_scale=1.0 and logit_scale=2.0"):  # fmt: skip
        _call(problem, tied, logit_scale=2.0)
    _call(problem, tied, logit_scale=2.0, teacher_logit_scale=2.0)


# ------------------------------------------------------------------------------ multi-process


@pytest.mark.parametrize("world_size", [2, 3])
def test_scales_and_biases_under_tensor_parallelism(world_size: int) -> None:
    """Plain shards with ``tp_group`` (uneven; padded with a bias of 40 on the padding; sequence
    parallel), DTensor Shard(0) weights and biases, every head kind, reductions mean/sum/none, the
    Triton kernels on shards: equal to the single-device call, bitwise across ranks; misplaced
    biases raise on every rank."""
    from .support import scale_bias_workers
    from .support.distributed import run_distributed

    reports = run_distributed(world_size, scale_bias_workers.tp_worker, timeout=300)
    problems = [f"rank {rank}: {p}" for rank, found in enumerate(reports) for p in found]
    assert not problems, "\n".join(problems[:40])


def test_teacher_head_under_fsdp2_gathers_its_bias() -> None:
    """A frozen biased teacher head under ``fully_shard``, passed as a TeacherHead: its weight and
    bias gathered for the call (reduction "none" too), equal to the single-device call."""
    from .support import scale_bias_workers
    from .support.distributed import run_distributed

    reports = run_distributed(2, scale_bias_workers.fsdp_teacher_head_worker, timeout=180)
    problems = [f"rank {rank}: {p}" for rank, found in enumerate(reports) for p in found]
    assert not problems, "\n".join(problems)
