"""Workers of tests/test_topk_extraction.py's tensor-parallel case (importable by spawned ranks).

Every rank passes the same teacher hidden rows and its ``torch.chunk`` shard of the head (or of
the logits' columns): uneven shards, a padded last shard (``vocab_size`` < the columns), a shard of
padding only. Each rank's result must equal the fp64 oracle of the full logits (ids identical,
values ≤ 1e-12 in fp64, fp32 rounding on the Triton kernel), be bitwise the same on every rank,
and bad input must raise the same error on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import orda_tp
from orda_tp import TeacherTopK

from .topk_extraction_cases import oracle_topk, topk_problems
from .tp_workers import chunk_ranges

CONFIG = orda_tp.KernelConfig(chunk_size=orda_tp.ChunkSize(nrows=4), vocab_block=32)
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-5}
COLUMNS = 203
# (backend, dtype, k, vocab_size, temperature, logit_softcap)
CASES = [
    ("torch", torch.float64, 9, None, 1.0, None),
    ("torch", torch.float64, 64, 190, 1.5, 5.0),
    ("reference", torch.float64, 30, 130, 2.0, None),  # with 3 ranks the last shard is padding only
    ("torch", torch.float32, 1, 190, 1.0, None),
    ("triton", torch.float32, 17, None, 0.8, 7.0),
    ("triton", torch.float32, 64, 130, 1.0, None),
]


def teacher(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(8)
    hidden = torch.randn(11, 12, generator=generator, dtype=torch.float64)
    weight = 3 * torch.randn(COLUMNS, 12, generator=generator, dtype=torch.float64) / 12**0.5
    return hidden.to(dtype), weight.to(dtype)


def extraction_worker(rank: int, world: int) -> list[str]:
    """The cases through ``tp_group`` (head and logits shards), ties, DTensors, and bad input."""
    group = dist.group.WORLD
    start, stop = chunk_ranges(COLUMNS, world)[rank]
    problems: list[str] = []
    for backend, dtype, k, vocab_size, temperature, cap in CASES:
        label = f"{backend}/{str(dtype)[6:]}/k={k}/vocab_size={vocab_size}/T={temperature}/cap={cap}"
        options = {"temperature": temperature, "logit_softcap": cap, "vocab_size": vocab_size}
        hidden, weight = teacher(dtype)
        logits = hidden @ weight.T
        want = oracle_topk(logits, k, **options)
        kwargs = {"tp_group": group, "backend": backend, "config": CONFIG, **options}
        got = orda_tp.teacher_topk(hidden, weight[start:stop].clone(), k, **kwargs)
        problems += topk_problems(f"{label}/head", got, want, TOLERANCE[dtype]) + _disagreement(label, got, group)
        got = orda_tp.teacher_topk_of_logits(logits[:, start:stop].clone(), k, **kwargs)
        problems += topk_problems(f"{label}/logits", got, want, TOLERANCE[dtype])
    return problems + _tie_problems(rank, world) + _dtensor_problems(world) + _error_problems(start, stop)


def _disagreement(label: str, got: TeacherTopK, group: dist.ProcessGroup) -> list[str]:
    """A problem unless this rank's result is bitwise rank 0's."""
    packed = torch.cat([got.ids.double(), got.logprobs.double(), got.log_partition.double()[:, None]], dim=1)
    gathered = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, packed, group=group)
    if not all(torch.equal(values, gathered[0]) for values in gathered):
        return [f"{label}: results differ between ranks"]
    return []


def _tie_problems(rank: int, world: int) -> list[str]:
    """Integer logits (hundreds of equal values per row, across every shard): lowest id first."""
    logits = torch.randint(0, 3, (6, COLUMNS), generator=torch.Generator().manual_seed(2)).float()
    start, stop = chunk_ranges(COLUMNS, world)[rank]
    want = oracle_topk(logits, 120)
    problems = []
    for backend in ("torch", "triton"):
        got = orda_tp.teacher_topk_of_logits(
            logits[:, start:stop].clone(), 120, tp_group=dist.group.WORLD, backend=backend, config=CONFIG
        )
        problems += topk_problems(f"ties/{backend}", got, want, 1e-6)
    return problems


def _dtensor_problems(world: int) -> list[str]:
    """A Shard(0) head with Replicate hidden states, and Shard(1) logits, on a 1-D mesh."""
    mesh = init_device_mesh("cpu", (world,))
    hidden, weight = teacher(torch.float64)
    want = oracle_topk(hidden @ weight.T, 12, temperature=1.2)
    head = distribute_tensor(weight, mesh, [Shard(0)])
    states = distribute_tensor(hidden, mesh, [Replicate()])
    logits = distribute_tensor(hidden @ weight.T, mesh, [Shard(1)])
    problems = topk_problems("dtensor/head", orda_tp.teacher_topk(states, head, 12, temperature=1.2), want, 1e-12)
    problems += topk_problems(
        "dtensor/plain hidden", orda_tp.teacher_topk(hidden, head, 12, temperature=1.2), want, 1e-12
    )
    got = orda_tp.teacher_topk_of_logits(logits, 12, temperature=1.2)
    return problems + topk_problems("dtensor/logits", got, want, 1e-12)


def _error_problems(start: int, stop: int) -> list[str]:
    """Bad input raises the same error on every rank: one rank's own bad argument, a full head on
    every rank, hidden rows that differ between ranks, settings that differ, k past the real
    vocabulary."""
    hidden, weight = teacher(torch.float64)
    rank = dist.get_rank()
    shard = weight[start:stop].clone()
    # (label, message, hidden, weight, keywords)
    calls: list[tuple[str, str, torch.Tensor, torch.Tensor, dict[str, Any]]] = [
        ("one rank's k", "invalid inputs on tp_group rank(s) [0]", hidden, shard, {"k": 0 if rank == 0 else 5}),
        ("one rank's temperature", "invalid inputs on tp_group rank(s) [1]", hidden, shard,
         {"temperature": -1.0 if rank == 1 else 1.0}),
        ("k past vocab", "k must be at most the real vocabulary (190 ids)", hidden, shard,
         {"k": 191, "vocab_size": 190}),
        ("full head", "a full, unsharded head passed on every rank", hidden, weight, {}),
        ("hidden differ", "hidden must be identical on every rank", hidden + rank, shard, {}),
        ("settings differ", "the same settings on every rank", hidden, shard, {"k": 5 + rank}),
    ]  # fmt: skip
    problems = []
    for label, message, states, head, keywords in calls:
        try:
            orda_tp.teacher_topk(states, head, **{"k": 5, **keywords}, tp_group=dist.group.WORLD)
            problems.append(f"errors/{label}: no error raised")
        except (ValueError, TypeError) as error:
            if message not in str(error):
                problems.append(f"errors/{label}: unexpected message {error}")
    return problems
