"""Worker bodies of tests/test_training_stacks.py: the loss inside FSDP2 and DTensor tensor-parallel models.

A tiny student (a linear body and an LM head of ``VOCAB`` rows, fp64) is wrapped the way users
wrap models, and each rank trains on its data-parallel batch. Every case is either right — the
loss equals the single-process fp64 call on this rank's batch and the full head (relative error
≤ 1e-12), and the gradients FSDP leaves on the shards equal the single-process gradients averaged
over the data-parallel ranks — or raises a ValueError naming the problem, on every rank.

Workers return a list of mismatch descriptions (empty when everything agrees).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import orda_tp

from .distributed import note

HIDDEN, VOCAB, BATCH, SEQ = 8, 37, 2, 6  # 37 columns: uneven over 2 tensor-parallel ranks; SEQ even (Shard(1))
TOLERANCE = 1e-12
LOSS = {"student_ce_weight": 1.0, "teacher_ce_weight": 0.0, "kl_weight": 0.5, "kl_temperature": 2.0}
FSDP_ERROR = "FSDP2 (fully_shard) holds sharded over data parallelism"


@dataclass(frozen=True)
class Batch:
    """One data-parallel rank's batch: inputs, next-token labels (some ignored), teacher states."""

    inputs: Tensor
    labels: Tensor
    teacher_hidden: Tensor


def make_batch(seed: int) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(BATCH, SEQ, HIDDEN, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels[:, -1] = -100
    return Batch(inputs, labels, torch.randn(BATCH, SEQ, HIDDEN, generator=generator, dtype=torch.float64))


class Student(nn.Module):
    """A body and an LM head; ``forward`` computes the loss through the head module, or (``functional``)
    by passing ``lm_head.weight`` to :func:`orda_tp.distillation_loss` inside the root's forward."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.body = nn.Linear(HIDDEN, HIDDEN, dtype=torch.float64)
        self.lm_head = head

    def forward(self, batch: Batch, functional: bool = False) -> orda_tp.DistillationLossOutput:
        hidden = self.body(batch.inputs)
        teacher = orda_tp.TiedTeacher(batch.teacher_hidden.reshape(-1, HIDDEN))
        if functional:
            return orda_tp.distillation_loss(
                hidden.reshape(-1, HIDDEN), self.lm_head.weight, batch.labels.reshape(-1), teacher, **LOSS
            )
        return self.lm_head(hidden, labels=batch.labels, teacher=teacher)


def reference_model() -> Student:
    """The single-process model every wrapped copy starts from (same seed on every rank)."""
    torch.manual_seed(0)
    return Student(nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.float64))


def head_copy(reference: Student) -> Student:
    """``reference``'s parameters with a :class:`orda_tp.DistillationHead` as the LM head."""
    model = copy.deepcopy(reference)
    model.lm_head = orda_tp.DistillationHead.from_linear(model.lm_head, **LOSS)
    return model


def reference_result(reference: Student, batch: Batch, dp_group: dist.ProcessGroup) -> dict[str, Tensor]:
    """Loss on this rank's batch, and gradients averaged over the data-parallel ranks (FSDP's
    reduction), from plain fp64 tensors on one process."""
    model = copy.deepcopy(reference)
    hidden = model.body(batch.inputs).reshape(-1, HIDDEN)
    out = orda_tp.distillation_loss(
        hidden, model.lm_head.weight, batch.labels.reshape(-1),
        orda_tp.TiedTeacher(batch.teacher_hidden.reshape(-1, HIDDEN)), backend="reference", **LOSS,
    )  # fmt: skip
    out.loss.backward()
    result = {"loss": out.loss.detach()}
    for name, parameter in model.named_parameters():
        grad = parameter.grad.clone()
        dist.all_reduce(grad, group=dp_group)
        result[name] = grad / dist.get_world_size(dp_group)
    return result


def full_value(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def relative_error(got: Tensor, want: Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


def compare(case: str, model: Student, batch: Batch, expected: dict[str, Tensor], functional: bool) -> list[str]:
    """Run one step and compare loss and every parameter's gradient with ``expected``."""
    note(f"{case}: forward")
    out = model(batch, functional)
    out.loss.backward()
    problems = []
    if (error := relative_error(full_value(out.loss.detach()), expected["loss"])) > TOLERANCE:
        problems.append(f"{case}: loss {float(full_value(out.loss))} vs {float(expected['loss'])} (rel {error:.2e})")
    for name, parameter in model.named_parameters():
        if (error := relative_error(full_value(parameter.grad), expected[name])) > TOLERANCE:
            problems.append(f"{case}: {name}.grad relative error {error:.2e}")
    return problems


def expect_error(case: str, run: Callable[[], object], fragment: str) -> list[str]:
    """``run`` must raise a ValueError containing ``fragment``."""
    note(f"{case}: expecting an error")
    try:
        run()
    except ValueError as error:
        return [] if fragment in str(error) else [f"{case}: raised {error!s:.300}, expected {fragment!r}"]
    return [f"{case}: no error, expected one containing {fragment!r}"]


def fsdp_1d_worker(rank: int, world_size: int) -> list[str]:
    """Data parallelism only (a 1-D mesh of 2 ranks), the head wrapped every common way."""
    mesh = init_device_mesh("cpu", (world_size,))
    group = mesh.get_group()
    reference = reference_model()
    problems: list[str] = []
    for same_labels in (True, False):
        batch = make_batch(0 if same_labels else 1 + rank)
        expected = reference_result(reference, batch, group)
        for root_reshard in (True, False):
            tag = f"labels {'same' if same_labels else 'differ'}, root reshard {root_reshard}"
            # The head as its own unit, its weight read in the root's forward: FSDP's dp shard.
            model = copy.deepcopy(reference)
            fully_shard(model.lm_head, mesh=mesh)
            fully_shard(model, mesh=mesh, reshard_after_forward=root_reshard)
            run = lambda m=model, b=batch: m(b, True)  # noqa: E731
            problems += expect_error(f"functional, head unit, {tag}", run, FSDP_ERROR)
            # The head in the root's unit: its weight is gathered in the root's forward.
            model = copy.deepcopy(reference)
            fully_shard(model, mesh=mesh, reshard_after_forward=root_reshard)
            problems += compare(f"functional, head in root unit, {tag}", model, batch, expected, functional=True)
            # DistillationHead: right under any wrapping.
            for head_unit in (True, False):
                model = head_copy(reference)
                if head_unit:
                    fully_shard(model.lm_head, mesh=mesh)
                fully_shard(model, mesh=mesh, reshard_after_forward=root_reshard)
                case = f"DistillationHead, {'head unit' if head_unit else 'root unit'}, {tag}"
                problems += compare(case, model, batch, expected, functional=False)
    return problems


def fsdp_tp_worker(rank: int, world_size: int) -> list[str]:
    """A 2-D (dp, tp) mesh of 4 ranks: the head vocabulary-parallel over tp, FSDP over dp."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"], mesh["tp"]
    batch = make_batch(1 + mesh.get_local_rank("dp"))  # the tp ranks of a dp rank share its batch
    reference = reference_model()
    expected = reference_result(reference, batch, dp.get_group())
    styles: dict[str, Callable[[], object]] = {
        "VocabParallel": orda_tp.VocabParallel,
        "ColwiseParallel": lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    problems: list[str] = []
    for name, style in styles.items():
        for head_unit in (True, False):
            case = f"{name}, {'head unit' if head_unit else 'root unit'}"
            model = head_copy(reference)
            parallelize_module(model, tp, {"lm_head": style()})
            _shard_2d(model, dp, head_unit)
            problems += compare(f"DistillationHead, {case}", model, batch, expected, functional=False)
            if head_unit:
                run = lambda m=model: m(batch, True)  # noqa: E731
                problems += expect_error(f"functional, {case}", run, FSDP_ERROR)
            else:  # the tp shard, gathered over dp by the root's forward
                model.zero_grad()
                problems += compare(f"functional, {case}", model, batch, expected, functional=True)
    return problems


def _shard_2d(model: Student, dp: DeviceMesh, head_unit: bool) -> None:
    if head_unit:
        fully_shard(model.lm_head, mesh=dp)
    fully_shard(model, mesh=dp)


def full_head_worker(rank: int, world_size: int) -> list[str]:
    """The whole head passed on every rank with tp_group raises on every rank (functional and
    DistillationHead), while vocabulary shards of a head whose shards are identical (all zeros)
    still compute."""
    group = dist.group.WORLD
    batch = make_batch(0)
    hidden = batch.inputs.reshape(-1, HIDDEN)
    labels = batch.labels.reshape(-1)
    teacher = orda_tp.TiedTeacher(batch.teacher_hidden.reshape(-1, HIDDEN))
    weight = torch.randn(VOCAB, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    problems = expect_error(
        "full head, functional",
        lambda: orda_tp.distillation_loss(hidden, weight, labels, teacher, tp_group=group, **LOSS),
        "holds the same values on every rank of tp_group",
    )
    head = orda_tp.DistillationHead(HIDDEN, VOCAB, dtype=torch.float64, tp_group=group, **LOSS)
    problems += expect_error(
        "full head, DistillationHead",
        lambda: head(batch.inputs, labels=batch.labels, teacher=teacher),
        "holds the same values on every rank of tp_group",
    )
    zeros = torch.zeros(VOCAB, HIDDEN, dtype=torch.float64)
    shard = zeros.chunk(world_size)[rank]
    expected = orda_tp.distillation_loss(hidden, zeros, labels, teacher, backend="reference", **LOSS)
    got = orda_tp.distillation_loss(hidden, shard, labels, teacher, tp_group=group, **LOSS)
    if (error := relative_error(got.loss, expected.loss)) > TOLERANCE:
        problems.append(f"zero head shards: loss relative error {error:.2e}")
    return problems


def teacher_head_worker(rank: int, world_size: int) -> list[str]:
    """A frozen teacher model under FSDP2, its head passed as orda_tp.TeacherHead: gathered for the
    call (also with reduction="none", whose backward reads it again); a trainable one raises."""
    mesh = init_device_mesh("cpu", (world_size,))
    generator = torch.Generator().manual_seed(5 + rank)
    student_hidden = torch.randn(BATCH * SEQ, HIDDEN, dtype=torch.float64, generator=generator)
    teacher_hidden = torch.randn(BATCH * SEQ, HIDDEN + 1, dtype=torch.float64, generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH * SEQ,), generator=generator)
    torch.manual_seed(1)
    teacher = nn.Sequential(nn.Linear(HIDDEN + 1, HIDDEN + 1), nn.Linear(HIDDEN + 1, VOCAB, bias=False)).double()
    full_teacher_weight = teacher[1].weight.detach().clone()
    teacher.requires_grad_(False)
    fully_shard(teacher[1], mesh=mesh)
    fully_shard(teacher, mesh=mesh)
    problems: list[str] = []
    for reduction in ("mean", "none"):
        weight = torch.randn(VOCAB, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        keywords = {**LOSS, "kl_divergence": "reverse", "reduction": reduction}
        want_hidden = student_hidden.clone().requires_grad_()
        expected = orda_tp.distillation_loss(
            want_hidden, weight, labels, orda_tp.SeparateTeacher(teacher_hidden, full_teacher_weight),
            backend="reference", **keywords,
        )  # fmt: skip
        expected.loss.sum().backward()
        got_hidden = student_hidden.clone().requires_grad_()
        got = orda_tp.distillation_loss(
            got_hidden, weight, labels, orda_tp.TeacherHead(teacher_hidden, teacher[1]), **keywords
        )
        got.loss.sum().backward()
        for what, value, want in (
            ("loss", got.loss, expected.loss),
            ("hidden.grad", got_hidden.grad, want_hidden.grad),
        ):
            if (error := relative_error(value.detach(), want.detach())) > TOLERANCE:
                problems.append(f"TeacherHead, reduction {reduction}: {what} relative error {error:.2e}")
        if not isinstance(teacher[1].weight, DTensor):
            problems.append(f"TeacherHead, reduction {reduction}: the teacher head was left gathered")
    teacher[1].weight.requires_grad_(True)
    problems += expect_error(
        "TeacherHead that would be trained",
        lambda: orda_tp.distillation_loss(
            student_hidden, weight, labels, orda_tp.TeacherHead(teacher_hidden, teacher[1])
        ),
        "sends no gradient back to FSDP's shards",
    )
    return problems


def mixture_teacher_head_worker(rank: int, world_size: int) -> list[str]:
    """A TeacherMixture holding a frozen teacher model's FSDP2-sharded head as orda_tp.TeacherHead and a
    SeparateTeacher: the head gathered for the call (also with reduction="none", whose backward reads it
    again) and resharded after; a member head that requires grad is read, never trained."""
    mesh = init_device_mesh("cpu", (world_size,))
    generator = torch.Generator().manual_seed(11 + rank)
    student_hidden = torch.randn(BATCH * SEQ, HIDDEN, dtype=torch.float64, generator=generator)
    hidden_a = torch.randn(BATCH * SEQ, HIDDEN + 1, dtype=torch.float64, generator=generator)
    hidden_b = torch.randn(BATCH * SEQ, HIDDEN + 3, dtype=torch.float64, generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH * SEQ,), generator=generator)
    torch.manual_seed(3)
    teacher = nn.Sequential(nn.Linear(HIDDEN + 1, HIDDEN + 1), nn.Linear(HIDDEN + 1, VOCAB)).double()
    full_weight, full_bias = teacher[1].weight.detach().clone(), teacher[1].bias.detach().clone()
    other = orda_tp.SeparateTeacher(hidden_b, torch.randn(VOCAB, HIDDEN + 3, dtype=torch.float64, generator=generator))
    fully_shard(teacher[1], mesh=mesh)
    fully_shard(teacher, mesh=mesh)
    weights = torch.rand(BATCH * SEQ, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    problems: list[str] = []
    for reduction, frozen in (("mean", True), ("none", True), ("mean", False)):
        teacher.requires_grad_(not frozen)
        weight = torch.randn(VOCAB, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        keywords = {**LOSS, "kl_divergence": "reverse", "reduction": reduction}
        want_hidden = student_hidden.clone().requires_grad_()
        whole = orda_tp.SeparateTeacher(hidden_a, full_weight, full_bias)
        expected = orda_tp.distillation_loss(
            want_hidden, weight, labels, orda_tp.TeacherMixture([whole, other], weights), backend="reference",
            **keywords,
        )  # fmt: skip
        expected.loss.sum().backward()
        got_hidden = student_hidden.clone().requires_grad_()
        mixture = orda_tp.TeacherMixture([orda_tp.TeacherHead(hidden_a, teacher[1]), other], weights)
        got = orda_tp.distillation_loss(got_hidden, weight, labels, mixture, **keywords)
        got.loss.sum().backward()
        case = f"TeacherMixture with a TeacherHead, reduction {reduction}, {'frozen' if frozen else 'requires grad'}"
        for what, value, want in (
            ("loss", got.loss, expected.loss),
            ("hidden.grad", got_hidden.grad, want_hidden.grad),
        ):
            if (error := relative_error(value.detach(), want.detach())) > TOLERANCE:
                problems.append(f"{case}: {what} relative error {error:.2e}")
        if not isinstance(teacher[1].weight, DTensor):
            problems.append(f"{case}: the teacher head was left gathered")
        if any(p.grad is not None for p in teacher.parameters()):
            problems.append(f"{case}: a gradient reached the teacher")
    return problems


def fsdp_lookup_worker(rank: int, world_size: int) -> bool:
    """Whether FSDP2's sharded head weight is recognized before and after the forward, and its
    gathered form inside the forward is not."""
    from orda_tp.parallel.fsdp import fsdp_shard_of

    mesh = init_device_mesh("cpu", (world_size,))
    head = nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.float64)
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN, dtype=torch.float64), head)
    fully_shard(head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    seen: list[object] = [fsdp_shard_of(head.weight)]
    head.register_forward_pre_hook(lambda module, args: seen.append(fsdp_shard_of(module.weight)))
    model(torch.zeros(1, HIDDEN, dtype=torch.float64)).sum().backward()
    seen.append(fsdp_shard_of(head.weight))
    before, during, after = seen
    return before is not None and before.module is head and during is None and after == before


def vocab_parallel_worker(rank: int, world_size: int) -> list[str]:
    """VocabParallel on a 1-D tensor-parallel mesh without FSDP: logits as a Shard(-1) DTensor (or
    local columns), the loss from replicated and from sequence-parallel Shard(1) activations, with a
    padded vocabulary and every reduction, against the single-process head."""
    from torch.distributed.tensor import Replicate

    mesh = init_device_mesh("cpu", (world_size,))
    batch = make_batch(0)
    problems: list[str] = []
    for layout, reduction in ((Replicate(), "mean"), (Shard(1), "none"), (Shard(1), "sum")):
        reference = reference_model()
        keywords = {**LOSS, "reduction": reduction, "vocab_size": VOCAB - 3}
        full = orda_tp.DistillationHead.from_linear(copy.deepcopy(reference.lm_head), **keywords)
        head = orda_tp.DistillationHead.from_linear(copy.deepcopy(reference.lm_head), **keywords)
        parallelize_module(head, mesh, orda_tp.VocabParallel(input_layouts=layout))
        case = f"VocabParallel(input_layouts={layout}), reduction {reduction}"
        labels = batch.labels.clamp_max(VOCAB - 4)
        teacher = orda_tp.TiedTeacher(batch.teacher_hidden.reshape(-1, HIDDEN))
        want_hidden = batch.inputs.clone().requires_grad_()
        want = full(want_hidden, labels=labels, teacher=teacher)
        want.loss.sum().backward()
        # Under Shard(1) each rank passes its positions of the sequence, as sequence parallelism holds them.
        local = batch.inputs.tensor_split(world_size, dim=1)[rank] if layout == Shard(1) else batch.inputs
        got_hidden = local.clone().requires_grad_()
        got = head(got_hidden, labels=labels, teacher=teacher)
        got.loss.sum().backward()
        want_grad = want_hidden.grad.tensor_split(world_size, dim=1)[rank] if layout == Shard(1) else want_hidden.grad
        checks = (
            ("loss", full_value(got.loss).detach(), want.loss.detach()),
            ("hidden.grad", got_hidden.grad, want_grad),
            ("weight.grad", full_value(head.weight.grad), full.weight.grad),
        )
        for what, value, expected in checks:
            if (error := relative_error(value, expected)) > TOLERANCE:
                problems.append(f"{case}: {what} relative error {error:.2e}")
        logits = head(local)
        if not isinstance(logits, DTensor) or tuple(logits.placements) != (Shard(2),):
            problems.append(f"{case}: logits are {type(logits).__name__} {getattr(logits, 'placements', '')}")
        elif relative_error(logits.full_tensor(), full(batch.inputs)) > TOLERANCE:
            problems.append(f"{case}: logits differ from the single-process head's")
    head = orda_tp.DistillationHead.from_linear(reference_model().lm_head)
    parallelize_module(head, mesh, orda_tp.VocabParallel(use_local_output=True))
    columns = torch.tensor_split(torch.arange(VOCAB), world_size)[rank]
    if relative_error(head(batch.inputs), reference_model().lm_head(batch.inputs)[..., columns]) > TOLERANCE:
        problems.append("VocabParallel(use_local_output=True): local logits are not this rank's columns")
    return problems
