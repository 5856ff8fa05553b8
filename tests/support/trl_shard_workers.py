"""Worker bodies of tests/test_trl_shards.py: ``orda_tp.integrations.trl.chunked_divergence_loss``
with LM heads held as DTensors, against TRL 1.16's ``_chunked_divergence_loss`` on the full tensors
in one process (fp32 inputs: within ``RTOL``/``ATOL``).

- :func:`tp_worker`: vocabulary-parallel heads (weights and biases ``Shard(0)`` DTensors on a tp
  mesh, the hidden states the same on every rank): the loss, entropy sum, count and every gradient
  are TRL's, and no head is gathered.
- :func:`fsdp_worker`: FSDP2 (``fully_shard``) students trained data-parallel on batches of
  different lengths, the loss computed inside the student's forward by TRL's forward redirection,
  the head in the root's unit, in one unit with the final norm (accelerate 1.15's wrap) or its own
  unit, the teacher's head whole or FSDP-sharded: each rank's loss,
  entropy sum and count are its own batch's, its hidden states' gradient its own loss's, and the
  gradients FSDP2 leaves on the shards the mean of the ranks' (TRL's ``num_items_in_batch``: the
  global count ÷ ranks; or each rank's own count). A head's own unit is never gathered.
- :func:`trl_fsdp_worker`: TRL's own function on the FSDP-sharded head, for the record.
- :func:`errors_worker`: heads sharded in ways that do not fit raise on every rank, with the fix.

Workers return a list of mismatch descriptions (empty when everything agrees).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from orda_tp.integrations.trl import chunked_divergence_loss
from orda_tp.parallel.dtensor import chunk_range

from .distributed import note
from .trl_shard_cases import (
    BATCH,
    SETTINGS,
    STUDENT_WIDTH,
    TEACHER_WIDTH,
    Batch,
    Case,
    FsdpTraffic,
    RankResult,
    Student,
    fsdp_traffic,
    full,
    item_count,
    mismatch,
    no_dtensor_gather,
    oracle,
    rank_batch,
    redirected_loss,
    shard_rows,
    teacher_head,
    trl_loss,
    upstream,
)

# --- tensor parallelism ---------------------------------------------------------------------------

TP_VOCAB = 301  # uneven over 2 (151, 150) and 3 ranks (101, 101, 99)
TP_CASES = [
    Case(beta, temperature, settings)
    for beta in (0.0, 0.5, 1.0)
    for temperature in (1.0, 2.0)
    for settings in SETTINGS
    if settings != "teacher capped, student biased" or temperature == 1.0
]


def tp_inputs(seed: int, case: Case) -> dict[str, Any]:
    """TRL's tensor arguments of one case, full, the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    student_bias, teacher_bias = case.biased

    def randn(*shape: int, scale: float = 1.0) -> Tensor:
        return torch.randn(*shape, generator=generator) * scale

    return {
        "student_hidden_states": randn(BATCH, 7, STUDENT_WIDTH).requires_grad_(),
        "teacher_hidden_states": randn(BATCH, 7, TEACHER_WIDTH),
        "student_lm_head_weight": randn(TP_VOCAB, STUDENT_WIDTH, scale=0.4).requires_grad_(),
        # Trainable, to show that it gets no gradient (TRL's neither).
        "teacher_lm_head_weight": randn(TP_VOCAB, TEACHER_WIDTH, scale=0.4).requires_grad_(),
        "completion_mask": (torch.rand(BATCH, 7, generator=generator) < 0.7).long(),
        "student_lm_head_bias": randn(TP_VOCAB, scale=0.2).requires_grad_() if student_bias else None,
        "teacher_lm_head_bias": randn(TP_VOCAB, scale=0.2) if teacher_bias else None,
    }


HEAD_TENSORS = ("student_lm_head_weight", "teacher_lm_head_weight", "student_lm_head_bias", "teacher_lm_head_bias")
TRAINED = ("student_hidden_states", "student_lm_head_weight", "student_lm_head_bias")


def outputs_and_grads(loss_fn: Any, tensors: dict[str, Any], case: Case, count: Any) -> dict[str, Tensor]:
    """``loss_fn``'s outputs and the student's gradients (DTensors' in full), on fresh leaves."""
    leaves = {
        name: value.detach().clone().requires_grad_(value.requires_grad) if isinstance(value, Tensor) else value
        for name, value in tensors.items()
    }
    loss, entropy_sum, n_valid = loss_fn(**leaves, **case.keywords(), num_items_in_batch=count)
    loss.backward()
    found = {"loss": loss, "entropy_sum": entropy_sum, "n_valid": n_valid}
    for name in TRAINED:
        if leaves[name] is not None:
            found[f"{name}.grad"] = leaves[name].grad
    found["teacher grad"] = torch.tensor(float(leaves["teacher_lm_head_weight"].grad is not None))
    return found


def tp_worker(rank: int, world_size: int) -> list[str]:
    """Every case of :data:`TP_CASES` with both heads' weights and biases ``Shard(0)`` on a tp mesh."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    problems: list[str] = []
    for index, case in enumerate(TP_CASES):
        note(f"tp case {case}")
        tensors = tp_inputs(index, case)
        count = torch.tensor(11.0) if index % 2 else None
        want = outputs_and_grads(trl_loss, tensors, case, count)
        sharded = dict(tensors)
        for name in HEAD_TENSORS:
            if tensors[name] is not None:
                sharded[name] = distribute_tensor(tensors[name].detach(), mesh, [Shard(0)])
                sharded[name].requires_grad_(tensors[name].requires_grad)
        with no_dtensor_gather():
            got = outputs_and_grads(chunked_divergence_loss, sharded, case, count)
        weight_grad = got["student_lm_head_weight.grad"]
        start, stop = chunk_range(TP_VOCAB, world_size, rank)
        if not isinstance(weight_grad, DTensor) or weight_grad.to_local().shape[0] != stop - start:
            problems.append(f"{case}: the weight's gradient is not this rank's shard: {type(weight_grad).__name__}")
        for name, value in want.items():
            problems += mismatch(f"{case}: {name}", full(got[name]), value)
    return problems


# --- FSDP2 ----------------------------------------------------------------------------------------

# 301 rows: uneven over 2 and 3 ranks; 4 rows over 3 ranks: (2, 2, 0), an empty shard.
FSDP_VOCABS = {2: (301,), 3: (301, 4)}
FSDP_CASES = [
    Case(0.0, 1.0, "plain"),
    Case(0.5, 2.0, "scaled, capped, biased"),
    Case(1.0, 1.0, "teacher capped, student biased", items="none"),
]


class Arrangement(NamedTuple):
    """How the models are wrapped: the student's head in the root's ``fully_shard`` unit, in one
    unit with the final norm kept gathered after its forward (accelerate 1.15's wrap), or its own
    unit; the teacher's head FSDP-sharded or whole; the head unit's gradient divide factor."""

    head_unit: str  # "root", "tail" or "own"
    teacher_sharded: bool
    head_divisor: float | None = None


ARRANGEMENTS = {
    "head in the root's unit, teacher head whole": Arrangement("root", False),
    "head and final norm one unit kept gathered, teacher head whole": Arrangement("tail", False),
    "head its own unit, teacher head whole": Arrangement("own", False),
    "head its own unit, teacher head sharded": Arrangement("own", True),
    "head in the root's unit, teacher head sharded": Arrangement("root", True),
    "head its own unit summing its gradient, teacher head whole": Arrangement("own", False, head_divisor=1.0),
}


def wrapped(student: Student, teacher: nn.Linear, mesh: DeviceMesh, arrangement: str) -> tuple[Student, nn.Linear]:
    """Copies of the models wrapped as ``arrangement`` says (the body a unit, as decoder layers
    are)."""
    wrap = ARRANGEMENTS[arrangement]
    model, teacher = copy.deepcopy(student), copy.deepcopy(teacher)
    fully_shard(model.body, mesh=mesh)
    if wrap.head_unit == "tail":  # accelerate 1.15's fsdp2_prepare_model: gathered by the norm's forward
        fully_shard([model.norm, model.lm_head], mesh=mesh, reshard_after_forward=False)
    if wrap.head_unit == "own":
        head = fully_shard(model.lm_head, mesh=mesh)
        if wrap.head_divisor is not None:
            head.set_gradient_divide_factor(wrap.head_divisor)
    fully_shard(model, mesh=mesh)
    if wrap.teacher_sharded:
        fully_shard(teacher, mesh=mesh)
    return model, teacher


def compare_rank(
    tag: str, got: RankResult, expected: list[RankResult], rank: int, head_divisor: float | None = None
) -> list[str]:
    """This rank's outputs and hidden gradient against its own oracle result; the gradients FSDP
    left on the shards against this rank's rows of the ranks' mean (the head's sum ÷
    ``head_divisor`` where one is set)."""
    world_size = len(expected)
    mine = expected[rank]
    problems = []
    for what, value, want in zip(("loss", "entropy_sum", "n_valid"), got.outputs, mine.outputs):
        problems += mismatch(f"{tag}: {what}", value, want)
    problems += mismatch(f"{tag}: hidden.grad", got.hidden_grad, mine.hidden_grad)
    for name, grad in got.grads.items():
        divisor = head_divisor if head_divisor is not None and name.startswith("lm_head.") else world_size
        mean = sum(result.grads[name] for result in expected) / divisor
        problems += mismatch(f"{tag}: {name}.grad", grad, shard_rows(mean, rank, world_size))
    return problems


def fsdp_step(
    model: Student, teacher: nn.Linear, case: Case, rank: int, loss_fn: Any
) -> tuple[RankResult, FsdpTraffic]:
    """One forward and backward of ``loss_fn`` on this rank's batch: the result (the gradients as
    this rank's shards) and what FSDP2 gathered and reduced."""
    count = item_count(case, dist.get_world_size())
    with fsdp_traffic() as traffic:
        *outputs, hidden = redirected_loss(model, teacher, rank_batch(rank), case, count, loss_fn)
        (outputs[0] * upstream(rank)).backward()
    grads = {name: parameter.grad.to_local() for name, parameter in model.named_parameters()}
    return RankResult((outputs[0], outputs[1], outputs[2]), hidden.grad, grads), traffic


def fsdp_worker(rank: int, world_size: int) -> list[str]:
    """Every :data:`ARRANGEMENTS` × :data:`FSDP_CASES` on :data:`FSDP_VOCABS` against one process."""
    mesh = init_device_mesh("cpu", (world_size,))
    problems: list[str] = []
    for vocab in FSDP_VOCABS[world_size]:
        for case in FSDP_CASES:
            student, teacher = Student(vocab, case.biased[0]), teacher_head(vocab, case.biased[1])
            expected = oracle(student, teacher, case, world_size)
            for arrangement, wrap in ARRANGEMENTS.items():
                tag = f"V={vocab} {case}, {arrangement}"
                note(tag)
                model, wrapped_teacher = wrapped(student, teacher, mesh, arrangement)
                got, traffic = fsdp_step(model, wrapped_teacher, case, rank, chunked_divergence_loss)
                problems += compare_rank(tag, got, expected, rank, wrap.head_divisor)
                # The head's own unit never ran its forward: FSDP2 neither gathers it nor reduces its gradient.
                untouched = [
                    *([model.lm_head] if wrap.head_unit == "own" else []),
                    *([wrapped_teacher] if wrap.teacher_sharded else []),
                ]
                if any(traffic.touches(module) for module in untouched) or not traffic.touches(model.body):
                    problems.append(f"{tag}: FSDP2 gathered or reduced a sharded head ({traffic})")
                if any(p.grad is not None for p in wrapped_teacher.parameters()):
                    problems.append(f"{tag}: the teacher's head got a gradient")
                with torch.no_grad():  # as in evaluation
                    count = item_count(case, world_size)
                    outputs = redirected_loss(
                        model, wrapped_teacher, rank_batch(rank), case, count, chunked_divergence_loss
                    )
                problems += mismatch(f"{tag}: loss without gradients", outputs[0], expected[rank].outputs[0])
    return problems


def trl_fsdp_worker(rank: int, world_size: int) -> list[str]:
    """TRL's own function with the student's head its own unit (the teacher's whole): it gathers
    the head (``full_tensor``), and the loss, hidden and body gradients are right, but the head's
    shard gets this rank's own gradient rows, ``∂L_r/∂W``, not FSDP2's mean over the ranks."""
    mesh = init_device_mesh("cpu", (world_size,))
    case = FSDP_CASES[1]
    student, teacher = Student(301, case.biased[0]), teacher_head(301, case.biased[1])
    expected = oracle(student, teacher, case, world_size)
    model, wrapped_teacher = wrapped(student, teacher, mesh, "head its own unit, teacher head whole")
    got, _ = fsdp_step(model, wrapped_teacher, case, rank, trl_loss)
    problems = compare_rank(
        "TRL", RankResult(got.outputs, got.hidden_grad, {"body.weight": got.grads["body.weight"]}), expected, rank
    )
    for name in ("lm_head.weight", "lm_head.bias"):
        own = shard_rows(expected[rank].grads[name], rank, world_size)
        mean = shard_rows(sum(result.grads[name] for result in expected) / world_size, rank, world_size)
        problems += mismatch(f"TRL: {name}.grad is this rank's own", got.grads[name], own)
        if not mismatch("", got.grads[name], mean):
            problems.append(f"TRL: {name}.grad is FSDP2's mean (the ranks' batches should make it differ)")
    return problems


def expect_error(case: str, run: Any, fragment: str) -> list[str]:
    """``run()`` must raise a ValueError containing ``fragment``."""
    note(f"{case}: expecting an error")
    try:
        run()
    except ValueError as error:
        return [] if fragment in str(error) else [f"{case}: raised {error!s:.400}, expected {fragment!r}"]
    return [f"{case}: no error, expected one containing {fragment!r}"]


MESHES_DIFFER = "must be sharded by FSDP2 over the same 1-D data-parallel mesh"


def errors_worker(rank: int, world_size: int) -> list[str]:
    """Heads sharded in ways the loss cannot read, and one rank's rows that do not fit, raise a
    ValueError on every rank, each naming the problem, and leave no rank waiting."""
    mesh = init_device_mesh("cpu", (world_size,))
    case = FSDP_CASES[1]
    student, teacher = Student(301, True), teacher_head(301, True)
    batch, count = rank_batch(rank), item_count(case, world_size)
    model, _ = wrapped(student, teacher, mesh, "head its own unit, teacher head whole")
    replicated = SimpleNamespace(
        weight=distribute_tensor(teacher.weight.detach(), mesh, [Replicate()]), bias=teacher.bias.detach()
    )
    problems = expect_error(
        "teacher head replicated beside the student's FSDP2 shard",
        lambda: redirected_loss(model, replicated, batch, case, count, chunked_divergence_loss),
        MESHES_DIFFER,
    )
    short = Batch(batch.inputs, batch.teacher_hidden, batch.mask[:, :-1] if rank == world_size - 1 else batch.mask)
    problems += expect_error(
        "the last rank's mask one position short",
        lambda: redirected_loss(model, teacher, short, case, count, chunked_divergence_loss),
        f"rank {world_size - 1}: the student's and the teacher's hidden states and the labels must have the same rows",
    )
    hybrid = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
    model, _ = wrapped(student, teacher, hybrid, "head its own unit, teacher head whole")
    problems += expect_error(
        "HSDP head",
        lambda: redirected_loss(model, teacher, batch, case, count, chunked_divergence_loss),
        "only as Shard(0) on a 1-D mesh",
    )
    problems += _tensor_parallel_errors(mesh, student, teacher, case)
    dist.barrier()  # every rank got here: none is left in a collective
    return problems


def _tensor_parallel_errors(mesh: DeviceMesh, student: Student, teacher: nn.Linear, case: Case) -> list[str]:
    """A vocabulary-parallel student head beside a whole teacher head, and beside an FSDP2-sharded one."""
    hidden = torch.randn(BATCH, 4, STUDENT_WIDTH, generator=torch.Generator().manual_seed(7))
    teacher_hidden = torch.randn(BATCH, 4, TEACHER_WIDTH, generator=torch.Generator().manual_seed(8))
    weight = distribute_tensor(student.lm_head.weight.detach(), mesh, [Shard(0)]).requires_grad_()
    bias = distribute_tensor(student.lm_head.bias.detach(), mesh, [Shard(0)]).requires_grad_()
    mask = torch.ones(BATCH, 4, dtype=torch.long)
    sharded_teacher = copy.deepcopy(teacher)
    fully_shard(sharded_teacher, mesh=mesh)
    problems = []
    for what, head, fragment in (
        ("whole", teacher, "both heads must be sharded the same way"),
        ("FSDP2-sharded", sharded_teacher, MESHES_DIFFER),
    ):
        problems += expect_error(
            f"vocabulary-parallel student head, {what} teacher head",
            lambda head=head: chunked_divergence_loss(
                hidden,
                teacher_hidden,
                weight,
                head.weight,
                mask,
                case.beta,
                student_lm_head_bias=bias,
                teacher_lm_head_bias=head.bias,
            ),  # fmt: skip
            fragment,
        )
    return problems
