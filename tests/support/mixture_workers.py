"""``TeacherMixture`` on gloo ranks (tests/test_mixture_parallel.py): each rank holds its vocabulary
shard of the student's head and of every teacher's head or logits (uneven: 37 columns), top-k caches
whole; its loss and gradients must equal one device's."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

import orda_tp

from .cases import SMALL_CHUNKS, relative_error
from .mixture_cases import ROWS, VOCAB, make_problem
from .tp_workers import TP_CHUNKS, CollectiveCounter, chunk_ranges, counted_host_reads

CASES = [  # (combine, weights, teachers, variant, sequence parallel)
    ("log_probabilities", "dense", ("tied", "separate20", "logits"), "reverse", False),
    ("divergences", "routed", ("separate12", "topk", "hidden"), "skew_js", False),
    ("probabilities", "routed", ("tied", "logits"), "dkd", False),
    ("divergences", "dense", ("tied", "separate20", "topk"), "forward", False),
    ("log_probabilities", "routed", ("tied", "separate12", "hidden", "logits"), "jeffreys", True),
    ("divergences", "dense", ("separate20", "topk"), "reverse", True),
    ("probabilities", "dense", ("tied", "separate20", "topk"), "forward", False),
    ("probabilities", "dense", ("separate12", "logits", "hidden"), "entropy_adaptive", True),
    ("probabilities", "dense", ("separate20", "logits"), "dkd", False),
]


def _weights(kind: str, n: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(n)
    if kind == "routed":
        weights = torch.nn.functional.one_hot(torch.randint(0, n, (ROWS,), generator=generator), n).double()
        weights[3::5] = 0.0
        return weights
    weights = torch.rand(ROWS, n, generator=generator, dtype=torch.float64) + 0.1
    return weights / weights.sum(1, keepdim=True)


def _shard(teacher: Any, start: int, stop: int, rows: slice = slice(None)) -> Any:
    """This rank's columns of a teacher (a top-k cache is whole) and its ``rows`` of hidden states
    (sequence parallelism)."""
    if isinstance(teacher, orda_tp.TiedTeacher):
        return orda_tp.TiedTeacher(teacher.hidden[rows])
    if isinstance(teacher, orda_tp.SeparateTeacher):
        bias = None if teacher.bias is None else teacher.bias[start:stop]
        return orda_tp.SeparateTeacher(teacher.hidden[rows], teacher.weight[start:stop], bias)
    if isinstance(teacher, orda_tp.PrecomputedTeacher) and teacher.logits is not None:
        return orda_tp.PrecomputedTeacher(logits=teacher.logits[:, start:stop].contiguous())
    if isinstance(teacher, orda_tp.PrecomputedTeacher) and teacher.teacher_weight is not None:
        shard = teacher.teacher_weight[start:stop]
        return orda_tp.PrecomputedTeacher(teacher_hidden=teacher.teacher_hidden[rows], teacher_weight=shard)
    return teacher


def mixture_worker(rank: int, world: int) -> list[str]:
    problems: list[str] = []
    start, stop = chunk_ranges(VOCAB, world)[rank]
    for combine, kind, names, variant, sequence_parallel in CASES:
        label = f"{combine}/{kind}/{variant}" + ("/sequence parallel" if sequence_parallel else "")
        rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world) if sequence_parallel else slice(None)
        problem = make_problem(5)
        weights = _weights(kind, len(names))
        kwargs = dict(kl_weight=1.2, kl_divergence=variant, kl_temperature=1.5, backend="torch", config=SMALL_CHUNKS)
        whole = orda_tp.TeacherMixture([problem.teachers[name] for name in names], weights, combine)
        args = problem.student_hidden, problem.weight, problem.labels
        expected = orda_tp.distillation_loss(*args, whole, bias=problem.bias, **kwargs)
        expected_grads = torch.autograd.grad(expected.loss, [problem.student_hidden, problem.weight, problem.bias])
        hidden = problem.student_hidden.detach()[rows].clone().requires_grad_()
        weight = problem.weight.detach()[start:stop].clone().requires_grad_()
        bias = problem.bias.detach()[start:stop].clone().requires_grad_()
        shards = [_shard(problem.teachers[n], start, stop, rows) for n in names]
        local = orda_tp.TeacherMixture(shards, weights, combine)
        out = orda_tp.distillation_loss(
            hidden, weight, problem.labels, local, bias=bias, tp_group=dist.group.WORLD,
            sequence_parallel=sequence_parallel, **kwargs,
        )  # fmt: skip
        grads = torch.autograd.grad(out.loss, [hidden, weight, bias])
        wanted = [expected_grads[0][rows], expected_grads[1][start:stop], expected_grads[2][start:stop]]
        for index, (actual, want) in enumerate([*zip(out, expected), *zip(grads, wanted)]):
            if (error := relative_error(actual, want)) > 1e-10:
                problems.append(f"{label}: output {index} relative error {error:.2e}")
    return problems


def counting_worker(rank: int, world: int) -> dict[str, list[int]]:
    """Collectives of a call (loss and gradients, its second run) per mixture form, and of the
    one-teacher call with the same chunks, with and without sequence parallelism."""
    start, stop = chunk_ranges(VOCAB, world)[rank]
    problem = make_problem(7)
    names = ("separate20", "logits", "topk")
    kwargs = dict(kl_weight=1.0, backend="torch", config=TP_CHUNKS, tp_group=dist.group.WORLD)
    counter, report = CollectiveCounter(), {}
    for sequence_parallel in (False, True):
        rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world) if sequence_parallel else slice(None)
        teachers = [_shard(problem.teachers[name], start, stop, rows) for name in names]
        split = {"sequence_parallel": sequence_parallel}
        cases = {
            "one teacher": teachers[0],
            **{
                f"{combine} {kind}": orda_tp.TeacherMixture(teachers, _weights(kind, len(names)), combine)
                for combine in ("divergences", "probabilities", "log_probabilities")
                for kind in ("dense", "routed")
            },
        }
        for name, teacher in cases.items():
            hidden = problem.student_hidden.detach()[rows].clone().requires_grad_()
            weight = problem.weight.detach()[start:stop].clone().requires_grad_()

            def call(teacher: Any = teacher, hidden: Any = hidden, weight: Any = weight, split: Any = split) -> None:
                out = orda_tp.distillation_loss(hidden, weight, problem.labels, teacher, **kwargs, **split)
                torch.autograd.grad(out.loss, [hidden, weight])

            with counter.patched():
                counts = [len(counter.count(call)) for _ in range(2)]
            report[f"{name}{' / sequence parallel' if sequence_parallel else ''}"] = counts
    return report


def host_reads_worker(rank: int, world: int) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """The host reads of a forward + backward with host checks off (a CUDA call's default): one
    teacher read through a head, a mixture of such teachers with n numbers as weights (read as a head:
    no value check, so no error columns), and a mixture holding a logits cache (value-checked)."""
    start, stop = chunk_ranges(VOCAB, world)[rank]
    problem = make_problem(8)
    heads = [_shard(problem.teachers[name], start, stop) for name in ("separate20", "separate12", "tied")]
    cache = _shard(problem.teachers["logits"], start, stop)
    config = replace(TP_CHUNKS, host_checks=False)
    teachers = {
        "one head": heads[0],
        "heads": orda_tp.TeacherMixture(heads, [0.5, 0.3, 0.2], "probabilities"),
        "heads and a cache": orda_tp.TeacherMixture([heads[0], cache], [0.5, 0.5]),
    }
    report = {}
    for name, teacher in teachers.items():
        hidden = problem.student_hidden.detach().clone().requires_grad_()
        weight = problem.weight.detach()[start:stop].clone().requires_grad_()
        reads: list[tuple[str, tuple[int, ...]]] = []
        with counted_host_reads(reads):
            out = orda_tp.distillation_loss(
                hidden, weight, problem.labels, teacher, kl_weight=1.0, backend="torch", config=config,
                tp_group=dist.group.WORLD,
            )  # fmt: skip
            torch.autograd.grad(out.loss, [hidden, weight])
        report[name] = reads
    return report
