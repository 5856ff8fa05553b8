"""docs/reference.md §8: every bad input raises a ValueError/TypeError whose message names the argument, what
was expected and what was received, before anything is computed; nothing is silently clamped or
reinterpreted (an invalid label is never read as class 0).

Each case asserts the exception type and a regex on the message. Call-time cases run through both
the functional and the module API and must give the same message; keyword cases must also fail at
``DistillationLoss(...)`` construction. Boundary values that the reference allows are checked to pass.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

import orda_tp
import orda_tp.loss as api_module
from orda_tp import (
    ChunkSize,
    DistillationLoss,
    DistillationLossOutput,
    EntropyGate,
    KernelConfig,
    PrecomputedTeacher,
    SeparateTeacher,
    TiedTeacher,
    distillation_loss,
)

ROWS, HIDDEN, VOCAB, DEPTH = 6, 4, 11, 5
BAD_ROW = 2
APIS = ("functional", "module")


def contains(*parts: str) -> str:
    """A regex for a message holding the literal ``parts`` in this order."""
    return "(?s)" + ".*".join(re.escape(part) for part in parts)


@dataclass
class Inputs:
    """A small valid problem; every case changes one thing in it."""

    student_hidden: Tensor
    weight: Tensor
    labels: Tensor
    teacher_hidden: Tensor  # (ROWS, HIDDEN), for a TiedTeacher
    separate_hidden: Tensor  # (ROWS, DEPTH)
    separate_weight: Tensor  # (VOCAB, DEPTH)
    logits: Tensor  # (ROWS, VOCAB)

    def arguments(self, **changes: Any) -> dict[str, Any]:
        """The arguments of a valid tied-teacher call, with ``changes`` applied."""
        arguments: dict[str, Any] = {
            "student_hidden": self.student_hidden,
            "weight": self.weight,
            "labels": self.labels,
            "teacher": TiedTeacher(self.teacher_hidden),
        }
        arguments.update(changes)
        return arguments

    def bad_labels(self, *values: int) -> Tensor:
        labels = self.labels.clone()
        for offset, value in enumerate(values):
            labels[BAD_ROW + offset] = value
        return labels

    def separate(self) -> SeparateTeacher:
        return SeparateTeacher(self.separate_hidden, self.separate_weight)

    def precomputed_hidden(self) -> PrecomputedTeacher:
        return PrecomputedTeacher(teacher_hidden=self.separate_hidden, teacher_weight=self.separate_weight)


def make_inputs() -> Inputs:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    return Inputs(
        student_hidden=randn(ROWS, HIDDEN).requires_grad_(),
        weight=randn(VOCAB, HIDDEN).requires_grad_(),
        labels=torch.tensor([3, 0, 7, VOCAB - 1, -100, 5]),  # both ends of [0, V) and an ignored row
        teacher_hidden=randn(ROWS, HIDDEN),
        separate_hidden=randn(ROWS, DEPTH),
        separate_weight=randn(VOCAB, DEPTH),
        logits=randn(ROWS, VOCAB),
    )


def run(api: str, arguments: dict[str, Any]) -> DistillationLossOutput:
    """One call through the functional API or the module API."""
    arguments = dict(arguments)
    tensors = [arguments.pop(name) for name in ("student_hidden", "weight", "labels", "teacher")]
    num_valid_tokens = arguments.pop("num_valid_tokens", None)
    if api == "functional":
        return distillation_loss(*tensors, num_valid_tokens=num_valid_tokens, **arguments)
    return DistillationLoss(**arguments)(*tensors, num_valid_tokens=num_valid_tokens)


@pytest.fixture
def no_compute(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Makes any backend computation fail the test: errors must come first. Returns the calls."""
    calls: list[str] = []

    def refuse(name: str) -> Callable[..., object]:
        def backend(*args: object, **kwargs: object) -> object:
            calls.append(name)
            raise AssertionError(f"the {name} backend ran before the bad input was rejected")

        return backend

    monkeypatch.setattr(api_module, "chunked_loss", refuse("chunked"))
    monkeypatch.setattr(api_module, "reference_loss", refuse("reference"))
    return calls


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
    # Names that must be one of a fixed set.
    for value in ["kl", "Forward", "forward_kl", "", None, 1]:
        add(
            f"kl_divergence={value!r}",
            {"kl_divergence": value},
            ValueError,
            contains("kl_divergence must be one of [", "'forward'", "'triangular'", f"got {value!r}"),
        )
    for value in ["avg", "MEAN", "", None, "batchmean"]:
        add(
            f"reduction={value!r}",
            {"reduction": value},
            ValueError,
            contains("reduction must be one of ['mean', 'sum', 'none']", f"got {value!r}"),
        )
    for value in ["cuda", "Torch", "fused", None]:
        add(
            f"backend={value!r}",
            {"backend": value},
            ValueError,
            contains("backend must be one of ['auto', 'triton', 'torch', 'reference']", f"got {value!r}"),
        )
    for value in ["slow", "Balanced", None, 1]:
        add(
            f"profile={value!r}",
            {"profile": value},
            ValueError,
            contains("profile must be one of ['balanced', 'debug', 'fast']", f"got {value!r}"),
        )
    add(
        "profile-checked-with-config",
        {"profile": "slow", "config": KernelConfig()},
        ValueError,
        contains("profile must be one of", "got 'slow'"),
    )
    for value, received in [
        ({"workspace_mib": 4}, "dict"),
        ("debug", "str"),
        (KernelConfig, "type"),
        (ChunkSize(), "ChunkSize"),
    ]:
        add(
            f"config={received}",
            {"config": value},
            TypeError,
            contains("config must be a KernelConfig or None", f"got {received}"),
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
    # Co-training variants need T_t == T_s.
    for variant in ("mutual", "cojeffreys"):
        add(
            f"{variant}-teacher-temperature",
            {"kl_divergence": variant, "kl_weight": 1.0, "kl_temperature": 2.0, "kl_teacher_temperature": 1.0},
            ValueError,
            contains(f"kl_divergence={variant!r} needs kl_teacher_temperature == kl_temperature (2.0)", "got 1.0"),
        )
    return cases


# The parameter table of docs/variants.md §4: which keywords each variant reads, and their allowed ranges.
SPEC_PARAMETERS: dict[str, tuple[str, ...]] = {
    "forward": (),
    "reverse": (),
    "jeffreys": (),
    "mutual": (),
    "cojeffreys": (),
    "alpha_divergence": ("kl_alpha",),
    "skew_forward": ("kl_beta",),
    "skew_reverse": ("kl_beta",),
    "skew_js": ("kl_beta",),
    "entropy_adaptive": ("entropy_gate",),
    "renyi": ("kl_alpha",),
    "renyi_reverse": ("kl_alpha",),
    "dkd": ("kl_alpha", "kl_beta"),
    "abkd": ("kl_alpha", "kl_beta"),
    "triangular": (),
}
# (variant, keyword, interval as printed, values outside it, boundary/inner values allowed)
SPEC_RANGES: list[tuple[str, str, str, list[float], list[float]]] = [
    ("alpha_divergence", "kl_alpha", "(0.0, 1.0)", [0, 0.0, 1, 1.0, -0.5, 1.5], [1e-6, 0.5, 1 - 1e-6]),
    *[
        (v, "kl_beta", "(0.0, 1.0)", [0, 0.0, 1, 1.0, -0.1, 1.1], [1e-6, 0.5, 1 - 1e-6])
        for v in ("skew_forward", "skew_reverse", "skew_js")
    ],
    *[
        (v, "kl_alpha", "(0.0, 2.0]", [0, 0.0, -1.0, 2.0001, 3], [2, 2.0, 1e-4, 0.99, 1.01, 1.5])
        for v in ("renyi", "renyi_reverse")
    ],
    *[("dkd", k, "(0.0, 16.0]", [0, 0.0, -1.0, 16.001, 32], [16, 16.0, 1e-3, 1]) for k in ("kl_alpha", "kl_beta")],
    *[("abkd", k, "[0.05, 2.0]", [0, 0.0, 0.049, 2.001, 4], [0.05, 2, 2.0, 1]) for k in ("kl_alpha", "kl_beta")],
]


def _variant_cases() -> list[Any]:
    cases: list[Any] = []
    for variant, keyword, interval, outside, _ in SPEC_RANGES:
        for value in outside:
            cases.append(
                pytest.param(
                    {"kl_divergence": variant, keyword: value},
                    ValueError,
                    contains(f"{keyword} must lie in {interval} for kl_divergence={variant!r}", f"got {value!r}"),
                    id=f"{variant}-{keyword}={value!r}",
                )
            )
        for value in [math.nan, math.inf, -math.inf, True, "0.5", torch.tensor(0.5)]:
            cases.append(
                pytest.param(
                    {"kl_divergence": variant, keyword: value},
                    ValueError,
                    contains(f"{keyword} must be a finite real number for kl_divergence={variant!r}", f"got {value!r}"),
                    id=f"{variant}-{keyword}={value!r}",
                )
            )
    for variant in ("renyi", "renyi_reverse"):
        for value in [1, 1.0, 0.995, 1.005, 0.991, 1.0099]:
            cases.append(
                pytest.param(
                    {"kl_divergence": variant, "kl_alpha": value},
                    ValueError,
                    contains("kl_alpha (the Rényi order r) must satisfy |r − 1| >= 0.01", variant, f"got {value!r}"),
                    id=f"{variant}-near-1-{value!r}",
                )
            )
    for value, received in [({"tau": 0.3}, "dict"), (0.5, "float"), ((0.0, 1.0, 0.5, 0.1), "tuple")]:
        cases.append(
            pytest.param(
                {"kl_divergence": "entropy_adaptive", "entropy_gate": value},
                TypeError,
                contains("entropy_gate must be an EntropyGate or None", f"got {received}"),
                id=f"entropy_gate={received}",
            )
        )
    # A parameter given to a variant that does not read it is accepted with a warning, as
    # orda-kernel accepts it: tests/test_compat.py.
    return cases


def test_the_variants_are_the_spec_table() -> None:
    assert tuple(orda_tp.KL_VARIANTS) == tuple(SPEC_PARAMETERS)


@pytest.mark.usefixtures("no_compute")
@pytest.mark.parametrize(("keywords", "error", "pattern"), _keyword_cases() + _variant_cases())
def test_bad_keywords_raise_in_both_apis(keywords: dict[str, Any], error: type[Exception], pattern: str) -> None:
    t = make_inputs()
    with pytest.raises(error, match=pattern) as functional:
        distillation_loss(t.student_hidden, t.weight, t.labels, TiedTeacher(t.teacher_hidden), **keywords)
    # The module checks its keywords when it is built, with the same error.
    with pytest.raises(error, match=pattern) as module:
        DistillationLoss(**keywords)
    assert str(module.value) == str(functional.value)
    assert functional.type is error and module.type is error  # not a subclass such as an OverflowError


def _good_variant_keywords() -> list[Any]:
    cases: list[Any] = []
    for variant, keyword, _, _, inside in SPEC_RANGES:
        for value in [*inside, None]:
            cases.append(pytest.param({"kl_divergence": variant, keyword: value}, id=f"{variant}-{keyword}={value!r}"))
    for gate in [None, EntropyGate(), EntropyGate(alpha_min=0.3, alpha_max=0.3), EntropyGate(alpha_min=0, alpha_max=1)]:
        cases.append(pytest.param({"kl_divergence": "entropy_adaptive", "entropy_gate": gate}, id=f"gate={gate!r}"))
    for variant in ("mutual", "cojeffreys"):
        same = {"kl_divergence": variant, "kl_temperature": 2.0, "kl_teacher_temperature": 2.0}
        cases.append(pytest.param(same, id=f"{variant}-equal-temperatures"))
    cases += [
        pytest.param({"student_ce_weight": 0, "teacher_ce_weight": 0.0}, id="zero-weights"),
        pytest.param({"kl_temperature": 1e-3, "kl_teacher_temperature": 50}, id="temperatures"),
        pytest.param({"kl_weight": np.float64(0.5), "kl_temperature": np.float32(2.0)}, id="numpy-scalars"),
        pytest.param({"gradient_materialization_scale": 2.0**16}, id="materialization-scale"),
        pytest.param({"grad_scaler": torch.amp.GradScaler("cpu")}, id="grad-scaler"),
        pytest.param({"ignore_index": -1}, id="ignore_index=-1"),
        pytest.param({"ignore_index": np.int64(-1)}, id="ignore_index=numpy-int64"),
        pytest.param({"gradient_materialization_scale": torch.tensor(2.0**16)}, id="materialization-scale-tensor"),
        pytest.param({"gradient_materialization_scale": torch.ones(1, 1)}, id="materialization-scale-1x1"),
        pytest.param({"profile": "debug", "config": KernelConfig()}, id="profile-and-config"),
    ]
    return cases


@pytest.mark.parametrize("keywords", _good_variant_keywords())
def test_allowed_keywords_and_boundaries_pass(keywords: dict[str, Any]) -> None:
    t = make_inputs()
    DistillationLoss(**keywords)
    keywords = {"kl_weight": 0.7, **keywords}
    out = distillation_loss(
        t.student_hidden, t.weight, t.labels.clamp_min(0), TiedTeacher(t.teacher_hidden), **keywords
    )
    assert torch.isfinite(out.loss)


# --------------------------------------------------------------------------------------------------
# Descriptors and configs: checked when they are built.


def _construction_cases() -> list[Any]:
    cases: list[Any] = []

    def add(case_id: str, build: Callable[[Inputs], object], error: type[Exception], pattern: str) -> None:
        cases.append(pytest.param(build, error, pattern, id=case_id))

    long = torch.long
    add(
        "tied-list",
        lambda t: TiedTeacher(t.teacher_hidden.tolist()),
        TypeError,
        contains("TiedTeacher.hidden must be a torch.Tensor", "got list"),
    )
    add(
        "tied-int",
        lambda t: TiedTeacher(t.teacher_hidden.to(long)),
        TypeError,
        contains("TiedTeacher.hidden must be a floating-point tensor", "got dtype torch.int64"),
    )
    add(
        "tied-1d",
        lambda t: TiedTeacher(t.teacher_hidden[0]),
        ValueError,
        contains("TiedTeacher.hidden must be 2-D", "got shape (4,)"),
    )
    add(
        "tied-3d",
        lambda t: TiedTeacher(t.teacher_hidden[None]),
        ValueError,
        contains("TiedTeacher.hidden must be 2-D", "got shape (1, 6, 4)"),
    )
    for mode in ["train", "Frozen", "", 1]:
        add(
            f"tied-mode={mode!r}",
            lambda t, mode=mode: TiedTeacher(t.teacher_hidden, mode=mode),
            ValueError,
            contains("TiedTeacher.mode must be one of ('trained', 'frozen', 'cotrained') or None", f"got {mode!r}"),
        )
    add(
        "separate-none",
        lambda t: SeparateTeacher(None, t.separate_weight),
        TypeError,
        contains("SeparateTeacher.hidden must be a torch.Tensor", "got NoneType"),
    )
    add(
        "separate-int-weight",
        lambda t: SeparateTeacher(t.separate_hidden, t.separate_weight.to(long)),
        TypeError,
        contains("SeparateTeacher.weight must be a floating-point tensor", "got dtype torch.int64"),
    )
    add(
        "separate-1d-weight",
        lambda t: SeparateTeacher(t.separate_hidden, t.separate_weight[0]),
        ValueError,
        contains("SeparateTeacher.weight must be 2-D", "got shape (5,)"),
    )
    add(
        "separate-depth",
        lambda t: SeparateTeacher(t.separate_hidden, torch.zeros(VOCAB, DEPTH + 1, dtype=torch.float64)),
        ValueError,
        contains(
            "SeparateTeacher.hidden and SeparateTeacher.weight must share their last dimension",
            "hidden (6, 5) and weight (11, 6)",
        ),
    )
    add(
        "precomputed-neither",
        lambda t: PrecomputedTeacher(),
        ValueError,
        contains("PrecomputedTeacher needs exactly one of logits=", "got none"),
    )
    add(
        "precomputed-both",
        lambda t: PrecomputedTeacher(
            logits=t.logits, teacher_hidden=t.separate_hidden, teacher_weight=t.separate_weight
        ),
        ValueError,
        contains("PrecomputedTeacher needs exactly one of logits=", "got more than one"),
    )
    add(
        "precomputed-logits-and-weight",
        lambda t: PrecomputedTeacher(logits=t.logits, teacher_weight=t.separate_weight),
        ValueError,
        contains("needs exactly one of", "got more than one"),
    )
    add(
        "precomputed-hidden-only",
        lambda t: PrecomputedTeacher(teacher_hidden=t.separate_hidden),
        ValueError,
        contains("PrecomputedTeacher needs teacher_hidden and teacher_weight together", "got only one"),
    )
    add(
        "precomputed-weight-only",
        lambda t: PrecomputedTeacher(teacher_weight=t.separate_weight),
        ValueError,
        contains("teacher_hidden and teacher_weight together", "got only one"),
    )
    add(
        "precomputed-logits-list",
        lambda t: PrecomputedTeacher(logits=t.logits.tolist()),
        TypeError,
        contains("PrecomputedTeacher.logits must be a torch.Tensor", "got list"),
    )
    add(
        "precomputed-logits-int",
        lambda t: PrecomputedTeacher(logits=t.logits.to(long)),
        TypeError,
        contains("PrecomputedTeacher.logits must be a floating-point tensor", "got dtype torch.int64"),
    )
    add(
        "precomputed-logits-1d",
        lambda t: PrecomputedTeacher(logits=t.logits[0]),
        ValueError,
        contains("PrecomputedTeacher.logits must be 2-D", "got shape (11,)"),
    )
    add(
        "precomputed-depth",
        lambda t: PrecomputedTeacher(
            teacher_hidden=t.separate_hidden, teacher_weight=torch.zeros(VOCAB, DEPTH + 1, dtype=torch.float64)
        ),
        ValueError,
        contains(
            "PrecomputedTeacher.teacher_hidden and teacher_weight must share their last dimension", "(6, 5) and (11, 6)"
        ),
    )
    for field in ("logits", "teacher_hidden", "teacher_weight"):

        def requiring_grad(t: Inputs, field: str = field) -> PrecomputedTeacher:
            tensors = (
                {"logits": t.logits}
                if field == "logits"
                else {"teacher_hidden": t.separate_hidden, "teacher_weight": t.separate_weight}
            )
            tensors[field] = tensors[field].clone().requires_grad_()
            return PrecomputedTeacher(**tensors)

        add(
            f"precomputed-{field}-requires-grad",
            requiring_grad,
            ValueError,
            contains(f"PrecomputedTeacher.{field} must not require grad", "got a tensor with requires_grad=True"),
        )
    for value in [0, 0.0, -1.0, math.nan, math.inf, True, "2", torch.tensor(2.0)]:
        add(
            f"logits_temperature={value!r}",
            lambda t, value=value: PrecomputedTeacher(logits=t.logits, logits_temperature=value),
            ValueError,
            contains("PrecomputedTeacher.logits_temperature must be a finite float > 0", f"got {value!r}"),
        )
    # EntropyGate (the parameters of entropy_adaptive).
    gate_ranges = [
        ({"alpha_min": -0.1}, "alpha_min=-0.1, alpha_max=1.0"),
        ({"alpha_max": 1.5}, "alpha_min=0.0, alpha_max=1.5"),
        ({"alpha_min": 0.8, "alpha_max": 0.2}, "alpha_min=0.8, alpha_max=0.2"),
    ]
    for fields, received in gate_ranges:
        add(
            f"gate-{received}",
            lambda t, fields=fields: EntropyGate(**fields),
            ValueError,
            contains("EntropyGate needs 0 <= alpha_min <= alpha_max <= 1", f"got {received}"),
        )
    for value in [0, 0.0, -0.5]:
        add(
            f"gate-scale={value!r}",
            lambda t, value=value: EntropyGate(scale=value),
            ValueError,
            contains("EntropyGate.scale must be > 0", f"got {value!r}"),
        )
    for name in ("alpha_min", "alpha_max", "tau", "scale"):
        for value in [math.nan, math.inf, True, "0.5", None]:
            add(
                f"gate-{name}={value!r}",
                lambda t, name=name, value=value: EntropyGate(**{name: value}),
                ValueError,
                contains(f"EntropyGate.{name} must be a finite real number", f"got {value!r}"),
            )
    # KernelConfig and ChunkSize.
    for value in [0, -3, True, 2.5, "8"]:
        add(
            f"nrows={value!r}",
            lambda t, value=value: ChunkSize(nrows=value),
            ValueError,
            contains("ChunkSize.nrows must be a positive int or None", f"got {value!r}"),
        )
    for name in ("dynamic", "fast"):
        for value in ["no", 1, None]:
            add(
                f"chunk-{name}={value!r}",
                lambda t, name=name, value=value: ChunkSize(**{name: value}),
                TypeError,
                contains(f"ChunkSize.{name} must be a bool", f"got {value!r}"),
            )
    for name in ("vocab_block", "workspace_mib"):
        for value in [0, -1, 1.5, True] + ([] if name == "workspace_mib" else [None]):  # None: no workspace cap
            add(
                f"{name}={value!r}",
                lambda t, name=name, value=value: KernelConfig(**{name: value}),
                ValueError,
                contains(f"KernelConfig.{name} must be a positive int", f"got {value!r}"),
            )
    add(
        "chunk_size=64",
        lambda t: KernelConfig(chunk_size=64),
        ValueError,
        contains("KernelConfig.chunk_size must be a ChunkSize", "got int"),
    )
    for name, values in (("assume_valid_labels", ["no", 1]), ("check_finite_inputs", ["no", 1, None])):
        for value in values:
            add(
                f"{name}={value!r}",
                lambda t, name=name, value=value: KernelConfig(**{name: value}),
                TypeError,
                contains(f"KernelConfig.{name} must be a bool", f"got {value!r}"),
            )
    return cases


@pytest.mark.parametrize(("build", "error", "pattern"), _construction_cases())
def test_bad_descriptors_and_configs_raise_when_built(
    build: Callable[[Inputs], object], error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern) as info:
        build(make_inputs())
    assert info.type is error


def test_allowed_descriptors_and_configs() -> None:
    t = make_inputs()
    TiedTeacher(t.teacher_hidden, mode=None)
    for mode in ("trained", "frozen", "cotrained"):
        TiedTeacher(t.teacher_hidden, mode=mode)
    PrecomputedTeacher(logits=t.logits, logits_temperature=1e-3)
    PrecomputedTeacher(logits=t.logits, logits_temperature=4)
    EntropyGate(alpha_min=1.0, alpha_max=1.0, tau=-2.0, scale=1e-6)
    ChunkSize(nrows=1, dynamic=False, fast=True)
    KernelConfig(
        chunk_size=ChunkSize(nrows=3),
        vocab_block=1,
        workspace_mib=1,
        assume_valid_labels=True,
        check_finite_inputs=True,
    )


# --------------------------------------------------------------------------------------------------
# Tensors and teachers of a call: shapes, dtypes, devices, label values, caches, routing.


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
    add(
        "tied-rows",
        lambda t: {"teacher": TiedTeacher(t.teacher_hidden[:-1])},
        ValueError,
        contains("teacher.hidden must have shape (6, 4)", "got (5, 4)"),
    )
    add(
        "tied-width",
        lambda t: {"teacher": TiedTeacher(torch.zeros(ROWS, HIDDEN + 1, dtype=f64))},
        ValueError,
        contains("teacher.hidden must have shape (6, 4)", "got (6, 5)"),
    )
    add(
        "separate-rows",
        lambda t: {"teacher": SeparateTeacher(t.separate_hidden[:-1], t.separate_weight)},
        ValueError,
        contains("teacher.hidden must have shape (6, 5)", "got (5, 5)"),
    )
    add(
        "separate-vocab",
        lambda t: {"teacher": SeparateTeacher(t.separate_hidden, t.separate_weight[:-1])},
        ValueError,
        contains("teacher.weight must have shape (11, 5)", "got (10, 5)"),
    )
    add(
        "logits-vocab",
        lambda t: {"teacher": PrecomputedTeacher(logits=t.logits[:, :-1])},
        ValueError,
        contains("teacher.logits must have shape (6, 11)", "got (6, 10)"),
    )
    add(
        "logits-rows",
        lambda t: {"teacher": PrecomputedTeacher(logits=t.logits[:-1])},
        ValueError,
        contains("teacher.logits must have shape (6, 11)", "got (5, 11)"),
    )
    add(
        "cache-rows",
        lambda t: {
            "teacher": PrecomputedTeacher(teacher_hidden=t.separate_hidden[:-1], teacher_weight=t.separate_weight)
        },
        ValueError,
        contains("teacher.teacher_hidden must have shape (6, 5)", "got (5, 5)"),
    )
    add(
        "cache-vocab",
        lambda t: {
            "teacher": PrecomputedTeacher(teacher_hidden=t.separate_hidden, teacher_weight=t.separate_weight[:-1])
        },
        ValueError,
        contains("teacher.teacher_weight must have shape (11, 5)", "got (10, 5)"),
    )
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
    teacher_types = "teacher must be a TiedTeacher, SeparateTeacher or PrecomputedTeacher"
    add("teacher-tensor", lambda t: {"teacher": t.teacher_hidden}, TypeError, contains(teacher_types, "got Tensor"))
    add("teacher-none", lambda t: {"teacher": None}, TypeError, contains(teacher_types, "got NoneType"))
    add(
        "teacher-tuple",
        lambda t: {"teacher": (t.separate_hidden, t.separate_weight)},
        TypeError,
        contains(teacher_types, "got tuple"),
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
    add(
        "tied-device",
        lambda t: {"teacher": TiedTeacher(t.teacher_hidden.to(meta))},
        ValueError,
        contains("teacher.hidden must be on student_hidden's device cpu", "got meta"),
    )
    add(
        "separate-device",
        lambda t: {"teacher": SeparateTeacher(t.separate_hidden, t.separate_weight.to(meta))},
        ValueError,
        contains("teacher.weight must be on student_hidden's device cpu", "got meta"),
    )
    add(
        "logits-device",
        lambda t: {"teacher": PrecomputedTeacher(logits=t.logits.to(meta))},
        ValueError,
        contains("teacher.logits must be on student_hidden's device cpu", "got meta"),
    )
    add(
        "cache-device",
        lambda t: {
            "teacher": PrecomputedTeacher(
                teacher_hidden=t.separate_hidden.to(meta), teacher_weight=t.separate_weight.to(meta)
            )
        },
        ValueError,
        contains("teacher.teacher_hidden must be on student_hidden's device cpu", "got meta"),
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
    # A precomputed cache: NaN or +inf raise when the loss reads the logits (−inf is allowed).
    for value in (math.nan, math.inf):
        for keywords in ({"kl_weight": 1.0}, {"teacher_ce_weight": 1.0}):

            def poisoned(t: Inputs, value: float = value, keywords: dict[str, Any] = keywords) -> dict[str, Any]:
                logits = t.logits.clone()
                logits[3, 5] = value
                return {"teacher": PrecomputedTeacher(logits=logits), **keywords}

            add(
                f"logits-{value}-{next(iter(keywords))}",
                poisoned,
                ValueError,
                contains("teacher.logits must be finite or -inf", f"row 3 holds {value} at index [3, 5]"),
            )
    # ... and a cache modified in place after construction raises, whether or not it is read.
    for field, change in [
        ("logits", lambda x: x.add_(1)),
        ("teacher_hidden", lambda x: x.mul_(2)),
        ("teacher_weight", lambda x: x.__setitem__((0, 0), 1.0)),
    ]:

        def modified(t: Inputs, field: str = field, change: Callable[[Tensor], object] = change) -> dict[str, Any]:
            teacher = PrecomputedTeacher(logits=t.logits) if field == "logits" else t.precomputed_hidden()
            change(getattr(teacher, field))
            return {"teacher": teacher}

        add(
            f"{field}-modified-in-place",
            modified,
            ValueError,
            contains(
                f"PrecomputedTeacher.{field} was modified in place after the PrecomputedTeacher was built",
                "(version 0 -> 1)",
            ),
        )
    # Co-training variants need a teacher that can be trained.
    for variant in ("mutual", "cojeffreys"):
        for kind in ("logits", "hidden"):
            add(
                f"{variant}-precomputed-{kind}",
                lambda t, variant=variant, kind=kind: {
                    "teacher": PrecomputedTeacher(logits=t.logits) if kind == "logits" else t.precomputed_hidden(),
                    "kl_divergence": variant,
                    "kl_weight": 1.0,
                },
                ValueError,
                contains(
                    f"kl_divergence={variant!r} trains the teacher and needs a TiedTeacher or SeparateTeacher",
                    "got a PrecomputedTeacher",
                ),
            )
    # A cache declared with logits_temperature holds t / T: the teacher CE (on raw logits) cannot be formed.
    for kind in ("logits", "hidden"):
        for keywords in ({"teacher_ce_weight": 1.0}, {"teacher_ce_weight": 1e-8, "kl_weight": 1.0}):
            add(
                f"logits_temperature-teacher-ce-{kind}-{keywords['teacher_ce_weight']}",
                lambda t, kind=kind, keywords=keywords: {
                    "teacher": PrecomputedTeacher(logits=t.logits, logits_temperature=2.0)
                    if kind == "logits"
                    else PrecomputedTeacher(
                        teacher_hidden=t.separate_hidden, teacher_weight=t.separate_weight, logits_temperature=2.0
                    ),
                    **keywords,
                },
                ValueError,
                contains(
                    f"teacher_ce_weight={keywords['teacher_ce_weight']} needs raw teacher logits",
                    "PrecomputedTeacher(logits_temperature=2.0) declares a cache already divided by that temperature",
                    "pass teacher_ce_weight=0.0, or pass the raw logits without logits_temperature",
                ),
            )
    # TiedTeacher(mode=...) asserts the routing; a mismatch raises instead of re-routing.
    for mode, keywords, role in [
        ("frozen", {}, "trained"),  # a tied teacher's teacher_ce_weight defaults to 1.0
        ("trained", {"teacher_ce_weight": 0.0}, "frozen"),
        ("cotrained", {"kl_weight": 1.0}, "trained"),
        ("cotrained", {"kl_weight": 1.0, "teacher_ce_weight": 0.0}, "frozen"),
        ("trained", {"kl_weight": 1.0, "kl_divergence": "mutual"}, "cotrained"),
        ("frozen", {"kl_weight": 1.0, "kl_divergence": "cojeffreys", "teacher_ce_weight": 0.0}, "cotrained"),
    ]:
        add(
            f"mode={mode}-but-{role}-{len(keywords)}",
            lambda t, mode=mode, keywords=keywords: {"teacher": TiedTeacher(t.teacher_hidden, mode=mode), **keywords},
            ValueError,
            contains(f"TiedTeacher.mode={mode!r} but the loss weights make the teacher {role!r}", "teacher_ce_weight="),
        )
    add(
        "entropy_adaptive-one-column",
        lambda t: {
            "weight": t.weight[:1],
            "labels": torch.zeros(ROWS, dtype=torch.long),
            "kl_divergence": "entropy_adaptive",
            "kl_weight": 1.0,
        },
        ValueError,
        contains("kl_divergence='entropy_adaptive' needs a vocabulary of at least 2 columns", "got 1"),
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
    # The debug profile (check_finite_inputs) rejects non-finite hidden states and heads.
    for name, profile in [
        ("student_hidden", "debug"),
        ("weight", "debug"),
        ("teacher hidden", None),
        ("teacher weight", None),
    ]:

        def non_finite(t: Inputs, name: str = name, profile: str | None = profile) -> dict[str, Any]:
            keywords: dict[str, Any] = (
                {"profile": "debug"} if profile else {"config": KernelConfig(check_finite_inputs=True)}
            )
            if name in ("student_hidden", "weight"):
                tensor = getattr(t, name).detach().clone()
                tensor[3, 1] = math.inf
                return {name: tensor, **keywords}
            hidden, weight = t.separate_hidden.clone(), t.separate_weight.clone()
            (hidden if name == "teacher hidden" else weight)[3, 1] = -math.inf
            return {"teacher": SeparateTeacher(hidden, weight), **keywords}

        value = "-inf" if name.startswith("teacher") else "inf"
        add(
            f"non-finite-{name}",
            non_finite,
            ValueError,
            contains(f"{name} must be finite", f"row 3 holds {value} at index [3, 1]"),
        )
    return cases


@pytest.mark.parametrize(("change", "error", "pattern"), _call_cases())
def test_bad_call_inputs_raise_the_same_error_in_both_apis_before_any_computation(
    no_compute: list[str], change: Callable[[Inputs], dict[str, Any]], error: type[Exception], pattern: str
) -> None:
    messages = []
    for api in APIS:
        t = make_inputs()
        with pytest.raises(error, match=pattern) as info:
            run(api, t.arguments(**change(t)))
        assert info.type is error
        messages.append(str(info.value))
        assert t.student_hidden.grad is None and t.weight.grad is None
    assert messages[0] == messages[1]
    assert no_compute == []


def test_wrong_label_dtype_leaves_no_partial_result(no_compute: list[str]) -> None:
    t = make_inputs()
    criterion = DistillationLoss(kl_weight=1.0, kl_divergence="mutual")
    for labels in (t.labels.to(torch.int32), t.labels.to(torch.float32)):
        with pytest.raises(TypeError, match=contains("labels must have dtype torch.long", str(labels.dtype))):
            criterion(t.student_hidden, t.weight, labels, TiedTeacher(t.teacher_hidden))
    assert no_compute == []
    assert t.student_hidden.grad is None and t.weight.grad is None


def test_non_finite_values_in_an_unread_cache_are_not_read() -> None:
    """The cache is read (and checked) only when a term uses the teacher logits."""
    t = make_inputs()
    logits = t.logits.clone()
    logits[3, 5] = math.nan
    out = distillation_loss(t.student_hidden, t.weight, t.labels, PrecomputedTeacher(logits=logits))
    assert torch.isfinite(out.loss) and out.kl == 0 and out.teacher_ce == 0


@pytest.mark.parametrize("api", APIS)
def test_negative_infinity_in_a_cache_is_allowed(api: str) -> None:
    t = make_inputs()
    logits = t.logits.clone()
    logits[:, 6] = -math.inf  # a column (no row's label) that the teacher rules out
    logits[1] = -math.inf  # a one-hot teacher row on its label 0
    logits[1, 0] = 0.0
    out = run(api, t.arguments(teacher=PrecomputedTeacher(logits=logits), kl_weight=1.0, teacher_ce_weight=0.5))
    assert torch.isfinite(out.loss)


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


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("teacher_ce_weight", [None, 0.0, 0])
def test_a_tempered_cache_without_teacher_ce_is_allowed(api: str, teacher_ce_weight: float | None) -> None:
    t = make_inputs()
    teacher = PrecomputedTeacher(logits=t.logits / 2.0, logits_temperature=2.0)
    out = run(api, t.arguments(teacher=teacher, kl_weight=1.0, kl_temperature=2.0, teacher_ce_weight=teacher_ce_weight))
    raw = run(api, t.arguments(teacher=PrecomputedTeacher(logits=t.logits), kl_weight=1.0, kl_temperature=2.0))
    assert torch.isfinite(out.loss) and out.teacher_ce == 0
    torch.testing.assert_close(out.kl, raw.kl, rtol=1e-12, atol=0)


@pytest.mark.parametrize("api", APIS)
def test_triton_backend_says_it_is_unavailable(api: str) -> None:
    if orda_tp.is_available():
        pytest.skip("the fused Triton kernels run on this machine")
    t = make_inputs()
    with pytest.raises(ValueError, match=r"backend='triton' is unavailable on this machine: \S"):
        run(api, t.arguments(backend="triton"))


# --------------------------------------------------------------------------------------------------
# assume_valid_labels skips the range check: a bad label then gives a NaN row, never another class.


@pytest.mark.parametrize("bad_label", [VOCAB, -1, 10**6, -(10**6), 2**62])
@pytest.mark.parametrize("variant", ["forward", "dkd"])
@pytest.mark.parametrize(
    "backend",
    [
        "auto",
        "torch",
        "reference",
    ],
)
def test_assume_valid_labels_gives_a_nan_row(bad_label: int, variant: str, backend: str) -> None:
    t = make_inputs()
    labels = t.bad_labels(bad_label)
    keywords: dict[str, Any] = {
        "kl_weight": 0.5,
        "kl_divergence": variant,
        "config": KernelConfig(assume_valid_labels=True),
        "backend": backend,
    }
    teacher = TiedTeacher(t.teacher_hidden)
    rows = distillation_loss(t.student_hidden, t.weight, labels, teacher, reduction="none", **keywords)
    for field in ("loss", "student_ce", "teacher_ce"):
        assert torch.isnan(getattr(rows, field)[BAD_ROW]), field
    # Every other row is finite and equal to the result without the bad row.
    keep = torch.arange(ROWS) != BAD_ROW
    without = distillation_loss(
        t.student_hidden[keep],
        t.weight,
        labels[keep],
        TiedTeacher(t.teacher_hidden[keep]),
        reduction="none",
        **keywords,
    )
    for field in DistillationLossOutput._fields:
        others = getattr(rows, field)[keep]
        assert torch.isfinite(others).all(), field
        torch.testing.assert_close(others, getattr(without, field), rtol=1e-12, atol=1e-15)
    for reduction in ("mean", "sum"):
        assert torch.isnan(
            distillation_loss(t.student_hidden, t.weight, labels, teacher, reduction=reduction, **keywords).loss
        )
        module = DistillationLoss(reduction=reduction, **keywords)
        assert torch.isnan(module(t.student_hidden, t.weight, labels, teacher).loss)


def test_without_assume_valid_labels_the_same_label_raises() -> None:
    t = make_inputs()
    with pytest.raises(ValueError, match=contains("labels must lie in [0, 11)", f"labels[{BAD_ROW}] = 11")):
        distillation_loss(
            t.student_hidden, t.weight, t.bad_labels(VOCAB), TiedTeacher(t.teacher_hidden), config=KernelConfig()
        )
