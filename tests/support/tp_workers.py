"""Worker bodies of tests/test_tensor_parallel.py; each runs on every rank of a gloo group.

A worker builds the full problem (identically on every rank, from fixed seeds), gives this rank its
vocabulary shard (and, under sequence parallelism, its rows), calls the loss with ``tp_group``, and
compares in the same process with the single-device call on the full tensors:

- loss and components bitwise identical on every rank (gathered and compared with ``torch.equal``);
- equal to the single-device result (relative ‖·‖ error ≤ 1e-12 in fp64, ≤ 1e-6 in fp32);
- each rank's head gradients equal its slice of the single-device gradients; hidden gradients
  equal the full ones (replicated hidden) or this rank's rows (sequence parallel).

Workers return a list of mismatch descriptions (empty when everything agrees), or plain data that
the test asserts on (collective counts, error messages).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

import orda_tp
from orda_tp import KL_VARIANTS, ChunkSize, KernelConfig
from orda_tp.engine import gradient_gemms
from orda_tp.engine.workspace import CHUNKS_PER_GROUP

from . import cases
from .cases import (
    COTRAINED,
    TEACHER_MODES,
    Columns,
    Problem,
    Rows,
    leaf,
    loss_and_grads,
    make_problem,
    relative_error,
    shard_problem,
    stable_seed,
)
from .distributed import note

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-6}
DTYPES = (torch.float64, torch.float32)
REDUCTIONS = ("mean", "sum", "none")
# Several row chunks per call (19 valid rows of 24 → 4 chunks) and uneven column blocks.
TP_CHUNKS = KernelConfig(chunk_size=ChunkSize(nrows=5), vocab_block=64)
ROWS = 24  # divisible by 2, 3 and 4 (sequence parallel); every 5th row ignored
VOCAB = 203  # uneven over 2, 3 and 4 ranks in torch.chunk order
# A sample that exercises every kind of statistic (label column, entropy over the real vocabulary,
# powers, contrasts, co-training) for the special layouts, where the full matrix would be slow.
SAMPLE_VARIANTS = ("forward", "reverse", "mutual", "cojeffreys", "entropy_adaptive", "renyi", "dkd", "triangular")


# ---------------------------------------------------------------------------- problems and shards


def call_kwargs(variant: str, mode: str, reduction: str) -> dict[str, object]:
    """The equivalence tests' keywords on the torch backend with small row chunks; the student's
    entropy reported for "sum" and "none" (its round-2 column summed over the shards), not for "mean"."""
    kwargs = {**cases.call_kwargs(variant, mode, reduction), "backend": "torch", "config": TP_CHUNKS}
    return {**kwargs, "student_entropy": reduction != "mean"}


def full_problem(
    mode: str, dtype: torch.dtype, seed: int, vocab: int = VOCAB, rows: int = ROWS, label_limit: int | None = None
) -> Problem:
    """The single-device problem; separate teachers get hidden of the teacher head's width.
    ``label_limit`` keeps labels below it (padded vocabularies)."""
    problem = make_problem(rows=rows, vocab=vocab, seed=seed)
    if mode == "separate":
        generator = torch.Generator().manual_seed(seed + 1)
        width = problem.teacher_weight.shape[1]
        teacher_hidden = torch.randn(rows, width, generator=generator, dtype=torch.float64).requires_grad_()
        problem = replace(problem, teacher_hidden=teacher_hidden)
    if label_limit is not None:
        labels = problem.labels.clone()
        valid = labels >= 0
        labels[valid] = labels[valid] % label_limit
        problem = replace(problem, labels=labels)
    return problem.to(dtype)


def chunk_ranges(columns: int, world: int) -> list[Columns]:
    """Every rank's columns in ``torch.chunk`` order (DTensor's Shard(0) layout)."""
    sizes = [len(part) for part in torch.arange(columns).chunk(world)]
    assert len(sizes) == world, f"{columns} columns do not make {world} torch.chunk shards"
    starts = [sum(sizes[:i]) for i in range(world)]
    return [(start, start + size) for start, size in zip(starts, sizes)]


def row_range(rows: int, world: int, rank: int) -> tuple[int, int]:
    per_rank = rows // world
    return rank * per_rank, (rank + 1) * per_rank


def pad_columns(problem: Problem, total: int, fill: float = 30.0) -> Problem:
    """The same problem with head rows / logits columns appended up to ``total`` (vocab padding).

    Padded head rows are random and padded logits a large finite ``fill``: any mass leaking into
    padding shows."""
    extra = total - problem.weight.shape[0]
    generator = torch.Generator().manual_seed(99)

    def rows_like(weight: Tensor) -> Tensor:
        pad = torch.randn(extra, weight.shape[1], generator=generator, dtype=torch.float64).to(weight.dtype)
        return torch.cat([weight.detach(), pad]).requires_grad_(weight.requires_grad)

    logits = problem.teacher_logits
    return replace(
        problem,
        weight=rows_like(problem.weight),
        teacher_weight=rows_like(problem.teacher_weight),
        teacher_logits=torch.cat([logits, logits.new_full((logits.shape[0], extra), fill)], dim=1),
    )


def upstream_for(reduction: str, rows: int, dtype: torch.dtype) -> Tensor | None:
    """The gradient of a per-row loss ("none"); None for scalar losses."""
    if reduction != "none":
        return None
    return torch.rand(rows, dtype=torch.float64, generator=torch.Generator().manual_seed(7)).to(dtype)


# ---------------------------------------------------------------------------- one comparison

Reference = tuple[orda_tp.DistillationLossOutput, list[Tensor | None]]


@dataclass
class Case:
    """One tensor-parallel call and its single-device reference, on this rank.

    ``columns``/``rows`` locate this rank's part of the reference gradients; a reference head
    narrower than the padded one (``padded_columns``) has zero gradient on the padding.
    """

    label: str
    mode: str
    kwargs: dict[str, object]
    full: Problem
    local: Problem
    columns: Columns
    rows: Rows = None
    tp_kwargs: dict[str, object] = field(default_factory=dict)
    reference_kwargs: dict[str, object] = field(default_factory=dict)
    padded_columns: int | None = None
    extra_references: list[tuple[Problem, dict[str, object]]] = field(default_factory=list)
    loss_fn: Callable[..., orda_tp.DistillationLossOutput] | None = None


def _call(
    problem: Problem, mode: str, upstream: Tensor | None, loss_fn: Callable[..., Any] | None, kwargs: dict[str, object]
) -> tuple[orda_tp.DistillationLossOutput, list[Tensor | None]]:
    if loss_fn is None:
        return loss_and_grads(problem, mode, upstream, **kwargs)
    out = loss_fn(problem.student_hidden, problem.weight, problem.labels, problem.teacher(mode))
    inputs = problem.trainable(mode)
    grads = torch.autograd.grad(out.loss, inputs, grad_outputs=upstream, allow_unused=True)
    return out, list(grads)


def _plain(value: Tensor) -> Tensor:
    """A replicated DTensor output as a plain tensor (outputs are expected to be plain)."""
    if isinstance(value, DTensor):
        assert all(isinstance(p, Replicate) for p in value.placements), value.placements
        return value.to_local()
    return value


def _local_grad(grad: Tensor | None, tensor: Tensor, label: str, problems: list[str]) -> Tensor | None:
    """The local part of a gradient; a DTensor input's gradient must be a DTensor with its placements."""
    if grad is None or not isinstance(tensor, DTensor):
        if isinstance(grad, DTensor):
            problems.append(f"{label}: gradient of a plain tensor came back as a DTensor")
            return grad.to_local()
        return grad
    if not isinstance(grad, DTensor):
        problems.append(f"{label}: gradient of a DTensor input is a {type(grad).__name__}")
        return grad
    if tuple(grad.placements) != tuple(tensor.placements):
        problems.append(f"{label}: gradient placements {grad.placements} != input's {tensor.placements}")
    return grad.to_local()


def _expected_part(grad: Tensor | None, kind: str, columns: Columns, rows: Rows, padded: int | None) -> Tensor | None:
    """This rank's part of a single-device gradient: head rows ``columns`` or hidden ``rows``."""
    if grad is None:
        return None
    if kind == "head":
        if padded is not None and grad.shape[0] < padded:
            grad = torch.cat([grad, grad.new_zeros(padded - grad.shape[0], grad.shape[1])])
        return grad[columns[0] : columns[1]]
    return grad if rows is None else grad[rows[0] : rows[1]]


GRAD_KINDS = {
    "tied": ("student_hidden", "weight", "teacher_hidden"),
    "separate": ("student_hidden", "weight", "teacher_hidden", "teacher_weight"),
    "precomputed": ("student_hidden", "weight"),
}


def _pack(out: orda_tp.DistillationLossOutput, capacity: int) -> Tensor:
    """Loss and components in one fp64 vector (exact for fp32 values) of fixed length
    ``1 + capacity``: the number of values, the values, zeros."""
    values = torch.cat([_plain(value).detach().reshape(-1).double() for value in out])
    packed = torch.zeros(1 + capacity, dtype=torch.float64)
    packed[0] = values.numel()
    packed[1 : 1 + values.numel()] = values[:capacity]
    return packed


def rank_disagreement(
    label: str, out: orda_tp.DistillationLossOutput, rows: int, group: dist.ProcessGroup
) -> list[str]:
    """A problem unless this rank's loss and components (at most one (rows,) tensor per field) are
    bitwise equal to rank 0's. One fixed-size all-gather, so a wrong shape cannot desynchronize ranks."""
    packed = _pack(out, len(orda_tp.DistillationLossOutput._fields) * rows)
    gathered = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, packed, group=group)
    different = [r for r, values in enumerate(gathered) if not torch.equal(values, gathered[0])]
    if different and dist.get_rank(group) == min(different):
        return [f"{label}: loss/components of rank(s) {different} differ bitwise from rank 0's"]
    return []


def _compare(label: str, case: Case, actual: Any, actual_grads: list[Tensor | None], reference: Reference) -> list[str]:
    """Values and this rank's gradients against one single-device reference call."""
    expected, expected_grads = reference
    tolerance = TOLERANCE[case.full.weight.dtype]
    problems: list[str] = []
    for name, value, want in zip(expected._fields, actual, expected):
        value = _plain(value)
        if value.shape != want.shape:
            problems.append(f"{label}: {name} shape {tuple(value.shape)} != {tuple(want.shape)}")
        elif (error := relative_error(value, want)) > tolerance or not math.isfinite(error):
            problems.append(f"{label}: {name} relative error {error:.2e} > {tolerance:.0e}")
    inputs = case.local.trainable(case.mode)
    for name, grad, tensor, want in zip(GRAD_KINDS[case.mode], actual_grads, inputs, expected_grads):
        grad = _local_grad(grad, tensor, f"{label}: {name}", problems)
        kind = "head" if name.endswith("weight") else "hidden"
        want = _expected_part(want, kind, case.columns, case.rows, case.padded_columns)
        if (grad is None) != (want is None):
            problems.append(f"{label}: {name} grad is {'None' if grad is None else 'set'}, the reference's is not")
        elif grad is not None and want is not None:
            if grad.shape != want.shape:
                problems.append(f"{label}: {name} grad shape {tuple(grad.shape)} != {tuple(want.shape)}")
            elif (error := relative_error(grad, want)) > tolerance or not math.isfinite(error):
                problems.append(f"{label}: {name} grad relative error {error:.2e} > {tolerance:.0e}")
    return problems


def run_case(case: Case, group: dist.ProcessGroup, upstream: Tensor | None) -> list[str]:
    """Compare one tensor-parallel call with its single-device reference(s); the problems found."""
    note(case.label)
    references = [(case.full, case.reference_kwargs), *case.extra_references]
    expected = [loss_and_grads(full, case.mode, upstream, **{**case.kwargs, **extra}) for full, extra in references]
    try:
        actual, actual_grads = _call(case.local, case.mode, upstream, case.loss_fn, {**case.kwargs, **case.tp_kwargs})
    except Exception as error:  # noqa: BLE001 - reported with the case's label
        return [f"{case.label}: raised {type(error).__name__}: {error}"]
    problems = rank_disagreement(case.label, actual, case.full.labels.shape[0], group)
    for index, reference in enumerate(expected):
        label = case.label if len(expected) == 1 else f"{case.label} (reference {index})"
        problems += _compare(label, case, actual, actual_grads, reference)
    return problems


def expect_value_error(label: str, problem: Problem, mode: str, kwargs: dict[str, object], match: str) -> list[str]:
    """A call that must raise ValueError (naming ``match``) on this rank."""
    note(label)
    try:
        loss_and_grads(problem, mode, None, **kwargs)
    except ValueError as error:
        return [] if match in str(error) else [f"{label}: ValueError without {match!r}: {error}"]
    except Exception as error:  # noqa: BLE001
        return [f"{label}: raised {type(error).__name__} instead of ValueError: {error}"]
    return [f"{label}: no error"]


# ---------------------------------------------------------------------------- the full matrix


def plain_case(
    label: str,
    variant: str,
    mode: str,
    reduction: str,
    dtype: torch.dtype,
    columns: Columns,
    rows: Rows = None,
    vocab: int = VOCAB,
    batch: int = ROWS,
    **tp_kwargs: object,
) -> Case:
    """A case on plain local shards with ``tp_group=WORLD`` (and any extra tp keywords)."""
    full = full_problem(mode, dtype, stable_seed(variant, mode, reduction, vocab), vocab=vocab, rows=batch)
    return Case(
        label=label,
        mode=mode,
        kwargs=call_kwargs(variant, mode, reduction),
        full=full,
        local=shard_problem(full, columns, rows),
        columns=columns,
        rows=rows,
        tp_kwargs={"tp_group": dist.group.WORLD, **tp_kwargs},
    )


def matrix_worker(rank: int, world: int) -> list[str]:
    """Every variant × teacher mode × reduction × dtype on torch.chunk shards of V=203."""
    columns = chunk_ranges(VOCAB, world)[rank]
    problems: list[str] = []
    for variant in KL_VARIANTS:
        for mode in TEACHER_MODES:
            for reduction in REDUCTIONS:
                for dtype in DTYPES:
                    label = f"world={world} {variant}/{mode}/{reduction}/{str(dtype)[6:]}"
                    case = plain_case(label, variant, mode, reduction, dtype, columns)
                    if variant in COTRAINED and mode == "precomputed":
                        kwargs = {**case.kwargs, **case.tp_kwargs}
                        problems += expect_value_error(label, case.local, mode, kwargs, "PrecomputedTeacher")
                        continue
                    problems += run_case(case, dist.group.WORLD, upstream_for(reduction, ROWS, dtype))
    return problems


# ---------------------------------------------------------------------------- special layouts


def _sample_cases(
    tag: str, build: Callable[..., Case], dtypes: Sequence[torch.dtype] = (torch.float64,)
) -> Iterator[tuple[Case, Tensor | None]]:
    """SAMPLE_VARIANTS × teacher modes (co-trained variants skip precomputed), the reductions
    taken in turn, for each of ``dtypes``."""
    pairs = [(v, m) for v in SAMPLE_VARIANTS for m in TEACHER_MODES if not (v in COTRAINED and m == "precomputed")]
    for index, (variant, mode) in enumerate(pairs):
        reduction = REDUCTIONS[index % len(REDUCTIONS)]
        for dtype in dtypes:
            label = f"{tag} {variant}/{mode}/{reduction}/{str(dtype)[6:]}"
            yield build(label, variant, mode, reduction, dtype), upstream_for(reduction, ROWS, dtype)


def run_cases(cases: Iterator[tuple[Case, Tensor | None]]) -> list[str]:
    problems: list[str] = []
    for case, upstream in cases:
        problems += run_case(case, dist.group.WORLD, upstream)
    return problems


def uneven_worker(rank: int, world: int) -> list[str]:
    """V=1001 over the ranks in torch.chunk order (251, 251, 251, 248 over 4), default vocab_range."""
    columns = chunk_ranges(1001, world)[rank]

    def build(label: str, variant: str, mode: str, reduction: str, dtype: torch.dtype) -> Case:
        return plain_case(label, variant, mode, reduction, dtype, columns, vocab=1001)

    return run_cases(_sample_cases("V=1001", build))


def permuted_partition(boundaries: Sequence[int], owner_of_block: Sequence[int], rank: int) -> Columns:
    """This rank's block when block ``i`` = [boundaries[i], boundaries[i+1]) sits on rank ``owner_of_block[i]``."""
    block = list(owner_of_block).index(rank)
    return boundaries[block], boundaries[block + 1]


def permuted_worker(rank: int, world: int) -> list[str]:
    """An explicit vocab_range partition that is not in rank order: rank 0 holds the last block."""
    assert world == 4
    columns = permuted_partition((0, 37, 60, 150, 203), (1, 3, 2, 0), rank)

    def build(label: str, variant: str, mode: str, reduction: str, dtype: torch.dtype) -> Case:
        return plain_case(label, variant, mode, reduction, dtype, columns, vocab_range=columns)

    return run_cases(_sample_cases(f"vocab_range={columns}", build))


def padded_case(
    label: str,
    variant: str,
    mode: str,
    reduction: str,
    dtype: torch.dtype,
    columns: Columns,
    total: int,
    vocab_size: int,
    **tp_kwargs: object,
) -> Case:
    """Head padded to ``total`` rows, real vocabulary ``vocab_size``. Two references: the call on
    the real columns only, and the padded full head with ``vocab_size`` on one device."""
    real = full_problem(mode, dtype, stable_seed(variant, mode, reduction, "pad"), label_limit=vocab_size)
    real = replace(
        real,
        weight=leaf(real.weight[:vocab_size]),
        teacher_weight=leaf(real.teacher_weight[:vocab_size]),
        teacher_logits=real.teacher_logits[:, :vocab_size].clone(),
    )
    padded = pad_columns(real, total)
    return Case(
        label=label,
        mode=mode,
        kwargs=call_kwargs(variant, mode, reduction),
        full=real,
        local=shard_problem(padded, columns),
        columns=columns,
        tp_kwargs={"tp_group": dist.group.WORLD, "vocab_size": vocab_size, **tp_kwargs},
        padded_columns=total,
        extra_references=[(padded, {"vocab_size": vocab_size})],
    )


def padded_worker(rank: int, world: int) -> list[str]:
    """Padding that spans two ranks: 208 = 4 × 52 head rows, vocab_size=150 (rank 2 holds columns
    150..155 of padding, rank 3 only padding); and a permuted explicit partition whose padding
    (170..207) lies on ranks 3 and 0. The gradient buffers come filled with NaN (``NanFilledEmpty``):
    what the gradient GEMMs leave unwritten, a shard's padding rows, must still be zeroed."""
    assert world == 4
    gradient_gemms.torch = cases.NanFilledEmpty()  # type: ignore[assignment]  # this worker process only
    default = chunk_ranges(208, world)[rank]
    permuted = permuted_partition((0, 60, 120, 180, 208), (1, 2, 3, 0), rank)
    chunked = partial(padded_case, columns=default, total=208, vocab_size=150)
    explicit = partial(padded_case, columns=permuted, total=208, vocab_size=170, vocab_range=permuted)
    return run_cases(_sample_cases("pad 208→150 chunked", chunked)) + run_cases(
        _sample_cases("pad 208→170 permuted", explicit)
    )


def sequence_parallel_worker(rank: int, world: int) -> list[str]:
    """``sequence_parallel=True``: hidden rows sharded over the ranks, labels full."""
    columns = chunk_ranges(VOCAB, world)[rank]
    rows = row_range(ROWS, world, rank)

    def build(label: str, variant: str, mode: str, reduction: str, dtype: torch.dtype) -> Case:
        return plain_case(label, variant, mode, reduction, dtype, columns, rows, sequence_parallel=True)

    return run_cases(_sample_cases(f"world={world} sequence_parallel", build, DTYPES))


def module_worker(rank: int, world: int) -> list[str]:
    """``DistillationLoss(tp_group=..., vocab_size=..., sequence_parallel=...)`` as a module."""
    columns = chunk_ranges(VOCAB, world)[rank]
    rows = row_range(ROWS, world, rank)
    problems: list[str] = []
    for sequence_parallel in (False, True):
        for mode in TEACHER_MODES:
            label = f"DistillationLoss sp={sequence_parallel} {mode}"
            case = plain_case(
                label, "jeffreys", mode, "mean", torch.float64, columns, rows if sequence_parallel else None
            )
            tp_kwargs = {**case.tp_kwargs, "sequence_parallel": sequence_parallel, "vocab_size": VOCAB}
            case.loss_fn = orda_tp.DistillationLoss(**case.kwargs, **tp_kwargs)
            case.tp_kwargs = {}
            problems += run_case(case, dist.group.WORLD, None)
    return problems


def edge_worker(rank: int, world: int) -> list[str]:
    """Calls with few or no statistics: every row ignored, CE only (kl_weight=0), with the entropy
    or the entropy alone (round 2 without a KL term), KL only (student_ce_weight=0), and
    ``num_valid_tokens`` as a number and as a tensor."""
    columns = chunk_ranges(VOCAB, world)[rank]
    variations: dict[str, dict[str, object]] = {
        "ce only": {"kl_weight": 0.0},
        "ce and entropy": {"kl_weight": 0.0, "student_entropy": True},
        "entropy only": {"kl_weight": 0.0, "student_ce_weight": 0.0, "teacher_ce_weight": 0.0, "student_entropy": True},
        "kl only": {"student_ce_weight": 0.0, "teacher_ce_weight": 0.0},
        "num_valid_tokens=40.0": {"num_valid_tokens": 40.0},
        "num_valid_tokens=tensor(33.)": {"num_valid_tokens": torch.tensor(33.0, dtype=torch.float64)},
    }
    problems: list[str] = []
    for mode in TEACHER_MODES:
        case = plain_case(f"all rows ignored {mode}", "reverse", mode, "mean", torch.float64, columns)
        ignored = torch.full_like(case.full.labels, -100)
        case.full, case.local = replace(case.full, labels=ignored), replace(case.local, labels=ignored.clone())
        problems += run_case(case, dist.group.WORLD, None)
        for name, extra in variations.items():
            case = plain_case(f"{name} {mode}", "jeffreys", mode, "mean", torch.float64, columns)
            case.kwargs.update(extra)
            problems += run_case(case, dist.group.WORLD, None)
    return problems


def layout_change_worker(rank: int, world: int) -> list[str]:
    """A later call whose shard sizes change on some ranks only (rank 0's shard stays the same):
    every rank must see the new layout, although rank 0's own shapes repeat."""
    assert world == 3
    problems: list[str] = []
    for boundaries in ((0, 68, 136, 203), (0, 68, 130, 203), (0, 68, 136, 203)):
        columns = (boundaries[rank], boundaries[rank + 1])
        label = f"default partition {boundaries}"
        problems += run_case(
            plain_case(label, "forward", "tied", "mean", torch.float64, columns), dist.group.WORLD, None
        )
    return problems


# ---------------------------------------------------------------------------- DTensor inputs


def _distribute(tensor: Tensor, mesh: DeviceMesh, placements: list[Placement]) -> Tensor:
    """A DTensor leaf from a full tensor that is identical on every rank."""
    return distribute_tensor(tensor.detach(), mesh, placements).requires_grad_(tensor.requires_grad)


def _from_local(tensor: Tensor, mesh: DeviceMesh, placements: list[Placement]) -> Tensor:
    """A DTensor leaf around this rank's local part."""
    local = tensor.detach().clone()
    return DTensor.from_local(local, mesh, placements, run_check=False).requires_grad_(tensor.requires_grad)


def dtensor_1d_worker(rank: int, world: int) -> list[str]:
    """A 1-D mesh: weight (and separate teacher weight) Shard(0); hidden plain, Replicate, or
    Shard(0) (sequence parallel); cached logits plain shards or Shard(-1)."""
    mesh = init_device_mesh("cpu", (world,))
    columns = chunk_ranges(VOCAB, world)[rank]
    rows = row_range(ROWS, world, rank)
    problems: list[str] = []
    for hidden_layout in ("plain", "replicate", "shard"):
        for mode in TEACHER_MODES:
            for reduction in ("mean", "none"):
                for variant in ("forward", "mutual", "dkd"):
                    if variant in COTRAINED and mode == "precomputed":
                        continue
                    label = f"1-D mesh hidden={hidden_layout} {variant}/{mode}/{reduction}"
                    full = full_problem(mode, torch.float64, stable_seed(variant, mode, reduction, "dt"))
                    local = _dtensor_problem(full, mesh, hidden_layout, sharded_logits=hidden_layout != "plain")
                    case = Case(
                        label=label,
                        mode=mode,
                        kwargs=call_kwargs(variant, mode, reduction),
                        full=full,
                        local=local,
                        columns=columns,
                        rows=rows if hidden_layout == "shard" else None,
                    )
                    problems += run_case(case, dist.group.WORLD, upstream_for(reduction, ROWS, torch.float64))
    return problems


def _dtensor_problem(full: Problem, mesh: DeviceMesh, hidden_layout: str, sharded_logits: bool) -> Problem:
    """1-D mesh DTensor inputs; ``hidden_layout`` is "plain", "replicate" or "shard"."""
    columns = chunk_ranges(full.weight.shape[0], mesh.size())[mesh.get_local_rank()]

    def hidden(tensor: Tensor) -> Tensor:
        if hidden_layout == "plain":
            return leaf(tensor)
        return _distribute(tensor, mesh, [Replicate() if hidden_layout == "replicate" else Shard(0)])

    logits = full.teacher_logits
    return Problem(
        student_hidden=hidden(full.student_hidden),
        weight=_distribute(full.weight, mesh, [Shard(0)]),
        labels=full.labels.clone(),
        teacher_hidden=hidden(full.teacher_hidden),
        teacher_weight=_distribute(full.teacher_weight, mesh, [Shard(0)]),
        teacher_logits=(
            distribute_tensor(logits, mesh, [Shard(-1)]) if sharded_logits else logits[:, columns[0] : columns[1]]
        ),
    )


def dtensor_2d_worker(rank: int, world: int) -> list[str]:
    """A (dp=2, tp=2) mesh: heads [Replicate(), Shard(0)] (the tp group is inferred, not WORLD);
    each dp group has its own rows (plain hidden, or [Replicate(), Shard(0)] sequence parallel)
    and its own cached logits ([Replicate(), Shard(-1)])."""
    assert world == 4
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    columns = chunk_ranges(VOCAB, 2)[tp]
    problems: list[str] = []
    for sequence_parallel in (False, True):
        rows = row_range(ROWS, 2, tp) if sequence_parallel else None
        for mode in TEACHER_MODES:
            for variant in ("reverse", "cojeffreys"):
                if variant in COTRAINED and mode == "precomputed":
                    continue
                label = f"2-D mesh dp={dp} sp={sequence_parallel} {variant}/{mode}"
                full = _dp_problem(mode, stable_seed(variant, mode), dp)
                local = _dtensor_2d_problem(full, mesh, columns, rows)
                case = Case(label, mode, call_kwargs(variant, mode, "sum"), full, local, columns, rows)
                problems += run_case(case, mesh.get_group("tp"), None)
    return problems


def _dp_problem(mode: str, seed: int, dp: int) -> Problem:
    """Heads from ``seed`` (the same on every rank); rows, labels and cached logits per dp group."""
    heads = full_problem(mode, torch.float64, seed)
    rows = full_problem(mode, torch.float64, seed + 1000 * (dp + 1))
    return replace(
        heads,
        student_hidden=rows.student_hidden,
        labels=rows.labels,
        teacher_hidden=rows.teacher_hidden,
        teacher_logits=rows.teacher_logits,
    )


def _dtensor_2d_problem(full: Problem, mesh: DeviceMesh, columns: Columns, rows: Rows) -> Problem:
    head = [Replicate(), Shard(0)]

    def hidden(tensor: Tensor) -> Tensor:
        if rows is None:
            return leaf(tensor)
        return _from_local(tensor[rows[0] : rows[1]], mesh, [Replicate(), Shard(0)])

    return Problem(
        student_hidden=hidden(full.student_hidden),
        weight=_distribute(full.weight, mesh, head),
        labels=full.labels.clone(),
        teacher_hidden=hidden(full.teacher_hidden),
        teacher_weight=_distribute(full.teacher_weight, mesh, head),
        teacher_logits=_from_local(full.teacher_logits[:, columns[0] : columns[1]], mesh, [Replicate(), Shard(-1)]),
    )


# ---------------------------------------------------------------------------- collective counting

COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "all_gather_coalesced",
    "all_reduce",
    "all_reduce_coalesced",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)


class CollectiveCounter:
    """Counts the torch.distributed collectives issued inside :meth:`patched` (outermost calls
    only: ``all_gather_object`` calling ``all_gather`` counts once).

    Patches the functions on ``torch.distributed``, ``torch.distributed.distributed_c10d`` and on
    every loaded ``orda_tp`` module that imported one by name.
    """

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._depth = 0

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                self.calls.append(name)
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    @contextmanager
    def patched(self) -> Iterator[CollectiveCounter]:
        modules = [dist, c10d] + [m for n, m in sorted(sys.modules.items()) if n.startswith("orda_tp") and m]
        saved: list[tuple[object, str, object]] = []
        for name in COLLECTIVES:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapper = self._wrap(name, original)
            for module in modules:
                if getattr(module, name, None) is original:
                    saved.append((module, name, original))
                    setattr(module, name, wrapper)
        try:
            yield self
        finally:
            for module, name, original in saved:
                setattr(module, name, original)

    def count(self, action: Callable[[], object]) -> list[str]:
        """The collectives that ``action()`` issues."""
        self.calls = []
        action()
        return list(self.calls)


def counting_worker(rank: int, world: int) -> dict[str, dict[str, Any]]:
    """Collectives of a first (warm-up) call, a second and a third call with the same shapes, and a
    no-grad call, for replicated and sequence-parallel hidden states."""
    columns = chunk_ranges(VOCAB, world)[rank]
    # (variant, teacher mode, batch rows, sequence parallel): every scenario a new layout.
    scenarios = {
        "tied forward": ("forward", "tied", 24, False),
        "separate reverse": ("reverse", "separate", 26, False),
        "precomputed skew_js": ("skew_js", "precomputed", 28, False),
        "tied jeffreys, sequence parallel": ("jeffreys", "tied", 30 * world, True),
        "separate dkd, sequence parallel": ("dkd", "separate", 12 * world, True),
    }
    report: dict[str, dict[str, Any]] = {}
    counter = CollectiveCounter()
    for name, (variant, mode, batch, sequence_parallel) in scenarios.items():
        note(f"counting {name}")
        rows = row_range(batch, world, rank) if sequence_parallel else None
        extra = {"sequence_parallel": True} if sequence_parallel else {}
        case = plain_case(name, variant, mode, "mean", torch.float64, columns, rows, batch=batch, **extra)
        kwargs = {**case.kwargs, **case.tp_kwargs}

        def call(case: Case = case, kwargs: dict[str, object] = kwargs) -> None:
            loss_and_grads(case.local, case.mode, None, **kwargs)

        def no_grad_call(case: Case = case, kwargs: dict[str, object] = kwargs) -> None:
            with torch.no_grad():
                loss_and_grads(case.local, case.mode, None, **kwargs)

        with counter.patched():
            calls = [counter.count(call) for _ in range(3)] + [counter.count(no_grad_call)]
        row_chunks = -(-batch // TP_CHUNKS.chunk_size.nrows)  # chunks cover every row, ignored ones too
        _, grads = loss_and_grads(case.local, case.mode, None, **kwargs)
        hidden = (case.local.student_hidden, case.local.teacher_hidden)
        trainable = case.local.trainable(case.mode)
        report[name] = {
            "sequence_parallel": sequence_parallel,
            "row_chunks": row_chunks,
            "row_groups": -(-row_chunks // CHUNKS_PER_GROUP),
            "hidden_grads": sum(g is not None and any(t is h for h in hidden) for t, g in zip(trainable, grads)),
            "calls": calls,
        }
    return report


HOST_READS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "nonzero", "numpy")


@contextmanager
def counted_host_reads(reads: list[tuple[str, tuple[int, ...]]]) -> Iterator[None]:
    """Each way Python code reads a tensor's value on the host (on CUDA each synchronizes with
    the device) appended to ``reads`` with the tensor's shape, then done."""
    originals = {name: getattr(Tensor, name) for name in HOST_READS}

    def counting(name: str) -> Callable[..., object]:
        def read(self: Tensor, *args: object, **kwargs: object) -> object:
            reads.append((name, tuple(self.shape)))
            return originals[name](self, *args, **kwargs)

        return read

    try:
        for name in HOST_READS:
            setattr(Tensor, name, counting(name))
        yield
    finally:
        for name, original in originals.items():
            setattr(Tensor, name, original)


def host_reads_worker(rank: int, world: int) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """The host reads of a forward + backward with host checks off (a CUDA call's default), per
    teacher mode: a teacher read through a head has no local value check, a cache has."""
    columns = chunk_ranges(VOCAB, world)[rank]
    report = {}
    for mode in ("tied", "separate", "precomputed"):
        case = plain_case(f"host reads {mode}", "forward", mode, "mean", torch.float64, columns)
        kwargs = {**case.kwargs, **case.tp_kwargs, "config": replace(TP_CHUNKS, host_checks=False)}
        reads: list[tuple[str, tuple[int, ...]]] = []
        with counted_host_reads(reads):
            loss_and_grads(case.local, case.mode, None, **kwargs)
        report[mode] = reads
    return report


def device_checks_worker(rank: int, world: int) -> dict[str, list[float]]:
    """With host checks off (a CUDA call's default) the handshake reads nothing of the device:
    labels that differ on one rank, and a full head passed on every rank, make every value and
    gradient NaN on every rank instead of raising; good inputs give the single-device result.
    Per scenario: the loss, whether every gradient entry is NaN, and the relative error against
    the single-device loss (NaN when not compared)."""
    group, off = dist.group.WORLD, replace(TP_CHUNKS, host_checks=False)
    full = full_problem("tied", torch.float64, 11)
    columns = chunk_ranges(VOCAB, world)[rank]
    kwargs = {**call_kwargs("forward", "tied", "mean"), "config": off, "tp_group": group}
    expected, _ = loss_and_grads(full, "tied", None, **call_kwargs("forward", "tied", "mean"))
    report = {}
    shard = shard_problem(full, columns, None)
    scenarios = {
        "good": shard,
        "labels differ": _change_a_label(shard) if rank == 1 else shard,
        "full head on every rank": full,
    }
    for name, local in scenarios.items():
        out, grads = loss_and_grads(local, "tied", None, **kwargs)
        valid = local.labels != -100
        # An ignored row's hidden gradient is exactly 0 whatever the statistics hold.
        counted = [g[valid] if g.shape[0] == valid.shape[0] else g for g in grads if g is not None]
        all_nan = all(bool(torch.isnan(g).all()) for g in counted)
        error = relative_error(out.loss, expected.loss) if name == "good" else math.nan
        report[name] = [float(out.loss.detach()), float(all_nan), error]
    return report


def gloo_twin_worker(rank: int, world: int) -> list[object]:
    """The gloo twin of a group: its ranks, the same object on a second call, and a gather of
    host values through it."""
    from orda_tp.parallel.collectives import all_gather_rows, gloo_twin

    twin = gloo_twin(dist.group.WORLD)
    again = gloo_twin(dist.group.WORLD)
    gathered = all_gather_rows(torch.tensor([[rank, 10 * rank]]), twin).tolist()
    return [dist.get_process_group_ranks(twin), twin is again, gathered]


# ---------------------------------------------------------------------------- rank-consistent errors

ERROR_WORLD = 3
ERROR_COLUMNS = ((0, 68), (68, 136), (136, 203))  # torch.chunk order of 203 over 3
Edit = Callable[[Problem], Problem]


def _error_call(
    rank: int, group: dist.ProcessGroup, mode: str, edit: Edit | None = None, rows: Rows = None, **tp_kwargs: object
) -> None:
    """One forward-KL call on this rank's shard (and ``rows``), with ``edit`` applied to it."""
    local = shard_problem(full_problem(mode, torch.float64, 5), ERROR_COLUMNS[rank], rows)
    if edit is not None:
        local = edit(local)
    loss_and_grads(local, mode, None, **call_kwargs("forward", mode, "mean"), tp_group=group, **tp_kwargs)


def _with_logit(value: float) -> Edit:
    def edit(problem: Problem) -> Problem:
        logits = problem.teacher_logits.clone()
        logits[3, 5] = value
        return replace(problem, teacher_logits=logits)

    return edit


def _drop_head_row(problem: Problem) -> Problem:
    return replace(problem, weight=leaf(problem.weight[:-1]))


def _drop_teacher_head_row(problem: Problem) -> Problem:
    return replace(problem, teacher_weight=leaf(problem.teacher_weight[:-1]))


def _drop_logits_column(problem: Problem) -> Problem:
    return replace(problem, teacher_logits=problem.teacher_logits[:, :-1].clone())


def _change_a_label(problem: Problem) -> Problem:
    labels = problem.labels.clone()
    labels[1] = (labels[1] + 1) % VOCAB
    return replace(problem, labels=labels)


def _drop_hidden_row(problem: Problem) -> Problem:
    return replace(problem, student_hidden=leaf(problem.student_hidden[:-1]))


def _on(target: int, rank: int, edit: Edit) -> Edit | None:
    return edit if rank == target else None


def _explicit_partition(rank: int, group: dist.ProcessGroup, partition: tuple[Columns, ...]) -> None:
    """Each rank passes the head rows of its ``vocab_range`` in ``partition`` (which is invalid)."""
    start, stop = partition[rank]
    weight = full_problem("tied", torch.float64, 5).weight

    def edit(problem: Problem) -> Problem:
        return replace(problem, weight=leaf(weight[start:stop]))

    _error_call(rank, group, "tied", edit, vocab_range=(start, stop))


def _nan_after_warm_up(rank: int, group: dist.ProcessGroup) -> None:
    _error_call(rank, group, "precomputed")
    _error_call(rank, group, "precomputed", _on(0, rank, _with_logit(math.nan)))


def _bad_shard_after_warm_up(rank: int, group: dist.ProcessGroup) -> None:
    _error_call(rank, group, "tied", vocab_range=ERROR_COLUMNS[rank])
    _error_call(rank, group, "tied", _on(1, rank, _drop_head_row), vocab_range=ERROR_COLUMNS[rank])


def _sequence_rows_differ(rank: int, group: dist.ProcessGroup) -> None:
    rows = row_range(ROWS, ERROR_WORLD, rank)
    _error_call(rank, group, "tied", _on(1, rank, _drop_hidden_row), rows, sequence_parallel=True)


# Each scenario is invalid on one rank only (or as a whole partition) and must raise everywhere.
ERROR_SCENARIOS: dict[str, Callable[[int, dist.ProcessGroup], None]] = {
    "nan in one logits shard": lambda r, g: _error_call(r, g, "precomputed", _on(1, r, _with_logit(math.nan))),
    "+inf in one logits shard": lambda r, g: _error_call(r, g, "precomputed", _on(2, r, _with_logit(math.inf))),
    "nan in one logits shard after a warm-up call": _nan_after_warm_up,
    "shard size disagrees with its vocab_range": lambda r, g: _error_call(
        r, g, "tied", _on(1, r, _drop_head_row), vocab_range=ERROR_COLUMNS[r]
    ),
    "shard size disagrees with its vocab_range after a warm-up call": _bad_shard_after_warm_up,
    "vocab_range partition with a gap": lambda r, g: _explicit_partition(r, g, ((0, 68), (70, 138), (138, 203))),
    "vocab_range partition with an overlap": lambda r, g: _explicit_partition(r, g, ((0, 68), (60, 128), (128, 203))),
    "vocab_range on one rank only": lambda r, g: _error_call(
        r, g, "tied", vocab_range=ERROR_COLUMNS[r] if r == 1 else None
    ),
    "teacher head shard size differs on one rank": lambda r, g: _error_call(
        r, g, "separate", _on(2, r, _drop_teacher_head_row)
    ),
    "cached logits shard size differs on one rank": lambda r, g: _error_call(
        r, g, "precomputed", _on(0, r, _drop_logits_column)
    ),
    "sequence-parallel rows differ on one rank": _sequence_rows_differ,
    "labels differ on one rank": lambda r, g: _error_call(r, g, "tied", _on(2, r, _change_a_label)),
}


def error_worker(rank: int, world: int, name: str) -> tuple[str, str, float]:
    """``(exception type, message, seconds)`` of scenario ``name`` on this rank; ("", "", seconds)
    when nothing was raised."""
    note(name)
    start = time.monotonic()
    try:
        ERROR_SCENARIOS[name](rank, dist.group.WORLD)
    except Exception as error:  # noqa: BLE001 - the test compares types and messages across ranks
        return type(error).__name__, str(error), time.monotonic() - start
    return "", "", time.monotonic() - start
