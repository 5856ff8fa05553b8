"""The errors of how a call runs (docs/reference.md §8): ``KernelConfig`` and ``ChunkSize`` when they
are built, the ``profile``, ``config`` and ``backend`` keywords, the finite-input check of the debug
profile (``check_finite_inputs``), ``assume_valid_labels`` (a bad label then gives a NaN row, never
another class). The allowed values of every descriptor (teachers, EntropyGate, ChunkSize,
KernelConfig) are built here too. How the cases are checked: tests/support/error_cases.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import orda_tp
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

from .support.error_cases import (
    APIS,
    BAD_ROW,
    ROWS,
    VOCAB,
    Inputs,
    assert_call_raises,
    assert_keywords_pass,
    assert_keywords_raise,
    assert_raises_when_built,
    contains,
    make_inputs,
    run,
)


def _keyword_cases() -> list[Any]:
    cases: list[Any] = []

    def add(case_id: str, keywords: dict[str, Any], error: type[Exception], pattern: str) -> None:
        cases.append(pytest.param(keywords, error, pattern, id=case_id))

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
    return cases


@pytest.mark.usefixtures("no_compute")
@pytest.mark.parametrize(("keywords", "error", "pattern"), _keyword_cases())
def test_bad_keywords_raise_in_both_apis(keywords: dict[str, Any], error: type[Exception], pattern: str) -> None:
    assert_keywords_raise(keywords, error, pattern)


def _good_keywords() -> list[Any]:
    return [
        pytest.param({"profile": "debug", "config": KernelConfig()}, id="profile-and-config"),
    ]


@pytest.mark.parametrize("keywords", _good_keywords())
def test_allowed_keywords_and_boundaries_pass(keywords: dict[str, Any]) -> None:
    assert_keywords_pass(keywords)


# --------------------------------------------------------------------------------------------------
# KernelConfig and ChunkSize: checked when they are built.


def _construction_cases() -> list[Any]:
    cases: list[Any] = []

    def add(case_id: str, build: Callable[[Inputs], object], error: type[Exception], pattern: str) -> None:
        cases.append(pytest.param(build, error, pattern, id=case_id))

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
    assert_raises_when_built(build, error, pattern)


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
# The debug profile's finite-input check, at the call.


def _call_cases() -> list[Any]:
    cases: list[Any] = []

    def add(case_id: str, change: Callable[[Inputs], dict[str, Any]], error: type[Exception], pattern: str) -> None:
        cases.append(pytest.param(change, error, pattern, id=case_id))

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
    assert_call_raises(no_compute, change, error, pattern)


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
