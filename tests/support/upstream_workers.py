"""Non-unit upstream gradients through a "mean"/"sum" loss: shared checks and their gloo worker.

For "mean"/"sum" the chunked backends form the gradient during the forward with a unit upstream
gradient and scale it by the real one in backward (``orda_tp/engine/fused.py``). Every way of
backpropagating ``c · loss`` must give ``c`` × the unit gradient, for every gradient the call
produces: ``(c · loss).backward()`` for a positive, a negative and a tiny ``c``,
``torch.autograd.grad(loss, ..., grad_outputs=c)``, a loss used twice in one graph
(``loss + 2 · loss``), and a second backward through a retained graph (the recomputed path).
Used by tests/test_upstream_scale.py on one device and by :func:`upstream_worker` on gloo ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

import orda_tp

from . import cases
from .cases import Columns, Problem, Rows, relative_error, shard_problem, stable_seed
from .distributed import note
from .tp_workers import (
    DTYPES,
    GRAD_KINDS,
    ROWS,
    TOLERANCE,
    TP_CHUNKS,
    VOCAB,
    _expected_part,
    chunk_ranges,
    full_problem,
    row_range,
)

UPSTREAMS = (3.0, -0.75, 1e-30)  # positive, negative, tiny (still normal in fp32 times a gradient)
GradientList = list[Tensor | None]


@dataclass(frozen=True)
class TeacherSetup:
    """A teacher mode and whether the loss trains the teacher.

    Frozen: forward KL and no teacher CE (role "frozen": no teacher gradient). Trained: the
    co-trained "mutual" KL plus a teacher CE (tied, separate), so the teacher's hidden states
    (and a separate teacher's head) receive gradients from both terms.
    """

    mode: str
    trained: bool

    @property
    def label(self) -> str:
        return f"{self.mode}/{'trained' if self.trained else 'frozen'}"

    def kwargs(self, reduction: str) -> dict[str, object]:
        """The loss keywords (tests/support/cases.py's call_kwargs, the teacher CE off for a frozen teacher)."""
        if self.trained:
            return cases.call_kwargs("mutual", self.mode, reduction)
        return {**cases.call_kwargs("forward", self.mode, reduction), "teacher_ce_weight": 0.0}

    def produced(self) -> tuple[bool, ...]:
        """Which of ``Problem.trainable(mode)`` must receive a gradient."""
        return tuple(index < 2 or self.trained for index in range(len(GRAD_KINDS[self.mode])))


SETUPS = (
    TeacherSetup("tied", trained=False),
    TeacherSetup("tied", trained=True),
    TeacherSetup("separate", trained=False),
    TeacherSetup("separate", trained=True),
    TeacherSetup("precomputed", trained=False),
)


def _grads(loss: Tensor, inputs: list[Tensor], **kwargs: object) -> GradientList:
    return list(torch.autograd.grad(loss, inputs, allow_unused=True, **kwargs))


def _backward(c: float) -> Callable[[Tensor, list[Tensor]], GradientList]:
    def run(loss: Tensor, inputs: list[Tensor]) -> GradientList:
        (c * loss).backward()
        return [tensor.grad for tensor in inputs]

    return run


def _grad_outputs(c: float) -> Callable[[Tensor, list[Tensor]], GradientList]:
    def run(loss: Tensor, inputs: list[Tensor]) -> GradientList:
        return _grads(loss, inputs, grad_outputs=torch.full_like(loss, c))

    return run


def _used_twice(loss: Tensor, inputs: list[Tensor]) -> GradientList:
    return _grads(loss + 2 * loss, inputs)


def _second_backward(c: float) -> Callable[[Tensor, list[Tensor]], GradientList]:
    def run(loss: Tensor, inputs: list[Tensor]) -> GradientList:
        _grads(loss, inputs, retain_graph=True)
        return _grads(c * loss, inputs)

    return run


@dataclass(frozen=True)
class ScaledBackprop:
    """One way of backpropagating a multiple of the loss: ``factor`` × the unit gradient expected."""

    name: str
    factor: float
    run: Callable[[Tensor, list[Tensor]], GradientList]


WAYS = (
    *(ScaledBackprop(f"({c:g} * loss).backward()", c, _backward(c)) for c in UPSTREAMS),
    ScaledBackprop("autograd.grad(loss, grad_outputs=-0.75)", -0.75, _grad_outputs(-0.75)),
    ScaledBackprop("autograd.grad(loss + 2 * loss)", 3.0, _used_twice),
    ScaledBackprop("second backward of 3 * loss (retain_graph)", 3.0, _second_backward(3.0)),
)


def fresh(problem: Problem) -> Problem:
    """A copy with fresh leaves (no ``.grad``, no graph), in the same dtype."""
    return problem.to(problem.weight.dtype)


def unit_gradients(problem: Problem, mode: str, kwargs: dict[str, object]) -> GradientList:
    """The gradients of ``loss`` (upstream 1) on a fresh copy of ``problem``."""
    copy = fresh(problem)
    out = orda_tp.distillation_loss(copy.student_hidden, copy.weight, copy.labels, copy.teacher(mode), **kwargs)
    return _grads(out.loss, copy.trainable(mode))


def presence_mismatches(label: str, grads: GradientList, setup: TeacherSetup) -> list[str]:
    """A problem for every gradient that is missing where the setup trains it, or present where not."""
    problems = []
    for name, grad, wanted in zip(GRAD_KINDS[setup.mode], grads, setup.produced()):
        if (grad is not None) != wanted:
            problems.append(f"{label}: {name} gradient {'missing' if wanted else 'present'} for {setup.label}")
    return problems


def scaled_mismatches(
    label: str,
    problem: Problem,
    mode: str,
    kwargs: dict[str, object],
    unit: GradientList,
    tolerance: float,
) -> list[str]:
    """Each of :data:`WAYS` on a fresh copy of ``problem`` against ``factor`` × ``unit`` (this
    device's part of the gradients of upstream 1): same gradients present, relative error within
    ``tolerance``."""
    problems: list[str] = []
    for way in WAYS:
        copy = fresh(problem)
        out = orda_tp.distillation_loss(copy.student_hidden, copy.weight, copy.labels, copy.teacher(mode), **kwargs)
        grads = way.run(out.loss, copy.trainable(mode))
        for name, grad, want in zip(GRAD_KINDS[mode], grads, unit):
            where = f"{label} {way.name}: {name}"
            if (grad is None) != (want is None):
                problems.append(f"{where} gradient is {'None' if grad is None else 'set'}, the unit one is not")
            elif grad is not None and want is not None:
                error = relative_error(grad, way.factor * want.double())
                if not error <= tolerance or not math.isfinite(error):
                    problems.append(f"{where} relative error {error:.2e} against {way.factor:g} × unit")
    return problems


def rank_mismatches(
    label: str, setup: TeacherSetup, reduction: str, dtype: torch.dtype, columns: Columns, rows: Rows
) -> list[str]:
    """One case on this rank: each way of backpropagating ``c · loss`` through the tensor-parallel
    call against ``c`` × this rank's part (head rows ``columns``, hidden ``rows``) of the
    single-device unit gradient (torch backend, 4 row chunks per call)."""
    note(label)
    full = full_problem(setup.mode, dtype, stable_seed("upstream", setup.mode, reduction))
    kwargs = {**setup.kwargs(reduction), "backend": "torch", "config": TP_CHUNKS}
    unit = unit_gradients(full, setup.mode, kwargs)
    parts = [
        _expected_part(grad, "head" if name.endswith("weight") else "hidden", columns, rows, None)
        for name, grad in zip(GRAD_KINDS[setup.mode], unit)
    ]
    tp_kwargs = {**kwargs, "tp_group": dist.group.WORLD, "sequence_parallel": rows is not None}
    local = shard_problem(full, columns, rows)
    problems = presence_mismatches(label, unit, setup)
    return problems + scaled_mismatches(label, local, setup.mode, tp_kwargs, parts, TOLERANCE[dtype])


def upstream_worker(rank: int, world: int) -> list[str]:
    """Plain vocabulary shards and sequence parallelism, "mean" and "sum", every teacher setup, in
    fp64 and fp32 (under sequence parallelism one dtype per case, alternating)."""
    columns = chunk_ranges(VOCAB, world)[rank]
    problems: list[str] = []
    for rows in (None, row_range(ROWS, world, rank)):
        for r, reduction in enumerate(("mean", "sum")):
            for s, setup in enumerate(SETUPS):
                for dtype in DTYPES if rows is None else (DTYPES[(r + s) % 2],):
                    label = f"sp={rows is not None} {reduction} {setup.label} {str(dtype)[6:]}"
                    problems += rank_mismatches(label, setup, reduction, dtype, columns, rows)
    return problems
