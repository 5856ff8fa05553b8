"""GPU-only behaviour (skipped without CUDA): the default path never synchronizes with the host,
is bitwise reproducible call to call, and can be captured in a CUDA graph and replayed.

A ``TeacherMixture`` of two teachers runs the Triton kernels in every combine mode, exact against its
fp64 oracle, and with scalar weights never synchronizes either.

Run on a CUDA machine with ``python -m pytest tests/test_gpu.py``. Every call runs once to warm
up (kernel compilation may synchronize), then again under
``torch.cuda.set_sync_debug_mode("error")``, which turns any synchronizing CUDA call into an error.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch

import orda_tp
from orda_tp import ChunkSize, KernelConfig, PrecomputedTeacher, SeparateTeacher, TeacherHead, TiedTeacher
from orda_tp.engine import gradient_gemms
from orda_tp.teachers.mixture import COMBINE_MODES

from .support.cases import NanFilledEmpty
from .support.mixture_cases import MixtureProblem, oracle

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ROWS, HIDDEN, VOCAB = 300, 64, 5003


def make_inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, device="cuda") * scale).to(dtype)

    labels = torch.randint(0, VOCAB, (ROWS,), generator=generator, device="cuda")
    labels[::7] = -100
    return {
        "hidden": randn(ROWS, HIDDEN).requires_grad_(),
        "weight": randn(VOCAB, HIDDEN, scale=2 / HIDDEN**0.5).requires_grad_(),
        "labels": labels,
        "teacher_hidden": randn(ROWS, HIDDEN),
        "teacher_weight": randn(VOCAB, HIDDEN, scale=2 / HIDDEN**0.5),
    }


def teacher_of(mode: str, t: dict[str, torch.Tensor]) -> object:
    if mode == "tied":
        return TiedTeacher(t["teacher_hidden"])
    if mode == "separate":
        return SeparateTeacher(t["teacher_hidden"], t["teacher_weight"])
    with torch.no_grad():
        return PrecomputedTeacher(logits=t["teacher_hidden"] @ t["teacher_weight"].T)


def run_without_sync(step: Callable[[], None]) -> None:
    step()  # warm-up: compilation and first allocations
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("mode", ["tied", "separate", "precomputed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_default_path_does_not_synchronize(dtype: torch.dtype, mode: str, reduction: str) -> None:
    t = make_inputs(dtype)
    teacher = teacher_of(mode, t)

    def step() -> None:
        out = orda_tp.distillation_loss(
            t["hidden"], t["weight"], t["labels"], teacher, kl_weight=1.0, kl_divergence="jeffreys",
            reduction=reduction,
        )  # fmt: skip
        torch.autograd.grad(out.loss.sum(), [t["hidden"], t["weight"]])

    run_without_sync(step)


def test_fp16_with_a_grad_scaler_does_not_synchronize() -> None:
    t = make_inputs(torch.float16)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**12)
    scaler.scale(torch.ones((), device="cuda"))  # the scale tensor exists from the first scale() on

    def step() -> None:
        out = orda_tp.distillation_loss(
            t["hidden"], t["weight"], t["labels"], TiedTeacher(t["teacher_hidden"]), kl_weight=1.0,
            grad_scaler=scaler,
        )  # fmt: skip
        torch.autograd.grad(scaler.scale(out.loss), [t["hidden"], t["weight"]])

    run_without_sync(step)


def test_inside_torch_compile_does_not_synchronize() -> None:
    t = make_inputs(torch.bfloat16)

    @torch.compile
    def step_compiled(hidden: torch.Tensor) -> torch.Tensor:
        out = orda_tp.distillation_loss(
            hidden * 1.0, t["weight"], t["labels"], TiedTeacher(t["teacher_hidden"]), kl_weight=1.0
        )
        return out.loss * 2.0

    def step() -> None:
        torch.autograd.grad(step_compiled(t["hidden"]), [t["hidden"], t["weight"]])

    run_without_sync(step)


def reference_of(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, teacher_hidden: torch.Tensor
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The fp64 reference loss (tied teacher, forward KL) of the same values, and its gradients
    with respect to the hidden states and the head."""
    exact_hidden = hidden.detach().double().requires_grad_()
    exact_weight = weight.detach().double().requires_grad_()
    reference = orda_tp.distillation_loss(
        exact_hidden, exact_weight, labels, TiedTeacher(teacher_hidden.double()), kl_weight=1.0, backend="reference"
    )
    return reference.loss, torch.autograd.grad(reference.loss, [exact_hidden, exact_weight])


def test_the_same_result_as_the_reference_on_the_gpu() -> None:
    t = make_inputs(torch.bfloat16)
    teacher = TiedTeacher(t["teacher_hidden"])
    out = orda_tp.distillation_loss(t["hidden"], t["weight"], t["labels"], teacher, kl_weight=1.0)
    grads = torch.autograd.grad(out.loss, [t["hidden"], t["weight"]])
    reference, expected = reference_of(t["hidden"], t["weight"], t["labels"], t["teacher_hidden"])
    assert abs(out.loss.item() - reference.item()) <= 1e-5 * abs(reference.item())
    for grad, exact_grad in zip(grads, expected):
        assert (grad.double() - exact_grad).norm() <= 1e-2 * exact_grad.norm()


@pytest.mark.parametrize("kl_weight", [1.0, 0.0])
def test_student_entropy_on_the_gpu_matches_fp64_and_does_not_synchronize(kl_weight: float) -> None:
    """``student_entropy=True`` on bf16 inputs (forward KL: round 2 in the gradient kernel; no KL:
    the sums kernel without a teacher): the fp64 entropy of the same values, the loss the call's
    without it, no host synchronization."""
    t = make_inputs(torch.bfloat16)
    teacher = TiedTeacher(t["teacher_hidden"])
    keywords = {"kl_weight": kl_weight, "kl_temperature": 2.0, "reduction": "sum"}
    out = orda_tp.distillation_loss(t["hidden"], t["weight"], t["labels"], teacher, student_entropy=True, **keywords)
    plain = orda_tp.distillation_loss(t["hidden"], t["weight"], t["labels"], teacher, **keywords)
    logp = torch.log_softmax((t["hidden"].double() @ t["weight"].double().T) / 2.0, dim=-1)
    rows = -torch.where(logp.exp() == 0, 0.0, logp.exp() * logp).sum(-1)
    expected = torch.where(t["labels"] != -100, rows, 0.0).sum()
    assert abs(out.student_entropy.item() - expected.item()) <= 1e-5 * expected.item()
    # The same sums of the same values (the compiled kernels differ by the entropy's column alone).
    assert abs(out.loss.item() - plain.loss.item()) <= 1e-6 * abs(plain.loss.item())

    def step() -> None:
        again = orda_tp.distillation_loss(
            t["hidden"], t["weight"], t["labels"], teacher, student_entropy=True, **keywords
        )
        torch.autograd.grad(again.loss, [t["hidden"], t["weight"]])

    run_without_sync(step)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("variant", ["forward", "generalized_jsd"])
def test_logit_scales_and_biases_in_bf16_match_fp64(backend: str, variant: str) -> None:
    """Scales and biases on both sides of a separate teacher, capped, bf16: the CUDA-only gradient
    GEMMs with the scale as their alpha, and the fp32 bias gradients, against the fp64 reference."""
    t = make_inputs(torch.bfloat16)
    generator = torch.Generator(device="cuda").manual_seed(3)
    bias = (0.5 * torch.randn(VOCAB, device="cuda", generator=generator)).to(torch.bfloat16).requires_grad_()
    teacher_bias = (0.5 * torch.randn(VOCAB, device="cuda", generator=generator)).to(torch.bfloat16)
    teacher_weight = t["teacher_weight"]
    keywords = {
        "kl_weight": 1.0,
        "kl_temperature": 2.0,
        "kl_divergence": variant,
        "logit_scale": 0.7,
        "teacher_logit_scale": 1.3,
        "logit_softcap": 30.0,
        "student_entropy": True,
    }
    tensors = [t["hidden"], t["weight"], bias]
    out = orda_tp.distillation_loss(
        *tensors[:2],
        t["labels"],
        SeparateTeacher(t["teacher_hidden"], teacher_weight, bias=teacher_bias),
        bias=bias,
        backend=backend,
        **keywords,
    )
    grads = torch.autograd.grad(out.loss, tensors)
    exact = [tensor.detach().double().requires_grad_() for tensor in tensors]
    teacher = SeparateTeacher(t["teacher_hidden"].double(), teacher_weight.double(), bias=teacher_bias.double())
    reference = orda_tp.distillation_loss(
        *exact[:2], t["labels"], teacher, bias=exact[2], backend="reference", **keywords
    )
    expected = torch.autograd.grad(reference.loss, exact)
    assert abs(out.loss.item() - reference.loss.item()) <= 1e-4 * abs(reference.loss.item())
    assert abs(out.student_entropy.item() - reference.student_entropy.item()) <= 1e-4 * reference.student_entropy.item()
    for grad, exact_grad, tensor in zip(grads, expected, tensors):
        assert grad.dtype == tensor.dtype
        assert (grad.double() - exact_grad).norm() <= 1e-2 * exact_grad.norm()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_mixed_dtypes_fp32_hidden_states_with_a_bf16_head(backend: str) -> None:
    t = make_inputs(torch.bfloat16)
    hidden = t["hidden"].detach().float().requires_grad_()
    teacher = TiedTeacher(t["teacher_hidden"].float())
    out = orda_tp.distillation_loss(hidden, t["weight"], t["labels"], teacher, kl_weight=1.0, backend=backend)
    grads = torch.autograd.grad(out.loss, [hidden, t["weight"]])
    reference, expected = reference_of(hidden, t["weight"], t["labels"], t["teacher_hidden"])
    assert grads[0].dtype == torch.float32 and grads[1].dtype == torch.bfloat16
    assert abs(out.loss.item() - reference.item()) <= 1e-5 * abs(reference.item())
    for grad, exact_grad in zip(grads, expected):
        assert (grad.double() - exact_grad).norm() <= 1e-2 * exact_grad.norm()


@pytest.mark.parametrize("scaling", ["materialization_scale", "grad_scaler", "none"])
def test_fp16_gradients_through_the_scaled_tensor_core_path(scaling: str) -> None:
    """fp16 logit gradients meet the tensor cores through a scale (or, without one, fp32 GEMMs);
    either way the gradients match the fp64 reference of the same rounded inputs."""
    t = make_inputs(torch.float16)
    kwargs: dict[str, object] = {}
    if scaling == "materialization_scale":
        kwargs["gradient_materialization_scale"] = 2.0**12
    elif scaling == "grad_scaler":
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**14)
        scaler.scale(torch.ones((), device="cuda"))
        kwargs["grad_scaler"] = scaler
    teacher = TiedTeacher(t["teacher_hidden"])
    out = orda_tp.distillation_loss(t["hidden"], t["weight"], t["labels"], teacher, kl_weight=1.0, **kwargs)
    grads = torch.autograd.grad(out.loss, [t["hidden"], t["weight"]])
    _, expected = reference_of(t["hidden"], t["weight"], t["labels"], t["teacher_hidden"])
    for grad, exact_grad in zip(grads, expected):
        assert grad.dtype == torch.float16 and torch.isfinite(grad).all()
        assert (grad.double() - exact_grad).norm() <= 2e-3 * exact_grad.norm()


@pytest.mark.parametrize("variant", ["forward", "skew_js", "dkd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kd_loss_on_given_logits_matches_the_fp64_formulas(variant: str, dtype: torch.dtype) -> None:
    """KDLoss on CUDA (the Triton kernels reading the stored logits, bf16 included): the seed's
    loss and its gradient in fp64 on the same rounded logits; the gradient in the logits' dtype."""
    from .support.cases import VARIANT_KWARGS
    from .test_logits_losses import kd_loss_fp64

    generator = torch.Generator(device="cuda").manual_seed(3)
    rows, vocab = 512, 32003
    student = (2 * torch.randn(rows, vocab, device="cuda", generator=generator)).to(dtype).requires_grad_()
    teacher = (2 * torch.randn(rows, vocab, device="cuda", generator=generator)).to(dtype)
    labels = torch.randint(0, vocab, (rows,), device="cuda", generator=generator)
    labels[::7] = -100
    loss_fn = orda_tp.KDLoss(temperature=1.5, chunk_size=96, kl_divergence=variant, **VARIANT_KWARGS[variant])
    loss = loss_fn(student, teacher, labels)
    (grad,) = torch.autograd.grad(loss, student)
    exact = student.detach().double().requires_grad_()
    expected = kd_loss_fp64(exact, teacher, labels, 1.5, variant=variant)
    (expected_grad,) = torch.autograd.grad(expected, exact)
    assert grad.dtype == dtype
    assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item())
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert (grad.double() - expected_grad).norm() <= tolerance * expected_grad.norm()


def test_flash_scores_on_the_gpu_match_the_fp64_formulas() -> None:
    """flash_ce_kd_loss on CUDA: the teacher's logits formed block by block from bf16 hidden
    states and head, the seed's CE and KD per token in fp64 on the same values."""
    from .test_logits_losses import flash_scores_fp64

    generator = torch.Generator(device="cuda").manual_seed(4)
    rows, vocab, width = 384, 32003, 256
    student = (2 * torch.randn(rows, vocab, device="cuda", generator=generator)).bfloat16()
    hidden = torch.randn(rows, width, device="cuda", generator=generator).bfloat16()
    weight = (torch.randn(vocab, width, device="cuda", generator=generator) * width**-0.5).bfloat16()
    labels = torch.randint(0, vocab, (rows,), device="cuda", generator=generator)
    labels[::5] = -1
    scores = orda_tp.flash_ce_kd_loss(student, hidden, weight, labels, temperature=2.0, chunk_size=8192)
    for value, expected in zip(scores, flash_scores_fp64(student, hidden, weight, labels, 2.0, -1)):
        assert (value.double() - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_distillation_head_in_a_compiled_bf16_model_matches_eager_and_does_not_synchronize() -> None:
    """orda_tp.DistillationHead inside a torch.compile'd bf16 model on CUDA: the loss and the
    gradients match the eager model's (the loss runs eagerly behind one graph break), and the
    compiled step never synchronizes with the host."""

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(HIDDEN, HIDDEN)
            self.lm_head = orda_tp.DistillationHead(HIDDEN, VOCAB, kl_weight=1.0, teacher_ce_weight=0.0)

        def forward(self, x: torch.Tensor, labels: torch.Tensor, teacher_hidden: torch.Tensor) -> object:
            return self.lm_head(torch.tanh(self.body(x)), labels=labels, teacher=TiedTeacher(teacher_hidden))

    torch.manual_seed(0)
    model = Model().to("cuda", torch.bfloat16)
    t = make_inputs(torch.bfloat16)
    x = t["hidden"].detach()
    eager = model(x, t["labels"], t["teacher_hidden"])
    eager_grads = torch.autograd.grad(eager.loss, list(model.parameters()))
    compiled = torch.compile(model)

    def step() -> None:
        out = compiled(x, t["labels"], t["teacher_hidden"])
        grads = torch.autograd.grad(out.loss, list(model.parameters()))
        step.result = (out, grads)  # type: ignore[attr-defined]

    run_without_sync(step)
    out, grads = step.result  # type: ignore[attr-defined]
    torch.testing.assert_close(out.loss, eager.loss, rtol=1e-2, atol=1e-2)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=5e-3)


@pytest.mark.parametrize("variant", ["forward", "reverse", "skew_js"])
def test_repeated_calls_are_bitwise_equal(variant: str) -> None:
    """The default path has no atomics whose order changes a sum: the loss, dh and dW of repeated
    calls are bitwise equal (bf16, tied frozen teacher)."""
    t = make_inputs(torch.bfloat16)
    results = []
    for _ in range(3):
        out = orda_tp.distillation_loss(
            t["hidden"], t["weight"], t["labels"], TiedTeacher(t["teacher_hidden"]), teacher_ce_weight=0.0,
            kl_weight=1.0, kl_divergence=variant, **({"kl_beta": 0.4} if variant == "skew_js" else {}),
        )  # fmt: skip
        results.append([out.loss.detach(), *torch.autograd.grad(out.loss, [t["hidden"], t["weight"]])])
    for again in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], again))


def test_the_default_path_is_captured_in_a_cuda_graph_and_replayed() -> None:
    """Forward and backward of a default call (bf16, tied frozen teacher, KD) captured once in a
    CUDA graph; replayed on new values of the same tensors, it gives the eager call's loss and
    gradients bitwise."""
    t = make_inputs(torch.bfloat16)
    hidden, weight, labels = t["hidden"], t["weight"], t["labels"]
    teacher = TiedTeacher(t["teacher_hidden"])

    def step() -> list[torch.Tensor]:
        out = orda_tp.distillation_loss(hidden, weight, labels, teacher, teacher_ce_weight=0.0, kl_weight=1.0)
        return [out.loss.detach(), *torch.autograd.grad(out.loss, [hidden, weight])]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: kernels compiled, allocator pools filled
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    fresh = make_inputs(torch.bfloat16)
    with torch.no_grad():
        hidden.copy_(fresh["hidden"] * 0.5)
        weight.copy_(fresh["weight"] * 1.5)
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for replayed, expected in zip(captured, eager):
        assert torch.equal(replayed, expected)


@pytest.mark.parametrize("accumulation", ["auto", "fp32"])
@pytest.mark.parametrize("variant", ["forward", "mutual"])
def test_gradient_gemms_write_buffers_that_come_filled_with_nan(
    monkeypatch: pytest.MonkeyPatch, variant: str, accumulation: str
) -> None:
    """cuBLAS's β = 0 GEMMs (a hidden gradient's rows, a head gradient's first row group; bf16
    ``addmm_`` and fp32-output ``addmm``) do not read their output: buffers that come filled with
    NaN give the zeroed buffers' gradients bitwise, over three row groups and a padded vocabulary."""
    t = make_inputs(torch.bfloat16)
    teacher_hidden = t["teacher_hidden"].detach().clone().requires_grad_(variant == "mutual")
    config = KernelConfig(chunk_size=ChunkSize.nrows(40), grad_weight_accumulation=accumulation)
    labels = t["labels"].clamp(max=VOCAB - 11)
    inputs = [t["hidden"], t["weight"]] + ([teacher_hidden] if variant == "mutual" else [])

    def grads() -> list[torch.Tensor]:
        out = orda_tp.distillation_loss(
            t["hidden"], t["weight"], labels, TiedTeacher(teacher_hidden), kl_weight=1.0, kl_divergence=variant,
            vocab_size=VOCAB - 10, config=config,
        )  # fmt: skip
        return list(torch.autograd.grad(out.loss, inputs))

    zeroed = grads()
    monkeypatch.setattr(gradient_gemms, "torch", NanFilledEmpty())
    unwritten = grads()
    assert torch.all(zeroed[1][VOCAB - 10 :] == 0)
    for got, expected in zip(unwritten, zeroed):
        assert torch.isfinite(got).all() and torch.equal(got, expected)


MIXTURE_WIDTHS = (96, 48)  # two teachers, each of its own width


def mixture_teachers(dtype: torch.dtype) -> list[SeparateTeacher]:
    """Two frozen teachers of MIXTURE_WIDTHS with heads of their own, logits of standard deviation ≈ 2."""
    generator = torch.Generator(device="cuda").manual_seed(1)
    teachers = []
    for width in MIXTURE_WIDTHS:
        hidden = torch.randn(ROWS, width, generator=generator, device="cuda").to(dtype)
        head = (torch.randn(VOCAB, width, generator=generator, device="cuda") * (2 / width**0.5)).to(dtype)
        teachers.append(SeparateTeacher(hidden, head))
    return teachers


def mixture_weights(kind: str) -> torch.Tensor:
    """(ROWS, 2) fp32 weights: "dense" rows summing to 1; "routed" one-hot rows, a run of rows for each
    teacher (each one's GEMM reads its run in place) and then rows drawn at random (gathered)."""
    generator = torch.Generator(device="cuda").manual_seed(2)
    if kind == "routed":
        chosen = torch.randint(0, 2, (ROWS,), generator=generator, device="cuda")
        chosen[: ROWS // 3], chosen[ROWS // 3 : 2 * ROWS // 3] = 0, 1
        return torch.nn.functional.one_hot(chosen, 2).float()
    weights = torch.rand(ROWS, 2, generator=generator, device="cuda") + 0.1
    return weights / weights.sum(1, keepdim=True)


@pytest.mark.parametrize("weights", ["dense", "routed"])
@pytest.mark.parametrize("combine", COMBINE_MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_teacher_mixture_on_the_gpu_matches_fp64(dtype: torch.dtype, combine: str, weights: str) -> None:
    """Two separate teachers mixed by ``combine`` through backend "auto" (the Triton kernels: no fallback
    warning), student CE + forward KL at T = 2: the loss and the gradients of the student's states and
    head against the fp64 oracle of the same rounded values (one-teacher reference calls composed from
    the mode's definition, tests/support/mixture_cases.py)."""
    t, teachers, table = make_inputs(dtype), mixture_teachers(dtype), mixture_weights(weights)
    keywords: dict[str, object] = {"kl_weight": 1.0, "kl_temperature": 2.0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mixture = orda_tp.TeacherMixture(teachers, table, combine)
        out = orda_tp.distillation_loss(t["hidden"], t["weight"], t["labels"], mixture, **keywords)
        grads = torch.autograd.grad(out.loss, [t["hidden"], t["weight"]])
    assert not [w for w in caught if str(w.message).startswith("orda_tp: backend='auto'")]
    exact = [t[name].detach().double().requires_grad_() for name in ("hidden", "weight")]
    names = [f"teacher{index}" for index in range(len(teachers))]
    exact_teachers = [SeparateTeacher(m.hidden.double(), m.weight.double()) for m in teachers]
    members: dict[str, TiedTeacher | SeparateTeacher | PrecomputedTeacher] = dict(zip(names, exact_teachers))
    raw = {name: m.hidden @ m.weight.T for name, m in zip(names, exact_teachers)}
    bias = torch.zeros(VOCAB, dtype=torch.float64, device="cuda")
    problem = MixtureProblem(exact[0], exact[1], bias, t["labels"], members, raw)
    reference = oracle(problem, names, table.double(), combine, keywords)
    expected = torch.autograd.grad(reference.loss, exact)
    assert abs(out.loss.item() - reference.loss.item()) <= 1e-5 * abs(reference.loss.item())
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for grad, exact_grad in zip(grads, expected):
        assert grad.dtype == dtype
        assert (grad.double() - exact_grad).norm() <= tolerance * exact_grad.norm()


@pytest.mark.parametrize("combine", COMBINE_MODES)
def test_a_mixture_of_two_heads_with_scalar_weights_does_not_synchronize(combine: str) -> None:
    """Scalar weights are never read from a device: a bf16 mixture of two ``TeacherHead`` members (frozen
    ``nn.Linear`` heads of their own widths), forward and backward, makes no synchronizing CUDA call."""
    t = make_inputs(torch.bfloat16)
    members = []
    for teacher in mixture_teachers(torch.bfloat16):
        head = torch.nn.Linear(teacher.weight.shape[1], VOCAB, bias=False, device="cuda", dtype=torch.bfloat16)
        head.weight = torch.nn.Parameter(teacher.weight, requires_grad=False)
        members.append(TeacherHead(teacher.hidden, head))
    mixture = orda_tp.TeacherMixture(members, [0.25, 0.75], combine)

    def step() -> None:
        out = orda_tp.distillation_loss(t["hidden"], t["weight"], t["labels"], mixture, kl_weight=1.0)
        torch.autograd.grad(out.loss, [t["hidden"], t["weight"]])

    run_without_sync(step)
