"""The loss of an LM head that FSDP2 holds sharded over data parallelism, computed on its shard:
the data-parallel ranks' rows are gathered and each rank reads its own slice of the vocabulary,
orda_tp's sequence-parallel tensor parallelism run over the data-parallel group. No rank gathers a
head (docs/integrations.md, "TRL").

Where it applies: a loss computed inside a model's forward whose LM head is its own ``fully_shard``
unit (the head's forward never runs), so that its weight and bias are the unit's sharded
parameters, ``Shard(0)`` DTensors over a 1-D data-parallel mesh: rank ``r`` of ``P`` holds the
vocabulary rows ``chunk_range(V, P, r)`` (``torch.chunk`` order: the last ranks' slices short or
empty) and its own batch. :func:`sharded_heads` recognizes that case; :func:`rows_gathered_loss`
computes it. Per call each rank sends its ``n_r`` rows of hidden states, padded to ``N = max n_r``
(the padding ignored): ``P·N·(H_s + H_t)`` values instead of a ``V × H`` head.

The contract, with ``L_r = Σ_{i ∈ rows of r} ℓ_i / d_r`` (``d_r`` rank ``r``'s ``denominator``):

- rank ``r`` returns ``L_r`` and its own rows' sums of the reports (its own batch, as one device);
- its hidden states get ``g_r·∂L_r/∂h_r`` (``g_r`` the upstream gradient of its loss);
- the student head's shard gets ``(1/P)·Σ_s g_s·∂L_s/∂W`` on its rows, FSDP2's averaged gradient
  (``1/f`` where ``set_gradient_divide_factor(f)`` was set), written straight to the sharded
  parameter: FSDP2 reduce-scatters the gradients of the units whose forward ran, and the head's did
  not. A student head given whole (the gathered parameter of the unit whose forward runs, the
  teacher's head being the sharded one) is sliced instead: its gradient is ``Σ_s g_s·∂L_s/∂W`` on
  this rank's rows and 0 elsewhere, which that unit's averaging reduce-scatter turns into the same
  mean;
- the teacher's tensors get no gradient.

Each rank's own values come from the loss's per-row results (``reduction="none"``), whose backward
recomputes the logits: one pass of logits GEMMs more than a one-device call of the same rows.
1-D meshes only: an HSDP or ``(dp, tp)`` sharded head raises, as does a head sharded otherwise than
the other.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from orda_tp.loss import DistillationLossOutput, distillation_loss
from orda_tp.parallel.collectives import all_gather_rows, all_gather_texts, host_group
from orda_tp.parallel.dtensor import DTensor, chunk_range, is_dtensor, placement_text
from orda_tp.parallel.fsdp import FsdpShard, fsdp_shard_of, gradient_divide_factor
from orda_tp.teachers import SeparateTeacher

__all__ = ["DataParallelHeads", "rows_gathered_loss", "sharded_heads"]


@dataclass(frozen=True)
class DataParallelHeads:
    """The data-parallel group over which FSDP2 shards a call's head (``sharded`` names that
    tensor): its ``size`` ranks, this rank's ``coordinate``, its vocabulary rows ``vocab_range`` of
    ``vocab_size``, and the factor FSDP2 would divide the head's summed gradient by
    (``gradient_divisor``)."""

    sharded: str
    group: dist.ProcessGroup
    ranks: tuple[int, ...]
    coordinate: int
    vocab_range: tuple[int, int]
    vocab_size: int
    gradient_divisor: float

    @property
    def size(self) -> int:
        return len(self.ranks)


def _row_shard_on_1d_mesh(tensor: DTensor) -> bool:
    return tensor.device_mesh.ndim == 1 and tensor.placements[0].is_shard(0)


def _mismatch(name: str, tensor: Tensor, heads: DataParallelHeads, why: str = "") -> ValueError:
    held = placement_text(tensor) if is_dtensor(tensor) else f"a plain tensor of shape {tuple(tensor.shape)}"
    return ValueError(
        f"{name} is {held}{why}, but {heads.sharded} is sharded by FSDP2 (fully_shard) over the data-parallel "
        f"ranks {list(heads.ranks)} ({heads.vocab_size} vocabulary rows): both heads (and their biases) must be "
        "sharded by FSDP2 over the same 1-D data-parallel mesh, or given whole (e.g. the LM head kept in its "
        "parent's fully_shard unit)"
    )


def _group_of(name: str, weight: Tensor, shard: FsdpShard) -> DataParallelHeads:
    """The data-parallel layout of ``weight``, a head FSDP2 holds sharded over a 1-D mesh."""
    assert is_dtensor(weight)  # FSDP2 shards parameters as DTensors
    mesh = weight.device_mesh
    if not _row_shard_on_1d_mesh(weight):
        raise ValueError(
            f"{name} is sharded by FSDP2 as {placement_text(weight)}; the loss reads a head sharded over data "
            "parallelism only as Shard(0) on a 1-D mesh (no HSDP, no tensor-parallel dimension): keep the LM head "
            "in its parent's fully_shard unit, where the parent's forward gathers it"
        )
    group = mesh.get_group()
    ranks = tuple(dist.get_process_group_ranks(group))
    coordinate = mesh.get_local_rank()
    vocab_range = chunk_range(weight.shape[0], len(ranks), coordinate)
    divisor = gradient_divide_factor(shard)
    return DataParallelHeads(
        name, group, ranks, coordinate, vocab_range, weight.shape[0], float(len(ranks) if divisor is None else divisor)
    )


def sharded_heads(student_weight: Tensor, teacher_weight: Tensor) -> DataParallelHeads | None:
    """The data-parallel layout of a call whose student or teacher head weight is a parameter that
    FSDP2 holds sharded (the student's, where both are); None where neither is."""
    for name, weight in (("student", student_weight), ("teacher", teacher_weight)):
        shard = fsdp_shard_of(weight)
        if shard is not None:
            return _group_of(f"the {name} head's weight", weight, shard)
    return None


def _local_rows(name: str, tensor: Tensor, heads: DataParallelHeads) -> Tensor:
    """This rank's vocabulary rows of a head tensor: a DTensor's local shard on ``heads``' mesh,
    or a slice of a whole one. Anything else raises a ValueError (alike on every rank: the ranks
    hold the same model structure)."""
    start, stop = heads.vocab_range
    if is_dtensor(tensor):
        same = _row_shard_on_1d_mesh(tensor)
        if not same or tuple(dist.get_process_group_ranks(tensor.device_mesh.get_group())) != heads.ranks:
            raise _mismatch(name, tensor, heads)
        local = tensor.to_local()
    else:
        local = tensor[start:stop]
    if tensor.shape[0] != heads.vocab_size or local.shape[0] != stop - start:
        raise _mismatch(name, tensor, heads)
    return local


class _GradientScale(torch.autograd.Function):
    """``x`` forward; ``scale·g`` backward: the head shard's gradient of the ranks' summed losses
    made FSDP2's mean, leaving the hidden states' gradients (read from the same losses) as they are."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


class _RankLoss(torch.autograd.Function):
    """This rank's loss ``value`` (``sums[r] / d_r``) forward; backward, the ranks' upstream
    gradients ``g`` gathered, so that every rank sends the same ``g_s / d_s`` to rank ``s``'s row
    sum: the sequence-parallel backward adds the ranks' vocabulary slices of each row's gradient."""

    @staticmethod
    def forward(
        ctx: Any, value: Tensor, sums: Tensor, inverse_denominators: Tensor, group: dist.ProcessGroup
    ) -> Tensor:
        ctx.inverse_denominators, ctx.group = inverse_denominators, group
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None, None]:
        gathered = all_gather_rows(grad.reshape(1, 1).to(ctx.inverse_denominators.dtype), ctx.group).view(-1)
        return None, gathered * ctx.inverse_denominators, None, None


def _exchange_rows(rows: int, problem: str | None, heads: DataParallelHeads) -> list[int]:
    """Every rank's row count, after any rank's ``problem`` is raised on every rank (no rank is
    left waiting in a collective)."""
    host = host_group(heads.group)
    claims = all_gather_rows(torch.tensor([[rows, problem is not None]], dtype=torch.int64), host).view(-1, 2)
    if bool(claims[:, 1].any()):
        texts = all_gather_texts(problem or "", host)
        failed = [(rank, text) for rank, text in zip(heads.ranks, texts) if text]
        raise ValueError("; ".join(f"rank {rank}: {text}" for rank, text in failed))
    return claims[:, 0].tolist()


def _padded(tensor: Tensor, rows: int, fill: float = 0.0) -> Tensor:
    """``tensor`` with rows of ``fill`` appended up to ``rows`` (differentiable)."""
    missing = rows - tensor.shape[0]
    if missing == 0:
        return tensor
    return torch.cat([tensor, tensor.new_full((missing, *tensor.shape[1:]), fill)])


@dataclass(frozen=True)
class LocalHeads:
    """This rank's vocabulary rows of both heads: the student's carrying FSDP2's gradient scale
    where they are its shard, the teacher's detached."""

    weight: Tensor
    bias: Tensor | None
    teacher_weight: Tensor
    teacher_bias: Tensor | None

    def with_weights_in(self, dtype: torch.dtype | None) -> LocalHeads:
        """The weights cast to ``dtype`` (the biases as they are; None: unchanged)."""
        if dtype is None:
            return self
        return replace(self, weight=self.weight.to(dtype), teacher_weight=self.teacher_weight.to(dtype))


def _student_rows(name: str, tensor: Tensor, heads: DataParallelHeads) -> Tensor:
    local = _local_rows(name, tensor, heads)
    if not is_dtensor(tensor):
        return local  # a slice of the gathered parameter: its owner's reduce-scatter averages the gradient
    if fsdp_shard_of(tensor) is None:
        # A DTensor no FSDP2 module owns: nothing says how its gradient is reduced.
        raise _mismatch(name, tensor, heads, " (not a parameter FSDP2 shards)")
    return _GradientScale.apply(local, 1.0 / heads.gradient_divisor)


def local_heads(
    heads: DataParallelHeads, weight: Tensor, bias: Tensor | None, teacher_weight: Tensor, teacher_bias: Tensor | None
) -> LocalHeads:
    """This rank's rows of the heads; a tensor sharded any other way than ``heads`` says raises a
    ValueError, alike on every rank."""
    return LocalHeads(
        weight=_student_rows("the student head's weight", weight, heads),
        bias=None if bias is None else _student_rows("the student head's bias", bias, heads),
        teacher_weight=_local_rows("the teacher head's weight", teacher_weight, heads).detach(),
        teacher_bias=None
        if teacher_bias is None
        else _local_rows("the teacher head's bias", teacher_bias, heads).detach(),
    )


def _rows_problem(student_hidden: Tensor, labels: Tensor, teacher_hidden: Tensor) -> str | None:
    """What is wrong with this rank's rows, before they are padded and gathered (None: nothing)."""
    shapes = [tuple(student_hidden.shape), tuple(teacher_hidden.shape), tuple(labels.shape)]
    if student_hidden.dim() != 2 or teacher_hidden.dim() != 2 or labels.dim() != 1:
        return f"the hidden states must be (rows, width) and the labels (rows,), got {shapes}"
    if not student_hidden.shape[0] == teacher_hidden.shape[0] == labels.shape[0]:
        return f"the student's and the teacher's hidden states and the labels must have the same rows, got {shapes}"
    return None


def _gathered_labels(
    labels: Tensor, rows: int, denominator: Tensor | float, heads: DataParallelHeads, ignore_index: int
) -> tuple[Tensor, Tensor]:
    """Every rank's labels, each padded to ``rows`` with ``ignore_index`` and concatenated in rank
    order, and every rank's denominator: one gather (the labels exact in fp64)."""
    device = labels.device
    packed = torch.cat([
        _padded(labels, rows, ignore_index).to(torch.float64),
        torch.as_tensor(denominator, dtype=torch.float64, device=device).reshape(1),
    ])  # fmt: skip
    gathered = all_gather_rows(packed.view(1, -1), heads.group).view(heads.size, rows + 1)
    return gathered[:, :rows].reshape(-1).to(labels.dtype), gathered[:, rows]


def rows_gathered_loss(
    student_hidden: Tensor,
    labels: Tensor,
    teacher_hidden: Tensor,
    heads: DataParallelHeads,
    local: LocalHeads,
    denominator: Tensor | float,
    **keywords: Any,
) -> DistillationLossOutput:
    """:func:`orda_tp.distillation_loss` of this rank's rows ``student_hidden`` (n, H_s), ``labels``
    (n,) and ``teacher_hidden`` (n, H_t) (a :class:`SeparateTeacher`) through the heads' rows
    ``local`` (:func:`local_heads`), with ``keywords`` (no reduction, tensor-parallel keyword or
    token weights): every field is this rank's rows' sum, the loss divided by ``denominator``, with
    the module's gradient contract. Every rank of ``heads.group`` must call it."""
    problem = _rows_problem(student_hidden, labels, teacher_hidden)
    rows = max(_exchange_rows(labels.shape[0] if problem is None else 0, problem, heads))
    ignore_index = keywords.get("ignore_index", -100)
    all_labels, denominators = _gathered_labels(labels, rows, denominator, heads, ignore_index)
    teacher = SeparateTeacher(_padded(teacher_hidden.detach(), rows), local.teacher_weight, bias=local.teacher_bias)
    output = distillation_loss(
        _padded(student_hidden, rows),
        local.weight,
        all_labels,
        teacher,
        bias=local.bias,
        tp_group=heads.group,
        sequence_parallel=True,
        vocab_range=heads.vocab_range,
        vocab_size=heads.vocab_size,
        reduction="none",
        **keywords,
    )
    # Each rank's rows' sum: the same (size,) on every rank.
    sums = output.loss.view(heads.size, rows).sum(dim=1)
    own = sums[heads.coordinate].detach() / denominator
    loss = _RankLoss.apply(own, sums, (1.0 / denominators).to(sums.dtype), heads.group)
    reports = (field.view(heads.size, rows)[heads.coordinate].sum() for field in output[1:])
    return DistillationLossOutput(loss, *reports)
