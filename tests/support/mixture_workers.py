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
from .mixture_cases import HIDDEN, ROWS, VOCAB, make_problem, weights_of
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
        weights = weights_of(kind, len(names), len(names))
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
        problems += _compare(label, [*out, *grads], [*expected, *wanted])
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
                f"{combine} {kind}": orda_tp.TeacherMixture(teachers, weights_of(kind, len(names), len(names)), combine)
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


PADDED = VOCAB + 5  # head rows and logits columns of the padded cases; vocab_size=VOCAB is the real vocabulary


def _padded(teacher: Any, generator: torch.Generator) -> Any:
    """A teacher whose head has random rows (logits: a large finite fill) past the real vocabulary."""
    extra = PADDED - VOCAB
    if isinstance(teacher, orda_tp.SeparateTeacher):
        pad = torch.randn(extra, teacher.weight.shape[1], generator=generator, dtype=torch.float64)
        bias = None if teacher.bias is None else torch.cat([teacher.bias, torch.full((extra,), 5.0)])
        return orda_tp.SeparateTeacher(teacher.hidden, torch.cat([teacher.weight, pad]), bias)
    if isinstance(teacher, orda_tp.PrecomputedTeacher) and teacher.logits is not None:
        fill = teacher.logits.new_full((teacher.logits.shape[0], extra), 30.0)
        return orda_tp.PrecomputedTeacher(logits=torch.cat([teacher.logits, fill], dim=1))
    return teacher


def padded_and_dtensor_worker(rank: int, world: int) -> list[str]:
    """Each form on a padded vocabulary (head rows past ``vocab_size`` on the last ranks) and with
    DTensor inputs (the student's head and bias, each teacher's head ``Shard(0)``, a logits cache
    ``Shard(1)``): one device's loss and gradients (fp64, 1e-10); padding rows get exactly 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    problems: list[str] = []
    mesh = init_device_mesh("cpu", (world,))
    names = ("tied", "separate20", "logits")
    for combine, kind in (("divergences", "dense"), ("probabilities", "dense"), ("log_probabilities", "routed")):
        problem = make_problem(9)
        weights = weights_of(kind, len(names), len(names))
        kwargs = dict(kl_weight=1.0, kl_divergence="reverse", backend="torch", config=SMALL_CHUNKS)
        args = problem.student_hidden, problem.weight, problem.labels
        whole = orda_tp.TeacherMixture([problem.teachers[n] for n in names], weights, combine)
        expected = orda_tp.distillation_loss(*args, whole, bias=problem.bias, **kwargs)
        want = torch.autograd.grad(expected.loss, [problem.student_hidden, problem.weight, problem.bias])
        generator = torch.Generator().manual_seed(3)
        # Padded: the student's head and each teacher's past vocab_size, split evenly over the ranks.
        start, stop = chunk_ranges(PADDED, world)[rank]
        pad = torch.randn(PADDED - VOCAB, HIDDEN, generator=generator, dtype=torch.float64)
        weight = torch.cat([problem.weight.detach(), pad])[start:stop].clone().requires_grad_()
        bias = torch.cat([problem.bias.detach(), torch.zeros(PADDED - VOCAB)])[start:stop].clone().requires_grad_()
        padded = [_shard(_padded(problem.teachers[n], generator), start, stop) for n in names]
        hidden = problem.student_hidden.detach().clone().requires_grad_()
        out = orda_tp.distillation_loss(
            hidden, weight, problem.labels, orda_tp.TeacherMixture(padded, weights, combine), bias=bias,
            tp_group=dist.group.WORLD, vocab_size=VOCAB, **kwargs,
        )  # fmt: skip
        grads = torch.autograd.grad(out.loss, [hidden, weight, bias])
        real, padding = slice(start, min(stop, VOCAB)), max(0, stop - max(start, VOCAB))
        wanted = [want[0], torch.cat([want[1][real], want[1].new_zeros(padding, HIDDEN)])]
        wanted.append(torch.cat([want[2][real], want[2].new_zeros(padding)]))
        problems += _compare(f"{combine}/padded", [*out, *grads], [*expected, *wanted])
        # DTensors: torch's even split of every head and cache over a 1-D mesh.
        logits = distribute_tensor(problem.teachers["logits"].logits, mesh, [Shard(1)])
        tied, separate = orda_tp.TiedTeacher(problem.teachers["tied"].hidden), problem.teachers["separate20"]
        members = [tied, _distributed(separate, mesh), orda_tp.PrecomputedTeacher(logits=logits)]
        dt = orda_tp.TeacherMixture(members, weights, combine)
        weight = distribute_tensor(problem.weight.detach(), mesh, [Shard(0)]).requires_grad_()
        bias = distribute_tensor(problem.bias.detach(), mesh, [Shard(0)]).requires_grad_()
        hidden = problem.student_hidden.detach().clone().requires_grad_()
        out = orda_tp.distillation_loss(hidden, weight, problem.labels, dt, bias=bias, **kwargs)
        grads = torch.autograd.grad(out.loss, [hidden, weight, bias])
        local = [grads[0], *(g.to_local() if hasattr(g, "to_local") else g for g in grads[1:])]
        size = -(-VOCAB // world)  # torch's even split: ⌈V / world⌉ rows per rank
        own = slice(rank * size, min((rank + 1) * size, VOCAB))
        problems += _compare(f"{combine}/DTensor", [*out, *local], [*expected, want[0], want[1][own], want[2][own]])
    return problems


def _distributed(teacher: Any, mesh: Any) -> Any:
    from torch.distributed.tensor import Shard, distribute_tensor

    bias = None if teacher.bias is None else distribute_tensor(teacher.bias, mesh, [Shard(0)])
    return orda_tp.SeparateTeacher(teacher.hidden, distribute_tensor(teacher.weight, mesh, [Shard(0)]), bias)


def _compare(label: str, actual: list[torch.Tensor], expected: list[torch.Tensor]) -> list[str]:
    problems = []
    for index, (value, want) in enumerate(zip(actual, expected)):
        if (error := relative_error(value, want)) > 1e-10:
            problems.append(f"{label}: output {index} relative error {error:.2e}")
    return problems
