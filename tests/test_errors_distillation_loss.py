"""The errors of ``distillation_loss`` and ``DistillationLoss`` (docs/reference.md §8): the loss
keywords (the weights, temperatures, ``gradient_materialization_scale``, ``reduction``,
``ignore_index``, ``grad_scaler``, a misspelled one, also ``DistillationHead``'s) and the call's
tensors (``student_hidden``, ``weight``, ``labels`` and their values, ``num_valid_tokens``); the
baseline problem every error test changes is valid for each teacher kind. How the cases are
checked: tests/support/error_cases.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

from orda_tp import DistillationHead, DistillationLoss, PrecomputedTeacher, TiedTeacher, distillation_loss

from .support.error_cases import (
    APIS,
    BAD_ROW,
    HIDDEN,
    VOCAB,
    Inputs,
    assert_call_raises,
    assert_keywords_pass,
    assert_keywords_raise,
    contains,
    make_inputs,
    run,
)

# --------------------------------------------------------------------------------------------------
# The baseline is valid, so that each case below fails for the reason it names.


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("mode", ["tied", "separate", "precomputed_logits", "precomputed_hidden"])
def test_baseline_inputs_are_valid(api: str, mode: str) -> None:
    t = make_inputs()
    teacher = {
        "tied": TiedTeacher(t.teacher_hidden),
        "separate": t.separate(),
        "precomputed_logits": PrecomputedTeacher(logits=t.logits),
        "precomputed_hidden": t.precomputed_hidden(),
    }[mode]
    out = run(api, t.arguments(teacher=teacher, kl_weight=0.5, teacher_ce_weight=0.3))
    assert all(torch.isfinite(value) for value in out)
    out.loss.backward()
    assert t.student_hidden.grad is not None and torch.isfinite(t.student_hidden.grad).all()


# --------------------------------------------------------------------------------------------------
# Keyword arguments: checked by distillation_loss and at DistillationLoss(...) construction.

NON_REALS = [True, False, "1", None, torch.tensor(1.0), [1.0]]


def _keyword_cases() -> list[Any]:
    cases: list[Any] = []

    def add(case_id: str, keywords: dict[str, Any], error: type[Exception], pattern: str) -> None:
        cases.append(pytest.param(keywords, error, pattern, id=case_id))

    # Loss weights: finite reals >= 0 (None only for teacher_ce_weight, which then defaults by teacher).
    for name in ("student_ce_weight", "teacher_ce_weight", "kl_weight"):
        for value in [-1.0, -1, -1e-30, math.nan, math.inf, -math.inf, *NON_REALS]:
            if value is None and name == "teacher_ce_weight":
                continue
            add(
                f"{name}={value!r}",
                {name: value},
                ValueError,
                contains(f"{name} must be a finite real number >= 0", f"got {value!r}"),
            )
    # Temperatures and the materialization scale: finite reals > 0.
    for name in ("kl_temperature", "kl_teacher_temperature", "gradient_materialization_scale"):
        for value in [0, 0.0, -1.0, math.nan, math.inf, -math.inf, *NON_REALS]:
            if value is None and name != "kl_temperature":
                continue
            if isinstance(value, Tensor) and name == "gradient_materialization_scale":
                continue  # orda-kernel's form of the scale: allowed (below)
            add(
                f"{name}={value!r}",
                {name: value},
                ValueError,
                contains(f"{name} must be a finite real number > 0", f"got {value!r}"),
            )
    # The materialization scale as a tensor: one floating-point element, no grad (its value is never read).
    for value, received in [
        (torch.ones(2), "shape (2,), dtype torch.float32, requires_grad=False"),
        (torch.tensor(2), "shape (), dtype torch.int64, requires_grad=False"),
        (torch.tensor(2.0, requires_grad=True), "shape (), dtype torch.float32, requires_grad=True"),
    ]:
        add(
            f"gradient_materialization_scale={received}",
            {"gradient_materialization_scale": value},
            ValueError,
            contains(
                "gradient_materialization_scale must be a finite real number > 0 or a one-element floating-point "
                "tensor that does not require grad",
                f"got a tensor of {received}",
            ),
        )
    for value in ["avg", "MEAN", "", None, "batchmean"]:
        add(
            f"reduction={value!r}",
            {"reduction": value},
            ValueError,
            contains("reduction must be one of ['mean', 'sum', 'none']", f"got {value!r}"),
        )
    for value in [-100.0, True, "x", None]:
        add(
            f"ignore_index={value!r}",
            {"ignore_index": value},
            TypeError,
            contains("ignore_index must be an int", f"got {value!r}"),
        )
    for value in [2**63, -(2**63) - 1]:
        add(
            f"ignore_index={value}",
            {"ignore_index": value},
            ValueError,
            contains("ignore_index must fit in torch.long (int64)", f"got {value}"),
        )
    for value, received in [
        (object(), "object"),
        (1.0, "float"),
        ("scaler", "str"),
        (torch.amp.GradScaler, "the class GradScaler"),
    ]:
        add(
            f"grad_scaler={received}",
            {"grad_scaler": value},
            TypeError,
            contains("grad_scaler must be a torch.amp.GradScaler instance or None", f"got {received}"),
        )
    # student_entropy: a real bool (a truthy string such as "no" must not read as True).
    for value in ["yes", "no", 1, 0, 1.0, None, torch.tensor(True)]:
        add(
            f"student_entropy={value!r}",
            {"student_entropy": value},
            TypeError,
            contains("student_entropy must be a bool", f"got {value!r}"),
        )
    return cases


@pytest.mark.usefixtures("no_compute")
@pytest.mark.parametrize(("keywords", "error", "pattern"), _keyword_cases())
def test_bad_keywords_raise_in_both_apis(keywords: dict[str, Any], error: type[Exception], pattern: str) -> None:
    assert_keywords_raise(keywords, error, pattern)


def _good_keywords() -> list[Any]:
    return [
        pytest.param({"student_ce_weight": 0, "teacher_ce_weight": 0.0}, id="zero-weights"),
        pytest.param({"kl_temperature": 1e-3, "kl_teacher_temperature": 50}, id="temperatures"),
        pytest.param({"kl_weight": np.float64(0.5), "kl_temperature": np.float32(2.0)}, id="numpy-scalars"),
        pytest.param({"gradient_materialization_scale": 2.0**16}, id="materialization-scale"),
        pytest.param({"grad_scaler": torch.amp.GradScaler("cpu")}, id="grad-scaler"),
        pytest.param({"ignore_index": -1}, id="ignore_index=-1"),
        pytest.param({"student_entropy": True}, id="student_entropy"),
        pytest.param({"student_entropy": True, "kl_weight": 0.0, "student_ce_weight": 0.0}, id="student_entropy-alone"),
        pytest.param({"ignore_index": np.int64(-1)}, id="ignore_index=numpy-int64"),
        pytest.param({"gradient_materialization_scale": torch.tensor(2.0**16)}, id="materialization-scale-tensor"),
        pytest.param({"gradient_materialization_scale": torch.ones(1, 1)}, id="materialization-scale-1x1"),
    ]


@pytest.mark.parametrize("keywords", _good_keywords())
def test_allowed_keywords_and_boundaries_pass(keywords: dict[str, Any]) -> None:
    assert_keywords_pass(keywords)


# A misspelled keyword names what was called (not LossOptions.__init__, which the modules build) and the
# keyword meant; the function's is Python's own.
UNEXPECTED = "got an unexpected keyword argument"
UNKNOWN_KEYWORDS = [
    pytest.param(
        lambda: DistillationLoss(reductoin="sum"),
        f"DistillationLoss() {UNEXPECTED} 'reductoin'; did you mean 'reduction'?",
        id="loss",
    ),
    pytest.param(
        lambda: DistillationHead(4, 11, temprature=2.0),
        f"DistillationHead() {UNEXPECTED} 'temprature'; did you mean 'kl_temperature'?",
        id="head",
    ),
    pytest.param(
        lambda: DistillationHead.from_linear(torch.nn.Linear(4, 11, bias=False), kl_wieght=1.0),
        f"DistillationHead() {UNEXPECTED} 'kl_wieght'; did you mean 'kl_weight'?",
        id="head.from_linear",
    ),
    pytest.param(lambda: DistillationLoss(tp_size=2), f"DistillationLoss() {UNEXPECTED} 'tp_size'", id="no-close-one"),
]


@pytest.mark.parametrize(("build", "message"), UNKNOWN_KEYWORDS)
def test_a_misspelled_keyword_names_the_class_called(build: Callable[[], object], message: str) -> None:
    with pytest.raises(TypeError) as raised:
        build()
    assert str(raised.value) == message


def test_a_misspelled_keyword_of_the_function_is_pythons_error() -> None:
    t = make_inputs()
    with pytest.raises(TypeError, match=r"^distillation_loss\(\) got an unexpected keyword argument 'temprature'$"):
        distillation_loss(**t.arguments(teacher=TiedTeacher(t.teacher_hidden)), temprature=2.0)


# --------------------------------------------------------------------------------------------------
# The call's tensors: shapes, dtypes, devices, label values, the denominator of "mean".


def _call_cases() -> list[Any]:
    cases: list[Any] = []

    def add(case_id: str, change: Callable[[Inputs], dict[str, Any]], error: type[Exception], pattern: str) -> None:
        cases.append(pytest.param(change, error, pattern, id=case_id))

    f64 = torch.float64
    # Shapes.
    add(
        "student_hidden-1d",
        lambda t: {"student_hidden": t.student_hidden[0]},
        ValueError,
        contains("student_hidden must be 2-D", "got shape (4,)"),
    )
    add(
        "student_hidden-3d",
        lambda t: {"student_hidden": t.student_hidden[None]},
        ValueError,
        contains("student_hidden must be 2-D", "got shape (1, 6, 4)"),
    )
    add("weight-1d", lambda t: {"weight": t.weight[0]}, ValueError, contains("weight must be 2-D", "got shape (4,)"))
    add(
        "weight-hidden-size",
        lambda t: {"weight": torch.zeros(VOCAB, HIDDEN + 1, dtype=f64)},
        ValueError,
        contains("weight must have shape (11, 4)", "got (11, 5)"),
    )
    add(
        "labels-short",
        lambda t: {"labels": t.labels[:-1]},
        ValueError,
        contains("labels must have shape (6,)", "got (5,)"),
    )
    add(
        "labels-long",
        lambda t: {"labels": torch.cat([t.labels, t.labels[:1]])},
        ValueError,
        contains("labels must have shape (6,)", "got (7,)"),
    )
    add(
        "labels-2d",
        lambda t: {"labels": t.labels[:, None]},
        ValueError,
        contains("labels must have shape (6,)", "got (6, 1)"),
    )
    add("labels-0d", lambda t: {"labels": t.labels[0]}, ValueError, contains("labels must have shape (6,)", "got ()"))
    # Dtypes: labels must be torch.long (never cast), hidden states and heads floating point.
    for dtype in (torch.int32, torch.int16, torch.uint8, torch.float32, torch.float64, torch.bool):
        add(
            f"labels-{dtype}",
            lambda t, dtype=dtype: {"labels": t.labels.clamp_min(0).to(dtype)},
            TypeError,
            contains("labels must have dtype torch.long (int64)", f"got {dtype}"),
        )
    for dtype in (torch.int64, torch.int32, torch.bool, torch.complex64):
        add(
            f"student_hidden-{dtype}",
            lambda t, dtype=dtype: {"student_hidden": t.student_hidden.detach().to(dtype)},
            TypeError,
            contains("student_hidden must be a floating-point tensor", f"got {dtype}"),
        )
    add(
        "weight-int",
        lambda t: {"weight": t.weight.detach().to(torch.long)},
        TypeError,
        contains("weight must be a floating-point tensor", "got torch.int64"),
    )
    add(
        "student_hidden-list",
        lambda t: {"student_hidden": t.student_hidden.tolist()},
        TypeError,
        contains("student_hidden must be a torch.Tensor", "got list"),
    )
    add(
        "student_hidden-numpy",
        lambda t: {"student_hidden": t.student_hidden.detach().numpy()},
        TypeError,
        contains("student_hidden must be a torch.Tensor", "got ndarray"),
    )
    add("weight-none", lambda t: {"weight": None}, TypeError, contains("weight must be a torch.Tensor", "got NoneType"))
    add(
        "labels-list",
        lambda t: {"labels": t.labels.tolist()},
        TypeError,
        contains("labels must be a torch.Tensor", "got list"),
    )
    add(
        "labels-numpy",
        lambda t: {"labels": t.labels.numpy()},
        TypeError,
        contains("labels must be a torch.Tensor", "got ndarray"),
    )
    # Devices: "meta" stands in for a second device on this CPU-only machine.
    meta = torch.device("meta")
    add(
        "student_hidden-device",
        lambda t: {"student_hidden": t.student_hidden.to(meta)},
        ValueError,
        contains("weight must be on student_hidden's device meta", "got cpu"),
    )
    add(
        "weight-device",
        lambda t: {"weight": t.weight.to(meta)},
        ValueError,
        contains("weight must be on student_hidden's device cpu", "got meta"),
    )
    add(
        "labels-device",
        lambda t: {"labels": t.labels.to(meta)},
        ValueError,
        contains("labels must be on student_hidden's device cpu", "got meta"),
    )
    # Label values outside [0, V) ∪ {ignore_index}: an error, never another class.
    label_range = "labels must lie in [0, 11) or equal ignore_index=-100"
    for value in [VOCAB, VOCAB + 1, -1, -99, -101, 10**6, -(10**6), 2**62, -(2**62)]:
        add(
            f"label={value}",
            lambda t, value=value: {"labels": t.bad_labels(value)},
            ValueError,
            contains(label_range, f"labels[{BAD_ROW}] = {value} (1 such rows)"),
        )
    add(
        "labels-two-bad",
        lambda t: {"labels": t.bad_labels(VOCAB, -5)},
        ValueError,
        contains(label_range, f"labels[{BAD_ROW}] = 11 (2 such rows)"),
    )
    add(
        "label=-100-with-ignore_index=-1",
        lambda t: {"labels": t.labels, "ignore_index": -1},
        ValueError,
        contains("labels must lie in [0, 11) or equal ignore_index=-1", "labels[4] = -100"),
    )
    add(
        "label-separate",
        lambda t: {"labels": t.bad_labels(VOCAB), "teacher": t.separate(), "kl_weight": 1.0},
        ValueError,
        contains(label_range, "= 11"),
    )
    add(
        "label-precomputed",
        lambda t: {
            "labels": t.bad_labels(-1),
            "teacher": PrecomputedTeacher(logits=t.logits),
            "kl_weight": 1.0,
            "kl_divergence": "dkd",
        },
        ValueError,
        contains(label_range, "= -1"),
    )
    add(
        "label-empty-vocab",
        lambda t: {"weight": t.weight[:0], "teacher": TiedTeacher(t.teacher_hidden)},
        ValueError,
        contains("labels must lie in [0, 0)", "labels[0] = 3"),
    )
    # num_valid_tokens: the denominator of "mean", a finite number > 0 or a real scalar tensor.
    for value in [0, 0.0, -1, -0.5, math.nan, math.inf]:
        add(
            f"num_valid_tokens={value!r}",
            lambda t, value=value: {"num_valid_tokens": value},
            ValueError,
            contains("num_valid_tokens must be finite and > 0", f"got {value!r}"),
        )
    for value, received in [(True, "bool"), (False, "bool"), ("3", "str"), ([3], "list")]:
        add(
            f"num_valid_tokens={value!r}",
            lambda t, value=value: {"num_valid_tokens": value},
            TypeError,
            contains("num_valid_tokens must be a number, a one-element tensor or None", f"got {received}"),
        )
    for value, received in [
        (torch.tensor([3.0, 4.0]), "shape (2,)"),
        (torch.tensor(True), "dtype torch.bool"),
        (torch.tensor(3 + 0j), "dtype torch.complex"),
    ]:
        add(
            f"num_valid_tokens-{received}",
            lambda t, value=value: {"num_valid_tokens": value},
            ValueError,
            contains("num_valid_tokens must be a real one-element tensor", received),
        )
    for reduction in ("sum", "none"):
        add(
            f"num_valid_tokens-with-{reduction}",
            lambda t, reduction=reduction: {"num_valid_tokens": 3, "reduction": reduction},
            ValueError,
            contains("num_valid_tokens is the denominator of reduction='mean'", f"got reduction={reduction!r}"),
        )
    return cases


@pytest.mark.parametrize(("change", "error", "pattern"), _call_cases())
def test_bad_call_inputs_raise_the_same_error_in_both_apis_before_any_computation(
    no_compute: list[str], change: Callable[[Inputs], dict[str, Any]], error: type[Exception], pattern: str
) -> None:
    assert_call_raises(no_compute, change, error, pattern)


def test_wrong_label_dtype_leaves_no_partial_result(no_compute: list[str]) -> None:
    t = make_inputs()
    criterion = DistillationLoss(kl_weight=1.0, kl_divergence="mutual")
    for labels in (t.labels.to(torch.int32), t.labels.to(torch.float32)):
        with pytest.raises(TypeError, match=contains("labels must have dtype torch.long", str(labels.dtype))):
            criterion(t.student_hidden, t.weight, labels, TiedTeacher(t.teacher_hidden))
    assert no_compute == []
    assert t.student_hidden.grad is None and t.weight.grad is None


@pytest.mark.parametrize("api", APIS)
def test_allowed_routing_modes_and_denominators(api: str) -> None:
    t = make_inputs()
    for mode, keywords in [
        ("trained", {}),
        ("frozen", {"teacher_ce_weight": 0.0}),
        ("cotrained", {"kl_weight": 1.0, "kl_divergence": "mutual"}),
    ]:
        out = run(api, t.arguments(teacher=TiedTeacher(t.teacher_hidden, mode=mode), **keywords))
        assert torch.isfinite(out.loss)
    summed = run(api, t.arguments(reduction="sum")).loss
    for denominator in (
        3,
        2.5,
        np.float64(2.5),
        torch.tensor(4.0, dtype=torch.float64),
        torch.tensor(4),
        torch.tensor([7.0]),
    ):
        loss = run(api, t.arguments(num_valid_tokens=denominator)).loss
        torch.testing.assert_close(loss, summed / float(denominator), rtol=1e-12, atol=0)
