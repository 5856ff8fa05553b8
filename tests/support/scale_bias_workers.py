"""Gloo workers of tests/test_scale_bias.py: logit scales and biased heads on vocabulary shards
(plain shards with ``tp_group``, uneven and padded, sequence parallel; DTensor Shard(0) weights and
biases; the Triton kernels), each call against the single-device call on the full tensors (values
≤ 1e-12 in fp64, bitwise alike on every rank; head and bias gradients this rank's slice of the
single-device ones); misplaced biases raising on every rank; and a biased teacher head under FSDP2."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import orda_tp

from .cases import relative_error, stable_seed
from .distributed import note
from .scale_bias import HEAD_KINDS, VOCAB, Biased, keywords, make_biased, raw_teacher_logits, teacher_of, topk_cache
from .tp_workers import TP_CHUNKS, chunk_ranges, rank_disagreement, row_range

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-6}
HIDDEN_FIELDS = ("hidden", "tied_hidden", "teacher_hidden")
HEAD_FIELDS = ("weight", "bias", "teacher_weight", "teacher_bias")


@dataclass
class ShardCase:
    """One call on this rank's shards (``columns`` of the heads, all rows or ``rows``) against the
    single-device call on ``full``; ``layout``: "plain" (tp_group), "dtensor" or "dtensor_sp"."""

    label: str
    kind: str
    kw: dict[str, Any]
    full: Biased
    columns: tuple[int, int]
    rows: tuple[int, int] | None = None
    layout: str = "plain"


def _local(full: Biased, case: ShardCase, mesh: DeviceMesh | None) -> Biased:
    """This rank's leaves: head rows ``case.columns`` and hidden rows (all, or ``case.rows``), as
    plain tensors or DTensors (heads Shard(0); hidden Replicate, or Shard(0) for "dtensor_sp")."""
    start, stop = case.columns
    values: dict[str, Tensor] = {"labels": full.labels.clone()}
    for name in HIDDEN_FIELDS + HEAD_FIELDS:
        tensor = getattr(full, name).detach()
        if case.layout != "plain":
            assert mesh is not None
            sharded = name in HEAD_FIELDS or case.layout == "dtensor_sp"
            values[name] = distribute_tensor(tensor, mesh, [Shard(0) if sharded else Replicate()])
        elif name in HEAD_FIELDS:
            values[name] = tensor[start:stop].clone()
        else:
            values[name] = tensor if case.rows is None else tensor[case.rows[0] : case.rows[1]].clone()
    return Biased(**{name: v if name == "labels" else v.requires_grad_() for name, v in values.items()})


def _teacher(local: Biased, full: Biased, case: ShardCase, vocab_size: int) -> tuple[Any, list[Tensor]]:
    """A head kind over this rank's shards; a cache of logits this rank's columns of the full one,
    a top-k cache whole on every rank (its ids are global)."""
    if case.kind in HEAD_KINDS:
        return teacher_of(local, case.kind, vocab_size)
    if case.kind == "logits_cache":
        start, stop = case.columns
        return orda_tp.PrecomputedTeacher(logits=raw_teacher_logits(full)[:, start:stop].to(full.weight.dtype)), []
    ids, logprobs = topk_cache(full, vocab_size)
    return orda_tp.PrecomputedTeacher(topk_ids=ids, topk_logprobs=logprobs, retemper=True), []


def _grads(out: Any, inputs: list[Tensor], upstream: Tensor | None) -> list[Tensor | None]:
    return list(torch.autograd.grad(out.loss, inputs, grad_outputs=upstream, allow_unused=True))


def _expected_part(grad: Tensor | None, name: str, case: ShardCase) -> Tensor | None:
    """This rank's part of a single-device gradient: head rows, or hidden rows under sequence parallelism."""
    if grad is None:
        return None
    if name in ("weight", "bias", "teacher weight", "teacher bias"):
        return grad[case.columns[0] : case.columns[1]]
    rows = case.rows
    if case.layout == "dtensor_sp":
        rows = row_range(grad.shape[0], dist.get_world_size(), dist.get_rank())
    return grad if rows is None else grad[rows[0] : rows[1]]


def run_shard_case(case: ShardCase, mesh: DeviceMesh | None) -> list[str]:
    """The call on this rank's shards against the single-device call; the mismatches found."""
    note(case.label)
    full, dtype = case.full, case.full.weight.dtype
    vocab_size = case.kw.get("vocab_size") or full.weight.shape[0]
    upstream = None
    if case.kw["reduction"] == "none":
        upstream = torch.rand(full.labels.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(7))
        upstream = upstream.to(dtype)
    whole = full.to(dtype)
    teacher, trained = _teacher(whole, full, replace(case, columns=(0, full.weight.shape[0])), vocab_size)
    expected = orda_tp.distillation_loss(
        whole.hidden, whole.weight, whole.labels, teacher, bias=whole.bias, config=TP_CHUNKS, **case.kw
    )
    want = _grads(expected, [whole.hidden, whole.weight, whole.bias, *trained], upstream)
    local = _local(full, case, mesh)
    teacher, trained = _teacher(local, full, case, vocab_size)
    tp: dict[str, Any] = {"tp_group": dist.group.WORLD} if case.layout == "plain" else {}
    tp.update({"sequence_parallel": True} if case.rows is not None else {})
    try:
        out = orda_tp.distillation_loss(
            local.hidden, local.weight, local.labels, teacher, bias=local.bias, config=TP_CHUNKS, **case.kw, **tp
        )
        got = _grads(out, [local.hidden, local.weight, local.bias, *trained], upstream)
    except Exception as error:  # noqa: BLE001 - reported with the case's label
        return [f"{case.label}: raised {type(error).__name__}: {error}"]
    problems = rank_disagreement(case.label, out, full.labels.shape[0], dist.group.WORLD)
    tolerance = TOLERANCE[dtype]
    for name, value, wanted in zip(expected._fields, out, expected):
        if (error := relative_error(value, wanted)) > tolerance or not math.isfinite(error):
            problems.append(f"{case.label}: {name} relative error {error:.2e}")
    names = ("hidden", "weight", "bias", "teacher hidden", "teacher weight", "teacher bias")
    for name, grad, wanted, tensor in zip(names, got, want, [local.hidden, local.weight, local.bias, *trained]):
        if isinstance(tensor, DTensor):
            if not isinstance(grad, DTensor) or tuple(grad.placements) != tuple(tensor.placements):
                problems.append(f"{case.label}: {name} grad is not a DTensor placed as its input")
                continue
            grad = grad.to_local()
        part = _expected_part(wanted, name, case)
        if (grad is None) != (part is None):
            problems.append(f"{case.label}: {name} grad is {grad is None and 'None' or 'set'}, the reference's is not")
        elif grad is not None and part is not None:
            error = relative_error(grad, part) if grad.shape == part.shape else math.inf
            if error > tolerance or not math.isfinite(error):
                problems.append(f"{case.label}: {name} grad relative error {error:.2e}")
    return problems


def _cases(rank: int, world: int) -> list[ShardCase]:
    columns = chunk_ranges(VOCAB, world)[rank]
    cases = []
    for index, kind in enumerate(("tied", "separate", "head", "hidden_cache", "logits_cache", "topk")):
        reduction, variant = ("mean", "sum", "none")[index % 3], ("forward", "skew_js")[index % 2]
        full = make_biased(stable_seed("tp", kind, reduction))
        cases.append(
            ShardCase(f"{kind}/{variant}/{reduction}", kind, keywords(kind, variant, reduction), full, columns)
        )
    cases.append(ShardCase("mutual/none", "separate", keywords("separate", "mutual", "none"), full, columns))
    # Padded: 150 real columns of 208, the padding's bias 40 (a shard of padding alone on 3 ranks' last).
    padded = make_biased(stable_seed("tp padded"), vocab=150, padded_to=208)
    for kind, reduction in (("separate", "none"), ("tied", "mean"), ("topk", "sum")):
        kw = {**keywords(kind, "reverse", reduction), "vocab_size": 150}
        cases.append(ShardCase(f"padded {kind}/{reduction}", kind, kw, padded, chunk_ranges(208, world)[rank]))
    rows = row_range(24, world, rank)
    for kind, reduction in (("separate", "mean"), ("tied", "none")):
        kw = keywords(kind, "forward", reduction)
        cases.append(ShardCase(f"sequence parallel {kind}/{reduction}", kind, kw, full, columns, rows))
    for kind, reduction, layout in (("separate", "mean", "dtensor"), ("tied", "none", "dtensor"),
                                    ("separate", "none", "dtensor_sp")):  # fmt: skip
        kw = keywords(kind, "skew_js", reduction)
        cases.append(ShardCase(f"{layout} {kind}/{reduction}", kind, kw, full, columns, layout=layout))
    fp32 = full.to(torch.float32)
    triton = {**keywords("separate", "forward", "mean"), "backend": "triton"}
    cases.append(ShardCase("triton separate/mean fp32", "separate", triton, fp32, columns))
    return cases


def _raises(label: str, call: Any, match: str) -> list[str]:
    note(label)
    try:
        call()
    except ValueError as error:
        return [] if match in str(error) else [f"{label}: ValueError without {match!r}: {error}"]
    except Exception as error:  # noqa: BLE001
        return [f"{label}: raised {type(error).__name__} instead of ValueError: {error}"]
    return [f"{label}: no error"]


def _misplaced_biases(rank: int, world: int, mesh: DeviceMesh) -> list[str]:
    """Biases that do not match their head's shard raise on every rank, naming the bias."""
    full = make_biased(5)
    start, stop = chunk_ranges(VOCAB, world)[rank]
    hidden, weight, labels = full.hidden, full.weight[start:stop], full.labels
    tied = orda_tp.TiedTeacher(full.tied_hidden)
    group = {"tp_group": dist.group.WORLD, "kl_weight": 1.0}
    dweight = distribute_tensor(full.weight, mesh, [Shard(0)])
    separate = orda_tp.SeparateTeacher(full.teacher_hidden, full.teacher_weight[start:stop], full.teacher_bias)
    calls = {
        "the whole bias beside a weight shard": (
            lambda: orda_tp.distillation_loss(hidden, weight, labels, tied, bias=full.bias, **group),
            f"bias must have shape ({stop - start},)",
        ),
        "a Replicate DTensor bias": (
            lambda: orda_tp.distillation_loss(
                hidden, dweight, labels, tied, bias=distribute_tensor(full.bias, mesh, [Replicate()]), kl_weight=1.0
            ),
            "bias as a DTensor must be Shard(0)",
        ),
        "a DTensor bias beside a plain weight": (
            lambda: orda_tp.distillation_loss(
                hidden, weight, labels, tied, bias=distribute_tensor(full.bias, mesh, [Shard(0)]), **group
            ),
            "bias is a DTensor but weight is not",
        ),
        "the whole teacher bias beside its weight shard": (
            lambda: orda_tp.distillation_loss(hidden, weight, labels, separate, **group),
            "teacher.bias must have shape",
        ),
    }
    return [problem for label, (call, match) in calls.items() for problem in _raises(label, call, match)]


def tp_worker(rank: int, world: int) -> list[str]:
    """Every case of :func:`_cases`, then the misplaced biases."""
    mesh = init_device_mesh("cpu", (world,))
    problems: list[str] = []
    for case in _cases(rank, world):
        problems += run_shard_case(case, mesh)
    return problems + _misplaced_biases(rank, world, mesh)


def fsdp_teacher_head_worker(rank: int, world: int) -> list[str]:
    """A frozen teacher model under FSDP2 whose biased head is its own unit, passed as a TeacherHead
    (with a teacher logit scale): its weight and bias gathered for the call and resharded after it
    (also with reduction "none", whose backward reads them again)."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    generator = torch.Generator().manual_seed(5 + rank)
    hidden = torch.randn(12, 8, dtype=torch.float64, generator=generator)
    teacher_hidden = torch.randn(12, 9, dtype=torch.float64, generator=generator)
    labels = torch.randint(0, 41, (12,), generator=generator)
    torch.manual_seed(1)
    teacher = nn.Sequential(nn.Linear(9, 9), nn.Linear(9, 41)).double()
    full_weight, full_bias = teacher[1].weight.detach().clone(), teacher[1].bias.detach().clone()
    teacher.requires_grad_(False)
    fully_shard(teacher[1], mesh=mesh)
    fully_shard(teacher, mesh=mesh)
    weight = torch.randn(41, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(41, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    problems: list[str] = []
    for reduction in ("mean", "none"):
        kw = dict(kl_weight=1.0, kl_divergence="reverse", reduction=reduction, logit_scale=0.8, teacher_logit_scale=1.4)
        want_hidden, got_hidden = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
        separate = orda_tp.SeparateTeacher(teacher_hidden, full_weight, full_bias)
        expected = orda_tp.distillation_loss(
            want_hidden, weight, labels, separate, bias=bias, backend="reference", **kw
        )
        expected.loss.sum().backward()
        head = orda_tp.TeacherHead(teacher_hidden, teacher[1])
        got = orda_tp.distillation_loss(got_hidden, weight, labels, head, bias=bias, backend="torch", **kw)
        got.loss.sum().backward()
        for what, value, want in (
            ("loss", got.loss, expected.loss),
            ("hidden.grad", got_hidden.grad, want_hidden.grad),
        ):
            assert value is not None and want is not None
            if (error := relative_error(value, want)) > 1e-12:
                problems.append(f"TeacherHead, reduction {reduction}: {what} relative error {error:.2e}")
        if not isinstance(teacher[1].weight, DTensor) or not isinstance(teacher[1].bias, DTensor):
            problems.append(f"TeacherHead, reduction {reduction}: the teacher head was left gathered")
    return problems
