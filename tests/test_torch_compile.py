"""The loss under ``torch.compile`` (orda_tp/loss_op.py): a one-device call with a tied or separate
teacher (or a ``TeacherHead`` module) is one operator, ``orda_tp::distillation_loss``, so that
``fullgraph=True`` compiles; its loss, components and gradients equal the eager call's in fp64
(bitwise here; at most 1e-12 is the bound), for every reduction and a second backward
(``retain_graph``), and its gradients equal them bitwise in bf16 and fp16 for an upstream gradient
that is not a power of two. A step whose head and loss are compiled has no graph break; a call the
operator does not cover (a cache, a tensor-parallel call) still runs, eagerly, behind a graph break,
its checks included, and a bad keyword raises as it does eagerly. Small shapes and the ``aot_eager`` backend keep
compilation short on the CPU; three cases run Inductor."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch._dynamo.utils import counters

import orda_tp

ROWS, HIDDEN, VOCAB = 8, 16, 40
Loss = Callable[[Tensor, Tensor, Tensor], orda_tp.DistillationLossOutput]
#: The layer before the head in a compiled step.
_LAYER = torch.nn.Linear(HIDDEN, HIDDEN, dtype=torch.float64)


def _tensors() -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    labels = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    labels[3] = -100  # an ignored row
    return {
        "hidden": randn(ROWS, HIDDEN),
        "weight": randn(VOCAB, HIDDEN),
        "bias": randn(VOCAB),
        "teacher_hidden": randn(ROWS, HIDDEN),
        "teacher_weight": randn(VOCAB, HIDDEN),
        "teacher_bias": randn(VOCAB),
        "labels": labels,
        "token_weights": torch.rand(ROWS, generator=generator, dtype=torch.float64),
    }


def _teacher(
    kind: str, t: dict[str, Tensor]
) -> orda_tp.TiedTeacher | orda_tp.SeparateTeacher | orda_tp.PrecomputedTeacher:
    if kind == "tied":
        return orda_tp.TiedTeacher(t["teacher_hidden"])
    if kind == "separate":
        return orda_tp.SeparateTeacher(t["teacher_hidden"], t["teacher_weight"], t["teacher_bias"])
    return orda_tp.PrecomputedTeacher(logits=t["teacher_hidden"] @ t["teacher_weight"].T)


def _loss(kind: str, reduction: str, t: dict[str, Tensor], **keywords: object) -> Loss:
    def loss(hidden: Tensor, weight: Tensor, bias: Tensor) -> orda_tp.DistillationLossOutput:
        teacher = _teacher(kind, t)  # built inside the compiled function, as a training step does
        return orda_tp.distillation_loss(
            hidden, weight, t["labels"], teacher, bias=bias, kl_weight=0.5, reduction=reduction, **keywords
        )

    return loss


def _run(loss: Loss, t: dict[str, Tensor]) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """The outputs, and the gradients of (hidden, weight, bias) after one backward and after a second one."""
    leaves = [t[name].clone().requires_grad_() for name in ("hidden", "weight", "bias")]
    out = loss(*leaves)
    # A (rows,) loss is reduced with unequal weights, so the upstream gradient differs per row.
    total = out.loss if out.loss.dim() == 0 else (out.loss * torch.arange(1.0, ROWS + 1, dtype=torch.float64)).sum()
    total.backward(retain_graph=True)
    first = [leaf.grad.clone() for leaf in leaves if leaf.grad is not None]
    total.backward()
    second = [leaf.grad for leaf in leaves if leaf.grad is not None]
    return list(out), first, second


def _assert_same(compiled: list[Tensor], eager: list[Tensor]) -> None:
    assert len(compiled) == len(eager)
    for got, want in zip(compiled, eager):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("kind", "reduction", "keywords"),
    [
        ("tied", "mean", {}),
        ("separate", "sum", {"token_weights": True}),
        ("tied", "mean", {"num_valid_tokens": True}),
        ("tied", "none", {}),
        ("separate", "none", {}),
    ],
)
def test_compiled_call_is_one_graph_and_equals_eager(kind: str, reduction: str, keywords: dict[str, bool]) -> None:
    t = _tensors()
    given: dict[str, object] = {}
    if "token_weights" in keywords:
        given["token_weights"] = t["token_weights"]
    if "num_valid_tokens" in keywords:
        given["num_valid_tokens"] = torch.tensor(5.0, dtype=torch.float64)
    loss = _loss(kind, reduction, t, **given)
    eager = _run(loss, t)
    counters.clear()
    compiled = _run(torch.compile(loss, fullgraph=True, backend="aot_eager"), t)
    assert counters["stats"]["unique_graphs"] == 1
    for got, want in zip(compiled, eager):
        _assert_same(got, want)
    leaves = [t[name].clone().requires_grad_() for name in ("hidden", "weight", "bias")]
    out = torch.compile(loss, fullgraph=True, backend="aot_eager")(*leaves)
    # The components are reports, never differentiated, as eagerly.
    assert out.loss.requires_grad and not any(component.requires_grad for component in out[1:])


@pytest.mark.parametrize(
    ("dtype", "reduction", "backend"),
    [
        (torch.bfloat16, "mean", "aot_eager"),
        (torch.bfloat16, "sum", "aot_eager"),
        (torch.float16, "mean", "aot_eager"),
        (torch.bfloat16, "sum", "inductor"),
    ],
)
def test_low_precision_gradients_equal_eager_for_a_non_power_of_two_upstream(
    dtype: torch.dtype, reduction: str, backend: str
) -> None:
    """bf16/fp16 inputs, a student and a trained separate teacher with biases, and an upstream gradient
    of 1/3 (a loss divided by 3 accumulation steps): every gradient is the eager call's, bit for bit.
    Eagerly the engine scales each gradient in its buffer's dtype (fp32 for a bias, and for an fp16
    head weight) and then casts it once to its input's dtype; so does the compiled backward."""
    t = _tensors()
    names = ("hidden", "weight", "bias", "teacher_hidden", "teacher_weight", "teacher_bias")

    def loss(*tensors: Tensor) -> Tensor:
        hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias = tensors
        teacher = orda_tp.SeparateTeacher(teacher_hidden, teacher_weight, teacher_bias)
        return orda_tp.distillation_loss(
            hidden, weight, t["labels"], teacher, bias=bias, kl_weight=0.5, teacher_ce_weight=0.3, reduction=reduction
        ).loss

    def gradients(function: Callable[..., Tensor]) -> list[Tensor]:
        leaves = [t[name].to(dtype).requires_grad_() for name in names]
        return list(torch.autograd.grad(function(*leaves), leaves, grad_outputs=torch.tensor(1 / 3)))

    eager = gradients(loss)
    # Compiled afresh: a cached graph keeps the operator's autograd of the orda_tp that cached it (its Python
    # is not in the cache key), whatever orda_tp runs now.
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = gradients(torch.compile(loss, fullgraph=True, backend=backend))
    for got, want in zip(compiled, eager, strict=True):
        assert got.dtype == dtype and torch.equal(got, want)


def test_module_under_inductor_equals_eager() -> None:
    t = _tensors()
    module = orda_tp.DistillationLoss(kl_weight=1.0, kl_divergence="reverse", teacher_ce_weight=0.0)

    def loss(hidden: Tensor, weight: Tensor, bias: Tensor) -> orda_tp.DistillationLossOutput:
        return module(hidden, weight, t["labels"], orda_tp.TiedTeacher(t["teacher_hidden"]), bias=bias)

    eager = _run(loss, t)
    compiled = _run(torch.compile(loss, fullgraph=True), t)
    for got, want in zip(compiled, eager):
        _assert_same(got, want)


def test_head_of_a_compiled_model_under_inductor_equals_eager() -> None:
    """A CE-only DistillationHead on a view of the model's rows, compiled by Inductor: its stand-in
    teacher's hidden states are the student's own tensor, one tensor in two of the operator's inputs."""
    t = _tensors()
    linear = torch.nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.float64)
    head = orda_tp.DistillationHead.from_linear(linear, student_ce_weight=1.0, kl_weight=0.0)
    labels = t["labels"].reshape(2, ROWS // 2)

    def loss(hidden: Tensor, weight: Tensor, bias: Tensor) -> orda_tp.DistillationLossOutput:
        rows = hidden.reshape(2, ROWS // 2, HIDDEN)[:, :-1]
        return head(rows, labels[:, 1:])

    eager = _run(loss, t)
    compiled = _run(torch.compile(loss, fullgraph=True), t)
    for got, want in zip(compiled, eager):
        _assert_same(got, want)


def test_teacher_head_is_read_as_its_weight_and_bias() -> None:
    t = _tensors()
    head = torch.nn.Linear(HIDDEN, VOCAB, dtype=torch.float64)

    def loss(hidden: Tensor, weight: Tensor, bias: Tensor) -> orda_tp.DistillationLossOutput:
        teacher = orda_tp.TeacherHead(t["teacher_hidden"], head)
        return orda_tp.distillation_loss(hidden, weight, t["labels"], teacher, bias=bias, teacher_ce_weight=0.3)

    eager = _run(loss, t)
    eager_head = [p.grad.clone() for p in head.parameters() if p.grad is not None]
    head.zero_grad(set_to_none=True)
    compiled = _run(torch.compile(loss, fullgraph=True, backend="aot_eager"), t)
    for got, want in zip(compiled, eager):
        _assert_same(got, want)
    # The trained teacher head's gradients, after the two backwards.
    _assert_same([p.grad for p in head.parameters() if p.grad is not None], eager_head)
    assert len(eager_head) == 2


def test_frozen_teacher_receives_no_gradient() -> None:
    """A teacher tensor that requires grad but to which the plan routes none keeps ``grad`` None, as eagerly."""
    t = _tensors()
    teacher_hidden = t["teacher_hidden"].clone().requires_grad_()
    hidden = t["hidden"].clone().requires_grad_()

    def loss(hidden: Tensor, teacher_hidden: Tensor) -> Tensor:
        teacher = orda_tp.SeparateTeacher(teacher_hidden, t["teacher_weight"])
        return orda_tp.distillation_loss(hidden, t["weight"], t["labels"], teacher, kl_weight=1.0).loss

    torch.compile(loss, fullgraph=True, backend="aot_eager")(hidden, teacher_hidden).backward()
    assert hidden.grad is not None and teacher_hidden.grad is None


def _step_breaks(loss_call: Callable[[Tensor, Tensor, Tensor], Tensor], t: dict[str, Tensor]) -> tuple[int, Tensor]:
    """Graph breaks of one compiled step, head and loss: the head's input through a layer, then the loss."""

    def step(x: Tensor, weight: Tensor) -> Tensor:
        return loss_call(torch.tanh(_LAYER(x)), weight, t["labels"])

    counters.clear()
    value = torch.compile(step, backend="aot_eager")(t["hidden"], t["weight"].clone().requires_grad_())
    value.backward()
    return sum(counters["graph_break"].values()), value


def test_compiled_step_has_no_graph_break_where_a_top_k_cache_has_one() -> None:
    t = _tensors()
    tied = orda_tp.TiedTeacher(t["teacher_hidden"])
    values, indices = (t["teacher_hidden"] @ t["weight"].T).log_softmax(-1).topk(4)
    cache = orda_tp.PrecomputedTeacher(topk_ids=indices, topk_logprobs=values)

    def with_teacher(teacher: orda_tp.TiedTeacher | orda_tp.PrecomputedTeacher) -> Callable[..., Tensor]:
        def loss_call(hidden: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
            return orda_tp.distillation_loss(hidden, weight, labels, teacher, kl_weight=1.0).loss

        return loss_call

    breaks, _ = _step_breaks(with_teacher(tied), t)
    assert breaks == 0
    # Not one operator: eagerly, behind a graph break (dynamo counts it again where it first compiles the door's frame).
    breaks, value = _step_breaks(with_teacher(cache), t)
    eager = with_teacher(cache)(torch.tanh(_LAYER(t["hidden"])), t["weight"], t["labels"])
    assert breaks >= 1
    torch.testing.assert_close(value, eager, rtol=0, atol=1e-12)


def test_a_cache_runs_eagerly_and_its_in_place_change_raises_under_compile() -> None:
    """A ``PrecomputedTeacher`` is not one operator: it runs eagerly behind a graph break, with the
    eager value, so that its check of an in-place change after it was built still runs."""
    t = _tensors()
    logits = (t["teacher_hidden"] @ t["teacher_weight"].T).clone()
    cache = orda_tp.PrecomputedTeacher(logits=logits)

    def loss_call(hidden: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
        return orda_tp.distillation_loss(hidden, weight, labels, cache, kl_weight=1.0).loss

    breaks, value = _step_breaks(loss_call, t)
    eager = loss_call(torch.tanh(_LAYER(t["hidden"])), t["weight"], t["labels"])
    assert breaks >= 1
    torch.testing.assert_close(value, eager, rtol=0, atol=1e-12)
    logits.mul_(2.0)  # the cache's tensor changed after the teacher was built
    with pytest.raises(ValueError, match="modified in place"):
        torch.compile(loss_call, backend="aot_eager")(t["hidden"], t["weight"], t["labels"])


def test_bad_keyword_raises_under_compile() -> None:
    t = _tensors()

    def loss(hidden: Tensor) -> Tensor:
        teacher = orda_tp.TiedTeacher(t["teacher_hidden"])
        return orda_tp.distillation_loss(hidden, t["weight"], t["labels"], teacher, reduction="average").loss

    with pytest.raises(ValueError, match="reduction must be one of"):
        torch.compile(loss, backend="aot_eager")(t["hidden"])


def test_tensor_parallel_call_runs_eagerly_under_compile() -> None:
    """A call with a ``tp_group`` (one gloo rank here) is not one operator: it runs eagerly behind a
    graph break, with the eager call's loss and gradients."""
    if dist.is_initialized():
        pytest.skip("a process group of another test is initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = _tensors()
        loss = _loss("tied", "mean", t, tp_group=dist.group.WORLD)
        eager = _run(loss, t)
        counters.clear()
        compiled = _run(torch.compile(loss, backend="aot_eager"), t)
        assert sum(counters["graph_break"].values()) >= 1
        for got, want in zip(compiled, eager):
            _assert_same(got, want)
    finally:
        dist.destroy_process_group()
