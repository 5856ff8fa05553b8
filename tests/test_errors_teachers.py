"""The errors of the teacher descriptors ``TiedTeacher``, ``SeparateTeacher`` and
``PrecomputedTeacher`` (docs/reference.md §8): when they are built, and at the call (the type of
``teacher``, its shapes and device, a cache's values and in-place changes, the routing that
``TiedTeacher(mode=...)`` asserts, co-training with a cache, a cache divided by its temperature).
How the cases are checked: tests/support/error_cases.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from orda_tp import PrecomputedTeacher, SeparateTeacher, TiedTeacher, distillation_loss

from .support.error_cases import (
    APIS,
    DEPTH,
    HIDDEN,
    ROWS,
    VOCAB,
    Inputs,
    assert_call_raises,
    assert_raises_when_built,
    contains,
    make_inputs,
    run,
)

# --------------------------------------------------------------------------------------------------
# The descriptors: checked when they are built.


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
    return cases


@pytest.mark.parametrize(("build", "error", "pattern"), _construction_cases())
def test_bad_descriptors_and_configs_raise_when_built(
    build: Callable[[Inputs], object], error: type[Exception], pattern: str
) -> None:
    assert_raises_when_built(build, error, pattern)


# --------------------------------------------------------------------------------------------------
# The teacher of a call: type, shapes, device, a cache's values, routing.


def _call_cases() -> list[Any]:
    cases: list[Any] = []

    def add(case_id: str, change: Callable[[Inputs], dict[str, Any]], error: type[Exception], pattern: str) -> None:
        cases.append(pytest.param(change, error, pattern, id=case_id))

    f64 = torch.float64
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
    return cases


@pytest.mark.parametrize(("change", "error", "pattern"), _call_cases())
def test_bad_call_inputs_raise_the_same_error_in_both_apis_before_any_computation(
    no_compute: list[str], change: Callable[[Inputs], dict[str, Any]], error: type[Exception], pattern: str
) -> None:
    assert_call_raises(no_compute, change, error, pattern)


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
@pytest.mark.parametrize("teacher_ce_weight", [None, 0.0, 0])
def test_a_tempered_cache_without_teacher_ce_is_allowed(api: str, teacher_ce_weight: float | None) -> None:
    t = make_inputs()
    teacher = PrecomputedTeacher(logits=t.logits / 2.0, logits_temperature=2.0)
    out = run(api, t.arguments(teacher=teacher, kl_weight=1.0, kl_temperature=2.0, teacher_ce_weight=teacher_ce_weight))
    raw = run(api, t.arguments(teacher=PrecomputedTeacher(logits=t.logits), kl_weight=1.0, kl_temperature=2.0))
    assert torch.isfinite(out.loss) and out.teacher_ce == 0
    torch.testing.assert_close(out.kl, raw.kl, rtol=1e-12, atol=0)
