"""A non-unit upstream gradient through a "mean"/"sum" loss scales every gradient by it.

The chunked backends form the "mean"/"sum" gradient in the forward with a unit upstream gradient
and scale it in backward; the other tests backpropagate ``loss`` itself (upstream 1), so a lost
or doubled scale would pass them. Each way of backpropagating ``c · loss`` (tests/support/upstream_workers.py's
``WAYS``: ``c`` = 3, −0.75 and 1e-30; ``grad_outputs``; ``loss + 2 · loss``; a second backward
through a retained graph) is compared with ``c`` × the same call's unit gradient, for the
student's hidden states and head and the teacher's hidden states and head where the loss trains
them: on one device (torch backend in fp64 and fp32, Triton kernels under the interpreter in fp32,
several row chunks) and on 2 gloo ranks (plain shards and sequence parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import orda_tp

from .support import upstream_workers
from .support.cases import SMALL_CHUNKS, make_problem, separate_problem, stable_seed
from .support.distributed import run_distributed
from .support.upstream_workers import SETUPS, TeacherSetup, presence_mismatches, scaled_mismatches, unit_gradients

REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True)
class OneDevice:
    """A single-device backend and its problem: ``rows`` in chunks of ``config``, gradients
    compared within ``tolerance`` (relative)."""

    backend: str
    dtype: torch.dtype
    rows: int
    config: orda_tp.KernelConfig
    tolerance: float


TRITON_CHUNKS = orda_tp.KernelConfig(chunk_size=orda_tp.ChunkSize(nrows=7), vocab_block=96)
DEVICES = {
    "torch-fp64": OneDevice("torch", torch.float64, 24, SMALL_CHUNKS, 1e-12),  # 4 row chunks
    "torch-fp32": OneDevice("torch", torch.float32, 24, SMALL_CHUNKS, 1e-6),
    "triton-fp32": OneDevice("triton", torch.float32, 14, TRITON_CHUNKS, 1e-6),  # 2 row chunks
}


def grid() -> list[object]:
    """device × reduction × teacher setup; under the (slow) interpreter every setup once, the
    reductions alternating."""
    params = []
    for device in DEVICES:
        for r, reduction in enumerate(REDUCTIONS):
            for s, setup in enumerate(SETUPS):
                if device.startswith("triton") and (r + s) % 2:
                    continue
                params.append(pytest.param(device, reduction, setup, id=f"{device}-{reduction}-{setup.label}"))
    return params


@pytest.mark.parametrize(("device", "reduction", "setup"), grid())
def test_scaled_upstream_scales_every_gradient(device: str, reduction: str, setup: TeacherSetup) -> None:
    """Every way of backpropagating ``c · loss`` gives ``c`` × the unit gradient, on one device."""
    one = DEVICES[device]
    if one.backend == "triton":
        pytest.importorskip("triton")
    problem = make_problem(rows=one.rows, seed=stable_seed("upstream", setup.mode, reduction))
    if setup.mode == "separate":
        problem = separate_problem(problem)
    problem = problem.to(one.dtype)
    kwargs = {**setup.kwargs(reduction), "backend": one.backend, "config": one.config}
    unit = unit_gradients(problem, setup.mode, kwargs)
    problems = presence_mismatches(device, unit, setup)
    problems += scaled_mismatches(device, problem, setup.mode, kwargs, unit, one.tolerance)
    assert not problems, "\n".join(problems)


def test_scaled_upstream_on_two_gloo_ranks() -> None:
    """The same ways on 2 ranks, plain shards and sequence parallelism, mean and sum, every
    teacher setup, fp64 and fp32: ``c`` × this rank's part of the single-device unit gradient."""
    reports = run_distributed(2, upstream_workers.upstream_worker, timeout=180)
    problems = [f"rank {rank}: {problem}" for rank, report in enumerate(reports) for problem in report]
    assert not problems, f"{len(problems)} mismatches:\n" + "\n".join(problems[:60])
