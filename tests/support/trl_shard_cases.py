"""Cases, models and the one-process oracle of tests/support/trl_shard_workers.py: TRL 1.16's
``_chunked_divergence_loss`` with the LM heads whole, as the reference of every sharded call.

- :class:`Case`: β, temperature, logit scales, soft-caps, biases and TRL's count.
- :class:`Student`, :func:`teacher_head`, :func:`rank_batch`: a body and an LM head, the frozen
  teacher's head, and each data-parallel rank's batch (the ranks' lengths differ; rank 2 has no
  completion token).
- :func:`redirected_loss`: a loss computed inside the student's forward by TRL's forward
  redirection, as ``DistillationTrainer.compute_loss`` runs it; :func:`oracle`: every rank's result
  of TRL's function on one process.
- :func:`no_dtensor_gather`, :func:`fsdp_traffic`: what proves that no head is gathered.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from trl.models.utils import _ForwardRedirection
from trl.trainer.distillation_trainer import _chunked_divergence_loss as trl_loss

from orda_tp.parallel.dtensor import chunk_range

HIDDEN_IN, STUDENT_WIDTH, TEACHER_WIDTH, BATCH = 5, 6, 7, 2
RTOL, ATOL = 1e-5, 1e-7
# Per setting: logit scales, final soft-caps (student, teacher) and which heads carry a bias.
SETTINGS: dict[str, tuple[tuple[float, float], tuple[float | None, float | None], tuple[bool, bool]]] = {
    "plain": ((1.0, 1.0), (None, None), (False, False)),
    "scaled, capped, biased": ((0.7, 1.3), (5.0, 4.0), (True, True)),
    "teacher capped, student biased": ((1.25, 1.0), (None, 3.0), (True, False)),
}


@dataclass(frozen=True)
class Case:
    """One loss configuration: β, the temperature, a :data:`SETTINGS` key, and the count TRL's
    trainer divides by (``"trl"``: the global count ÷ ranks; ``"none"``: each rank's own)."""

    beta: float
    temperature: float
    settings: str
    items: str = "trl"

    @property
    def biased(self) -> tuple[bool, bool]:
        return SETTINGS[self.settings][2]

    def keywords(self) -> dict[str, Any]:
        """TRL's keywords of the case, all but the tensors and the count."""
        (scale, teacher_scale), (cap, teacher_cap), _ = SETTINGS[self.settings]
        return {
            "beta": self.beta,
            "temperature": self.temperature,
            "student_logit_scale": scale,
            "teacher_logit_scale": teacher_scale,
            "student_final_logit_softcapping": cap,
            "teacher_final_logit_softcapping": teacher_cap,
        }

    def __str__(self) -> str:
        return f"beta={self.beta} T={self.temperature} {self.settings} items={self.items}"


def relative_error(got: Tensor, want: Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30)) if want.numel() else 0.0


def mismatch(what: str, got: Tensor, want: Tensor) -> list[str]:
    """[] where ``got`` is ``want`` within fp32 rounding, else a description."""
    got, want = got.detach().float(), want.detach().float()
    if got.shape == want.shape and torch.allclose(got, want, rtol=RTOL, atol=ATOL):
        return []
    return [
        f"{what}: {got.flatten()[:4].tolist()} vs {want.flatten()[:4].tolist()} (rel {relative_error(got, want):.1e})"
    ]


def full(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@contextmanager
def no_dtensor_gather() -> Iterator[None]:
    """Inside the block, gathering a DTensor (``full_tensor``, ``redistribute``) raises."""

    def refuse(self: DTensor, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a DTensor of shape {tuple(self.shape)} was gathered")

    saved = DTensor.full_tensor, DTensor.redistribute
    DTensor.full_tensor, DTensor.redistribute = refuse, refuse  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        DTensor.full_tensor, DTensor.redistribute = saved  # type: ignore[method-assign]


class Student(nn.Module):
    """A body (standing for the decoder layers), a final norm and an LM head; ``hidden_states``
    is what TRL reads from ``base_model``."""

    def __init__(self, vocab: int, biased: bool) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same model on every rank
        self.body = nn.Linear(HIDDEN_IN, STUDENT_WIDTH)
        self.norm = nn.LayerNorm(STUDENT_WIDTH)
        self.lm_head = nn.Linear(STUDENT_WIDTH, vocab, bias=biased)

    def hidden_states(self, inputs: Tensor) -> Tensor:
        return self.norm(self.body(inputs))


def teacher_head(vocab: int, biased: bool) -> nn.Linear:
    """The frozen teacher's head; trainable, to show it gets no gradient."""
    torch.manual_seed(1)
    head = nn.Linear(TEACHER_WIDTH, vocab, bias=biased)
    with torch.no_grad():
        head.weight.mul_(3.0)  # a teacher sharper than the student
    return head


@dataclass(frozen=True)
class Batch:
    """One rank's completions: the body's inputs, the teacher's hidden states and the mask."""

    inputs: Tensor
    teacher_hidden: Tensor
    mask: Tensor


def rank_batch(rank: int) -> Batch:
    """Rank ``rank``'s batch: ``3 + 2·rank`` positions (the ranks' rows differ); rank 2 has no
    completion token."""
    generator = torch.Generator().manual_seed(1000 + rank)
    positions = 3 + 2 * rank
    mask = (torch.rand(BATCH, positions, generator=generator) < 0.7).long()
    mask[0, 0] = rank != 2
    if rank == 2:
        mask.zero_()
    inputs = torch.randn(BATCH, positions, HIDDEN_IN, generator=generator)
    return Batch(inputs, torch.randn(BATCH, positions, TEACHER_WIDTH, generator=generator), mask)


def item_count(case: Case, world_size: int) -> Tensor | None:
    """What TRL's trainer passes: the completion tokens of every rank (at least 1) ÷ ranks."""
    if case.items == "none":
        return None
    total = sum(int(rank_batch(rank).mask.sum()) for rank in range(world_size))
    return torch.tensor(float(total)).clamp(min=1.0) / world_size


def redirected_loss(
    model: Student, teacher: nn.Linear, batch: Batch, case: Case, count: Tensor | None, loss_fn: Any
) -> tuple[Tensor, ...]:
    """``loss_fn`` computed inside ``model``'s forward (TRL's forward redirection, as
    ``DistillationTrainer.compute_loss`` runs it): ``(loss, entropy_sum, n_valid, hidden)``."""

    def compute(unwrapped: Student, batch: Batch) -> tuple[Tensor, ...]:
        hidden = unwrapped.hidden_states(batch.inputs)
        if hidden.requires_grad:
            hidden.retain_grad()
        outputs = loss_fn(
            hidden, batch.teacher_hidden, unwrapped.lm_head.weight, teacher.weight, batch.mask,
            num_items_in_batch=count, student_lm_head_bias=unwrapped.lm_head.bias,
            teacher_lm_head_bias=teacher.bias, **case.keywords(),
        )  # fmt: skip
        return (*outputs, hidden)

    return _ForwardRedirection()(model, model, compute, model, batch)


@dataclass(frozen=True)
class RankResult:
    """One rank's outputs, its hidden states' gradient and its parameters' gradients."""

    outputs: tuple[Tensor, Tensor, Tensor]
    hidden_grad: Tensor
    grads: dict[str, Tensor]


def upstream(rank: int) -> float:
    """The gradient each rank sends into its loss: different on each rank, to show that each
    rank's reaches its own rows (a trainer's are equal)."""
    return 1.0 + 0.5 * rank


def oracle(student: Student, teacher: nn.Linear, case: Case, world_size: int) -> list[RankResult]:
    """Every rank's result of TRL's function on one process, the heads whole."""
    frozen = copy.deepcopy(teacher).requires_grad_(False)
    results = []
    for rank in range(world_size):
        model = copy.deepcopy(student)
        count = item_count(case, world_size)
        *outputs, hidden = redirected_loss(model, frozen, rank_batch(rank), case, count, trl_loss)
        (outputs[0] * upstream(rank)).backward()
        grads = {name: parameter.grad for name, parameter in model.named_parameters()}
        results.append(RankResult((outputs[0], outputs[1], outputs[2]), hidden.grad, grads))
    return results


def shard_rows(tensor: Tensor, rank: int, world_size: int) -> Tensor:
    start, stop = chunk_range(tensor.shape[0], world_size, rank)
    return tensor[start:stop]


@dataclass
class FsdpTraffic:
    """What FSDP2 gathered and reduced inside :func:`fsdp_traffic`'s block: the modules whose
    parameters it unsharded, and the sharded parameters whose gradients it reduce-scattered."""

    unsharded: list[nn.Module] = field(default_factory=list)
    reduced: list[Tensor] = field(default_factory=list)

    def __str__(self) -> str:
        names = sorted({type(module).__name__ for module in self.unsharded})
        return f"unsharded {names}, reduced {[tuple(tensor.shape) for tensor in self.reduced]}"

    def touches(self, module: nn.Module) -> bool:
        """Whether FSDP2 gathered ``module``'s parameters or reduced their gradients."""
        own = list(module.parameters())
        return any(m is module for m in self.unsharded) or any(t is p for t in self.reduced for p in own)


@contextmanager
def fsdp_traffic() -> Iterator[FsdpTraffic]:
    """Records every FSDP2 gather (``FSDPParamGroup.unshard``) and gradient reduction
    (``foreach_reduce``) inside the block (FSDP2's private names: torch is pinned)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as groups

    traffic = FsdpTraffic()
    unshard, reduce = groups.FSDPParamGroup.unshard, groups.foreach_reduce

    def recorded_unshard(self: Any, *args: Any, **kwargs: Any) -> Any:
        traffic.unsharded.extend(self.modules)
        return unshard(self, *args, **kwargs)

    def recorded_reduce(fsdp_params: list[Any], *args: Any, **kwargs: Any) -> Any:
        traffic.reduced.extend(param.sharded_param for param in fsdp_params)
        return reduce(fsdp_params, *args, **kwargs)

    groups.FSDPParamGroup.unshard, groups.foreach_reduce = recorded_unshard, recorded_reduce
    try:
        yield traffic
    finally:
        groups.FSDPParamGroup.unshard, groups.foreach_reduce = unshard, reduce
