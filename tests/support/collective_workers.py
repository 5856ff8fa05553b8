"""Worker bodies of tests/test_collectives.py; each runs on every rank of a gloo group.

- :func:`lent_tensors_worker`: every tensor a tensor-parallel call hands to a collective is
  released (by the process group's worker threads too) when its forward, and again when its
  backward, returns, so that no worker thread still holds one when the interpreter exits.
- :func:`warnings_worker`: the calls issue no deprecated collective (FutureWarning or
  DeprecationWarning raised as errors).

Both return a list of problem descriptions (empty when all is well).
"""

from __future__ import annotations

import gc
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import Tensor

import orda_tp

from .distributed import note
from .tp_workers import chunk_ranges, plain_case, row_range, upstream_for

# The collectives of orda_tp's exchange, under their current and their older names.
LENDING_COLLECTIVES = (
    "all_reduce",
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
)
VOCAB = 203


class LendingRecorder:
    """Weak references to every tensor passed to a :data:`LENDING_COLLECTIVES` function inside
    :meth:`patched` (patched on ``torch.distributed``, its ``distributed_c10d`` and every loaded
    ``orda_tp`` module that bound one by name)."""

    def __init__(self) -> None:
        self.lent: list[weakref.ref[Tensor]] = []

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.lent += [weakref.ref(a) for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
            return original(*args, **kwargs)

        return recorded

    @contextmanager
    def patched(self) -> Iterator[LendingRecorder]:
        modules = [dist, c10d] + [m for n, m in sorted(sys.modules.items()) if n.startswith("orda_tp") and m]
        saved: list[tuple[object, str, object]] = []
        for name in LENDING_COLLECTIVES:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapper = self._wrap(original)
            for module in modules:
                if getattr(module, name, None) is original:
                    saved.append((module, name, original))
                    setattr(module, name, wrapper)
        try:
            yield self
        finally:
            for module, name, original in saved:
                setattr(module, name, original)

    def still_held(self) -> int:
        """How many of the tensors lent so far are still alive (after a garbage collection, so
        that only real references count), and forget them."""
        gc.collect()
        held = sum(tensor() is not None for tensor in self.lent)
        self.lent = []
        return held


def _hidden_call(label: str, rank: int, world: int, reduction: str, sequence_parallel: bool) -> Callable[[], Tensor]:
    """A forward of ``distillation_loss`` on this rank's shard (several row chunks and groups);
    returns what to differentiate, weighted for reduction "none"."""
    columns = chunk_ranges(VOCAB, world)[rank]
    rows = row_range(24, world, rank) if sequence_parallel else None
    extra = {"sequence_parallel": True} if sequence_parallel else {}
    case = plain_case(label, "forward", "separate", reduction, torch.float64, columns, rows, **extra)
    local = case.local
    upstream = upstream_for(reduction, 24, torch.float64)

    def forward() -> Tensor:
        kwargs = {**case.kwargs, **case.tp_kwargs}
        out = orda_tp.distillation_loss(
            local.student_hidden, local.weight, local.labels, local.teacher("separate"), **kwargs
        )
        return out.loss if upstream is None else (out.loss * upstream).sum()

    return forward


def _logits_call(rank: int, world: int) -> Callable[[], Tensor]:
    """A forward of ``KDLoss`` on this rank's columns of the logits."""
    generator = torch.Generator().manual_seed(3)
    student = torch.randn(2, 6, VOCAB, generator=generator, dtype=torch.float64)
    teacher = torch.randn(2, 6, VOCAB, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (2, 6), generator=generator)
    start, stop = chunk_ranges(VOCAB, world)[rank]
    local = student[..., start:stop].clone().requires_grad_()
    kd = orda_tp.KDLoss(temperature=2.0, tp_group=dist.group.WORLD, chunk_size=4)
    return lambda: kd(local, teacher[..., start:stop], labels)


def _calls(rank: int, world: int) -> dict[str, Callable[[], Tensor]]:
    return {
        "eager gradients (mean)": _hidden_call("eager", rank, world, "mean", False),
        "deferred gradients (none)": _hidden_call("deferred", rank, world, "none", False),
        "sequence parallel": _hidden_call("sequence parallel", rank, world, "mean", True),
        "KDLoss": _logits_call(rank, world),
    }


def lent_tensors_worker(rank: int, world: int) -> list[str]:
    """After each call's forward and after its backward: no tensor lent to a collective is alive,
    and none was kept alive while the call waited for its release (the call's warning)."""
    problems = []
    recorder = LendingRecorder()
    for label, forward in _calls(rank, world).items():
        note(label)
        with recorder.patched(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            loss = forward()
            after_forward = recorder.still_held()
            loss.backward()
            after_backward = recorder.still_held()
        for phase, held in (("forward", after_forward), ("backward", after_backward)):
            if held:
                problems.append(f"{label}: {held} tensor(s) handed to collectives still referenced after the {phase}")
        problems += [f"{label}: warned {warning.message}" for warning in caught if warning.category is RuntimeWarning]
    return problems


def warnings_worker(rank: int, world: int) -> list[str]:
    """Each call, forward and backward, with deprecation warnings raised as errors."""
    problems = []
    for label, forward in _calls(rank, world).items():
        note(label)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            warnings.simplefilter("error", DeprecationWarning)
            try:
                forward().backward()
            except (FutureWarning, DeprecationWarning) as warning:
                problems.append(f"{label}: {type(warning).__name__}: {warning}")
    return problems
