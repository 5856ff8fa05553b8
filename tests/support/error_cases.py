"""The shared problem and checks of the error tests, tests/test_errors_*.py (docs/reference.md §8).

Every bad input raises a ValueError/TypeError whose message names the argument, what was expected
and what was received, before anything is computed; nothing is silently clamped or reinterpreted
(an invalid label is never read as class 0).

Each case changes one thing in the small valid problem of :func:`make_inputs` and asserts the
exception type and a regex on the message (:func:`contains`). Call-time cases run through both the
functional and the module API and must give the same message (:func:`assert_call_raises`); keyword
cases must also fail at ``DistillationLoss(...)`` construction (:func:`assert_keywords_raise`).
Boundary values that the reference allows are checked to pass (:func:`assert_keywords_pass`). The
``no_compute`` fixture fails a test whose backend ran before the error; tests/conftest.py makes it
available to the tests (and has pytest rewrite this module's asserts, as it does the tests').
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

import orda_tp.loss as loss_module
from orda_tp import (
    DistillationLoss,
    DistillationLossOutput,
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

    monkeypatch.setattr(loss_module, "chunked_loss", refuse("chunked"))
    monkeypatch.setattr(loss_module, "reference_loss", refuse("reference"))
    return calls


# --------------------------------------------------------------------------------------------------
# The checks of the parametrized tests that several files share, one case per call.


def assert_keywords_raise(keywords: dict[str, Any], error: type[Exception], pattern: str) -> None:
    """``distillation_loss(..., **keywords)`` and ``DistillationLoss(**keywords)`` raise exactly
    ``error``, matching ``pattern``, with the same message."""
    t = make_inputs()
    with pytest.raises(error, match=pattern) as functional:
        distillation_loss(t.student_hidden, t.weight, t.labels, TiedTeacher(t.teacher_hidden), **keywords)
    # The module checks its keywords when it is built, with the same error.
    with pytest.raises(error, match=pattern) as module:
        DistillationLoss(**keywords)
    assert str(module.value) == str(functional.value)
    assert functional.type is error and module.type is error  # not a subclass such as an OverflowError


def assert_keywords_pass(keywords: dict[str, Any]) -> None:
    """``DistillationLoss(**keywords)`` builds, and the call with them gives a finite loss."""
    t = make_inputs()
    DistillationLoss(**keywords)
    keywords = {"kl_weight": 0.7, **keywords}
    out = distillation_loss(
        t.student_hidden, t.weight, t.labels.clamp_min(0), TiedTeacher(t.teacher_hidden), **keywords
    )
    assert torch.isfinite(out.loss)


def assert_raises_when_built(build: Callable[[Inputs], object], error: type[Exception], pattern: str) -> None:
    """Building the object (``build(make_inputs())``) raises exactly ``error``, matching ``pattern``."""
    with pytest.raises(error, match=pattern) as info:
        build(make_inputs())
    assert info.type is error


def assert_call_raises(
    no_compute: list[str], change: Callable[[Inputs], dict[str, Any]], error: type[Exception], pattern: str
) -> None:
    """The valid call with ``change(inputs)`` applied raises exactly ``error``, matching ``pattern``,
    with the same message through both APIs, before any backend ran and with no gradient left."""
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
