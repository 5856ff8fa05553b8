"""The errors of the KL variants (docs/reference.md §8, docs/variants.md §4): ``kl_divergence``, the
parameters each variant reads (``kl_alpha``, ``kl_beta``, ``EntropyGate``) and their ranges, the
alias ``generalized_jsd``'s ``kl_beta`` in [0, 1] (β below 1 − β's resolution refused), the
co-training variants' equal temperatures, ``entropy_adaptive`` on one column. How the cases are
checked: tests/support/error_cases.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import orda_tp
from orda_tp import EntropyGate

from .support.error_cases import (
    ROWS,
    Inputs,
    assert_call_raises,
    assert_keywords_pass,
    assert_keywords_raise,
    assert_raises_when_built,
    contains,
)


def _keyword_cases() -> list[Any]:
    cases: list[Any] = []

    def add(case_id: str, keywords: dict[str, Any], error: type[Exception], pattern: str) -> None:
        cases.append(pytest.param(keywords, error, pattern, id=case_id))

    # Names that must be one of a fixed set.
    for value in ["kl", "Forward", "forward_kl", "", None, 1]:
        add(
            f"kl_divergence={value!r}",
            {"kl_divergence": value},
            ValueError,
            contains(
                "kl_divergence must be one of [", "'forward'", "'triangular', 'generalized_jsd']", f"got {value!r}"
            ),
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
    # The alias (not a registered variant): TRL's β, both edges included.
    ("generalized_jsd", "kl_beta", "[0.0, 1.0]", [-1e-9, -0.1, 1 + 1e-9, 1.1, 2], [0, 0.0, 1e-6, 0.5, 1, 1.0]),
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
    for value in [1e-17, 5e-17, 2.0**-54]:  # 1 − β rounds to 1: no skew_js student weight in (0, 1)
        cases.append(
            pytest.param(
                {"kl_divergence": "generalized_jsd", "kl_beta": value},
                ValueError,
                contains(f"kl_beta={value!r} is too small for kl_divergence='generalized_jsd'", "pass kl_beta=0"),
                id=f"generalized_jsd-tiny-{value!r}",
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
    assert_keywords_raise(keywords, error, pattern)


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
    return cases


@pytest.mark.parametrize("keywords", _good_variant_keywords())
def test_allowed_keywords_and_boundaries_pass(keywords: dict[str, Any]) -> None:
    assert_keywords_pass(keywords)


# --------------------------------------------------------------------------------------------------
# EntropyGate: checked when it is built.


def _construction_cases() -> list[Any]:
    cases: list[Any] = []

    def add(case_id: str, build: Callable[[Inputs], object], error: type[Exception], pattern: str) -> None:
        cases.append(pytest.param(build, error, pattern, id=case_id))

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
    return cases


@pytest.mark.parametrize(("build", "error", "pattern"), _construction_cases())
def test_bad_descriptors_and_configs_raise_when_built(
    build: Callable[[Inputs], object], error: type[Exception], pattern: str
) -> None:
    assert_raises_when_built(build, error, pattern)


# --------------------------------------------------------------------------------------------------
# A call that the variant cannot compute.


def _call_cases() -> list[Any]:
    cases: list[Any] = []

    def add(case_id: str, change: Callable[[Inputs], dict[str, Any]], error: type[Exception], pattern: str) -> None:
        cases.append(pytest.param(change, error, pattern, id=case_id))

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
    return cases


@pytest.mark.parametrize(("change", "error", "pattern"), _call_cases())
def test_bad_call_inputs_raise_the_same_error_in_both_apis_before_any_computation(
    no_compute: list[str], change: Callable[[Inputs], dict[str, Any]], error: type[Exception], pattern: str
) -> None:
    assert_call_raises(no_compute, change, error, pattern)
