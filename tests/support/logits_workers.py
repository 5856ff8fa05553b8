"""Worker of tests/test_logits_losses.py's tensor-parallel test; runs on every rank of a gloo group.

Each rank builds the full problem (identically, from fixed seeds), takes its vocabulary columns
(``torch.chunk`` order: uneven over 2 and 3 ranks), and compares the tensor-parallel call with the
single-device call (TP = 1) on the full logits, in the same process:

- loss (or scores) bitwise identical on every rank (gathered and compared with ``torch.equal``);
- equal to TP = 1 within 1e-12 relative (fp64) or 1e-6 (fp32);
- this rank's student-logits gradient equal to its columns of the TP = 1 gradient.

Returns the mismatches found (an empty list when everything agrees).
"""

from __future__ import annotations

import importlib.util
import time
import zlib
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import orda_tp
from orda_tp import KL_VARIANTS, KernelConfig

from .cases import VARIANT_KWARGS, relative_error
from .distributed import note
from .tp_workers import chunk_ranges

VOCAB = 61  # 31 + 30 columns over 2 ranks, 21 + 21 + 19 over 3
SHAPE = (3, 4)
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-6}


def full_logits(seed: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    student = (2 * torch.randn(*SHAPE, VOCAB, generator=generator, dtype=torch.float64)).to(dtype)
    teacher = (2 * torch.randn(*SHAPE, VOCAB, generator=generator, dtype=torch.float64)).to(dtype)
    labels = torch.randint(0, VOCAB, SHAPE, generator=generator)
    labels[0, 2] = labels[2, 0] = -100
    return student, teacher, labels


def same_on_every_rank(label: str, values: Tensor, group: dist.ProcessGroup) -> list[str]:
    """A problem unless ``values`` (same shape on every rank) are bitwise equal to rank 0's."""
    gathered = [torch.empty_like(values) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, values.contiguous(), group=group)
    different = [r for r, other in enumerate(gathered) if not torch.equal(other, gathered[0])]
    return [f"{label}: values of rank(s) {different} differ bitwise from rank 0's"] if different else []


def within(label: str, actual: Tensor, expected: Tensor, tolerance: float) -> list[str]:
    if actual.shape != expected.shape:
        return [f"{label}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"]
    error = relative_error(actual, expected)
    return [] if error <= tolerance else [f"{label}: relative error {error:.2e} > {tolerance:.0e}"]


def kd_case(
    label: str,
    rank: int,
    world: int,
    dtype: torch.dtype,
    *,
    dtensor: bool = False,
    tolerance: float | None = None,
    **kwargs,
) -> list[str]:
    """KDLoss on this rank's columns (plain shards with tp_group, or Shard(-1) DTensors with the
    group inferred and the teacher replicated) against KDLoss on the full logits (the torch
    backend's; ``tolerance`` defaults to the dtype's)."""
    note(label)
    group = dist.group.WORLD
    start, stop = chunk_ranges(VOCAB, world)[rank]
    student, teacher, labels = full_logits(zlib.crc32(label.encode()), dtype)
    call = {"num_batch_labels": kwargs.pop("num_batch_labels")} if "num_batch_labels" in kwargs else {}
    full = student.clone().requires_grad_()
    expected = orda_tp.KDLoss(**{**kwargs, "backend": "torch"})(full, teacher, labels, **call)
    (expected_grad,) = torch.autograd.grad(expected, full)
    if dtensor:
        mesh = init_device_mesh("cpu", (world,))
        local = distribute_tensor(student, mesh, [Shard(-1)]).requires_grad_()
        tp_teacher = distribute_tensor(teacher, mesh, [Replicate()])
        tp_labels = distribute_tensor(labels, mesh, [Replicate()])
        loss_fn = orda_tp.KDLoss(**kwargs)
    else:
        local = student[..., start:stop].clone().requires_grad_()
        tp_teacher, tp_labels = teacher[..., start:stop].clone(), labels
        loss_fn = orda_tp.KDLoss(tp_group=group, **kwargs)
    loss = loss_fn(local, tp_teacher, tp_labels, **call)
    (grad,) = torch.autograd.grad(loss, local)
    problems = []
    if dtensor:
        if not isinstance(grad, DTensor) or tuple(grad.placements) != (Shard(2),):
            problems.append(f"{label}: the gradient of a Shard(-1) DTensor is {type(grad).__name__} {grad}")
        grad = grad.to_local() if isinstance(grad, DTensor) else grad
    tolerance = tolerance or TOLERANCE[dtype]
    problems += same_on_every_rank(label, loss.detach().reshape(1), group)
    problems += within(f"{label} loss", loss, expected, tolerance)
    problems += within(f"{label} gradient", grad, expected_grad[..., start:stop], tolerance)
    return problems


def flash_case(label: str, rank: int, world: int, *, dtensor: bool = False, **kwargs) -> list[str]:
    """flash_ce_kd_loss on this rank's columns of the student logits and the teacher's head."""
    note(label)
    group = dist.group.WORLD
    start, stop = chunk_ranges(VOCAB, world)[rank]
    generator = torch.Generator().manual_seed(zlib.crc32(label.encode()))
    rows = SHAPE[0] * SHAPE[1]
    student = 2 * torch.randn(rows, VOCAB, generator=generator, dtype=torch.float64)
    hidden = torch.randn(rows, 5, generator=generator, dtype=torch.float64)
    weight = torch.randn(VOCAB, 5, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (rows,), generator=generator)
    labels[[1, 6]] = -1
    expected = orda_tp.flash_ce_kd_loss(student, hidden, weight, labels, **kwargs)
    if dtensor:
        mesh = init_device_mesh("cpu", (world,))
        local_student = distribute_tensor(student, mesh, [Shard(-1)])
        local_weight = distribute_tensor(weight, mesh, [Shard(0)])
        scores = orda_tp.flash_ce_kd_loss(local_student, hidden, local_weight, labels, **kwargs)
    else:
        local_student, local_weight = student[:, start:stop], weight[start:stop]
        scores = orda_tp.flash_ce_kd_loss(local_student, hidden, local_weight, labels, tp_group=group, **kwargs)
    problems = same_on_every_rank(label, torch.cat(scores), group)
    for name, value, want in zip(("ce", "kd"), scores, expected):
        problems += within(f"{label} {name}", value, want, TOLERANCE[torch.float64])
    return problems


def error_case(label: str, rank: int, world: int, change: str, match: str) -> list[str]:
    """A bad input on the last rank only: every rank raises the same ValueError, and quickly."""
    note(label)
    group = dist.group.WORLD
    start, stop = chunk_ranges(VOCAB, world)[rank]
    student, teacher, labels = full_logits(1, torch.float64)
    local_student, local_teacher, call = student[..., start:stop], teacher[..., start:stop], {}
    if rank == world - 1:
        if change == "teacher width":
            local_teacher = teacher[..., start : stop - 1]
        elif change == "labels":
            labels = labels.flip(-1)
        else:
            call["num_batch_labels"] = 0
    began = time.monotonic()
    outcome = ("", "")
    try:
        orda_tp.KDLoss(tp_group=group, chunk_size=4)(local_student, local_teacher, labels, **call)
    except Exception as error:  # noqa: BLE001 - compared across ranks below
        outcome = (type(error).__name__, str(error))
    seconds = time.monotonic() - began
    outcomes: list[object] = [None] * world
    dist.all_gather_object(outcomes, outcome, group=group)
    problems = []
    if outcome[0] != "ValueError" or match not in outcome[1]:
        problems.append(f"{label}: expected a ValueError with {match!r}, got {outcome}")
    if any(other != outcomes[0] for other in outcomes):
        problems.append(f"{label}: ranks raised different errors: {outcomes}")
    if seconds > 10:
        problems.append(f"{label}: took {seconds:.1f} s (a rank waited in a collective)")
    return problems


def unchecked_labels_case(rank: int, world: int) -> list[str]:
    """Host checks off (what KDLoss does on an NCCL group): labels that differ on the last rank
    make the loss and the logits' gradient NaN on every rank instead of raising."""
    note("labels differ, host checks off")
    start, stop = chunk_ranges(VOCAB, world)[rank]
    student, teacher, labels = full_logits(1, torch.float64)
    if rank == world - 1:
        labels = labels.flip(-1)
    local_student = student[..., start:stop].detach().requires_grad_()
    loss_fn = orda_tp.KDLoss(tp_group=dist.group.WORLD, chunk_size=4)
    loss_fn.options = replace(loss_fn.options, config=KernelConfig(host_checks=False))
    loss = loss_fn(local_student, teacher[..., start:stop], labels)
    loss.backward()
    assert local_student.grad is not None
    if not (torch.isnan(loss) and bool(torch.isnan(local_student.grad).any())):
        return [f"rank {rank}: labels differ without host checks gave loss {float(loss)}, not NaN"]
    return []


def tensor_parallel_worker(rank: int, world: int) -> list[str]:
    problems: list[str] = []
    for variant in KL_VARIANTS:
        kwargs = {"kl_divergence": variant, **VARIANT_KWARGS[variant]}
        problems += kd_case(f"{variant} fp64", rank, world, torch.float64, temperature=1.5, chunk_size=4, **kwargs)
    problems += kd_case("forward fp32 default chunks", rank, world, torch.float32, temperature=2.0)
    problems += kd_case(
        "dkd fp32 num_batch_labels", rank, world, torch.float32, chunk_size=5, num_batch_labels=17,
        kl_divergence="dkd", **VARIANT_KWARGS["dkd"],
    )  # fmt: skip
    problems += kd_case("forward DTensor", rank, world, torch.float64, dtensor=True, temperature=2.0, chunk_size=3)
    problems += kd_case(
        "entropy_adaptive DTensor", rank, world, torch.float64, dtensor=True, chunk_size=5,
        kl_divergence="entropy_adaptive", **VARIANT_KWARGS["entropy_adaptive"],
    )  # fmt: skip
    if world == 2 and importlib.util.find_spec("triton") is not None:
        # The kernels' fp32 arithmetic differs from torch's in rounding: 1e-5, as in test_triton_kernels.
        problems += kd_case(
            "skew_js triton fp32", rank, world, torch.float32, tolerance=1e-5, backend="triton", chunk_size=5,
            kl_divergence="skew_js", **VARIANT_KWARGS["skew_js"],
        )  # fmt: skip
    problems += flash_case("flash T=2", rank, world, temperature=2.0, chunk_size=8)
    problems += flash_case("flash DTensor", rank, world, dtensor=True)
    problems += error_case("teacher shard of another width", rank, world, "teacher width", "teacher_logits must have")
    problems += error_case("labels differ", rank, world, "labels", "labels must be identical on every rank")
    problems += error_case("num_batch_labels on one rank", rank, world, "count", "num_batch_labels must be finite")
    problems += unchecked_labels_case(rank, world)
    return problems
