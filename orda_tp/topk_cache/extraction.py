"""A teacher's top-k log-probabilities, extracted without its (tokens × vocab) logits:
:func:`teacher_topk` (from hidden states and an LM head) and :func:`teacher_topk_of_logits` (from
logits a caller holds), on one device or over a tensor-parallel group (docs/architecture.md, "The
top-k extraction")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import Shard

from ..arguments.config import ExecutionConfig
from ..arguments.options import BACKENDS, check_group
from ..arguments.orda_kernel import own_config
from ..arguments.validation import check_choice, check_count, check_floating, check_number, check_same_device
from ..engine.call import Call, agree, prepare_call, raised_on_every_rank
from ..engine.logits import HeadLogits, SideLogits, StoredLogits, statistics_dtype
from ..engine.row_walk import row_ranges
from ..engine.topk_rows import KERNEL_MAX_K, UNSEEN, TopKRows, block_topk, merge_topk
from ..engine.workspace import row_layout
from ..parallel.dtensor import is_dtensor, local_shard, placement_text, shard_axis
from ..parallel.layout import HeadShard, LocalShard
from ..parallel.local_shards import call_group, same_ranks
from ..teachers import PrecomputedTeacher

__all__ = ["TeacherTopK", "TopKPlan", "teacher_topk", "teacher_topk_of_logits"]


class TeacherTopK(NamedTuple):
    """Per row: ``ids`` (rows, k) int64 global vocabulary ids, ``logprobs`` (rows, k) their
    log-probabilities (fp32; fp64 for fp64 inputs), largest first, and ``log_partition`` (rows,)
    the ``LSE`` of the scaled logits over the real vocabulary; and what they were extracted at:
    the ``temperature``, the ``logit_softcap`` and the real ``vocab_size``."""

    ids: Tensor
    logprobs: Tensor
    log_partition: Tensor
    temperature: float = 1.0
    logit_softcap: float | None = None
    vocab_size: int | None = None

    def teacher(self, tail: str = "uniform", *, retemper: bool = False) -> PrecomputedTeacher:
        """The cache as the teacher of a loss (``tail``: :class:`PrecomputedTeacher`'s), the teacher at
        the temperature it was extracted at (``retemper``: :class:`PrecomputedTeacher`'s)."""
        return PrecomputedTeacher(
            topk_ids=self.ids,
            topk_logprobs=self.logprobs,
            tail=tail,
            topk_temperature=self.temperature,
            topk_softcap=self.logit_softcap,
            retemper=retemper,
        )


@dataclass(frozen=True)
class TopKPlan:
    """What an extraction computes: the ``k`` best columns of ``cap(z)/temperature`` (``logit_softcap``
    the cap, None for none) over a real vocabulary of ``vocab_size`` columns (None: every column), on
    the ``backend`` asked for, with its execution settings (``config``)."""

    k: int
    temperature: float
    logit_softcap: float | None
    vocab_size: int | None
    backend: str
    config: ExecutionConfig

    @staticmethod
    def checked(
        k: object, temperature: object, logit_softcap: object, vocab_size: object, backend: object, config: object
    ) -> TopKPlan:
        """The plan of the keywords, each checked."""
        if config is not None and not isinstance(config, ExecutionConfig):
            raise TypeError(f"config must be an orda_tp.KernelConfig or None, got {type(config).__name__}")
        own = ExecutionConfig() if config is None else own_config(config)
        return TopKPlan(
            k=check_count("k", k, 1),
            temperature=check_number("temperature", temperature, positive=True),
            logit_softcap=None
            if logit_softcap is None
            else check_number("logit_softcap", logit_softcap, positive=True),
            vocab_size=None if vocab_size is None else check_count("vocab_size", vocab_size, 1),
            backend=check_choice("backend", backend, BACKENDS),
            # Host checks always: an extraction is offline, and a head that is not a shard must raise on every rank.
            config=ExecutionConfig(**{**vars(own), "host_checks": True}),
        )

    def text(self) -> str:
        """The settings every rank of a group must share, as ``name=value`` lines."""
        return "\n".join(f"{name}={value!r}" for name, value in vars(self).items())


def _check_tp_group(tp_group: object, mesh_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The call's group: ``tp_group`` (a process group, or None), or a DTensor's mesh group."""
    tp_group = check_group(tp_group)
    if tp_group is not None and mesh_group is not None and not same_ranks(tp_group, mesh_group):
        raise ValueError("tp_group must be the process group of the DTensor's tensor-parallel mesh dimension")
    return tp_group if tp_group is not None else mesh_group


def _local_shard(head: HeadShard, rows: int, plan: TopKPlan, replicated: tuple[str, Tensor] | None) -> LocalShard:
    """This rank's share for the handshake: its head, ``rows`` rows (as labels, which every rank
    must agree on; the extraction reads none) and the tensor every rank must hold alike."""
    # Stand-in labels (zeros, never read): through them the handshake checks every rank's row count.
    labels = torch.zeros(rows, dtype=torch.int64, device=head.tensor.device)
    return LocalShard(
        head=head, labels=labels, vocab_size=plan.vocab_size, replicated=(replicated,) if replicated else ()
    )


def _prepared(group: dist.ProcessGroup | None, shard: LocalShard, plan: TopKPlan, dtype: torch.dtype) -> Call[TopKPlan]:
    """The extraction's call: the layout agreed, the vocabulary checked against ``k``, then every
    door's constructor (the exchange, the backend: the kernels extract ``k`` ≤
    :data:`~orda_tp.engine.topk_rows.KERNEL_MAX_K`)."""
    layout = agree(group, shard, True, plan.text)
    if layout.vocab_size > layout.total_columns:
        raise ValueError(f"vocab_size must lie in [1, {layout.total_columns}] (the columns), got {layout.vocab_size}")
    if plan.k > layout.vocab_size:
        raise ValueError(f"k must be at most the real vocabulary ({layout.vocab_size} ids), got k={plan.k}")
    refused = None
    if plan.k > KERNEL_MAX_K:
        refused = f"the Triton kernel extracts k <= {KERNEL_MAX_K}, got k={plan.k} (use backend='torch')"
    return prepare_call(
        plan, layout, shard.labels, backend=plan.backend, dtype=dtype, ignore_index=None, reads_labels=False,
        refused=refused,
    )  # fmt: skip


def teacher_topk(
    hidden: Tensor,
    weight: Tensor,
    k: int,
    *,
    temperature: float = 1.0,
    logit_softcap: float | None = None,
    vocab_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    backend: str = "auto",
    config: ExecutionConfig | None = None,
) -> TeacherTopK:
    """The ``k`` largest log-probabilities per row of the teacher ``t = cap(z)/temperature``,
    ``z = hidden · weightᵀ`` (``cap(z) = c·tanh(z/c)`` with ``logit_softcap=c``), over the real
    vocabulary, without the (rows × V) logits: a :class:`TeacherTopK`, largest first, equal values
    by id, lowest first (the same on every backend and sharding). Runs without autograd.

    ``hidden`` (rows, H): the teacher's final hidden states, the same on every rank of a group (a
    DTensor: Replicate); ``weight`` (V_local, H): its LM head, or this rank's vocabulary shard with
    ``tp_group`` (shards in rank order; a DTensor: ``Shard(0)``), every rank then returning the same
    result. ``vocab_size``: the real vocabulary, when the head has padding rows past it (never read).
    ``backend``: "auto" (Triton on CUDA with fp32 statistics and ``k ≤ 256``, else "torch"),
    "triton", "torch" or "reference" (fp64). ``config``: its ``chunk_size``, ``workspace_mib`` and
    ``vocab_block``."""
    with raised_on_every_rank(lambda: call_group(weight, tp_group)):
        plan = TopKPlan.checked(k, temperature, logit_softcap, vocab_size, backend, config)
        check_floating("hidden", hidden, "(rows, hidden)", dims=2)
        check_floating("weight", weight, "(vocab, hidden)", dims=2)
        axis = shard_axis(weight, "weight") if is_dtensor(weight) else None
        group = _check_tp_group(tp_group, None if axis is None else axis.group)
        if is_dtensor(hidden) and axis is None:
            raise ValueError("hidden is a DTensor but weight is not: pass weight as a Shard(0) DTensor too")
        local_hidden = local_shard(hidden, axis, "hidden", ())[0] if is_dtensor(hidden) and axis else hidden
        local_weight = weight.to_local() if is_dtensor(weight) else weight
        if local_hidden.shape[1] != local_weight.shape[1]:
            raise ValueError(
                f"hidden and weight must share the hidden size, got shapes {tuple(local_hidden.shape)} and "
                f"{tuple(local_weight.shape)}"
            )
        check_same_device("hidden", local_hidden.device, [("weight", local_weight)])
        # Every rank must pass the same hidden rows: the handshake compares them.
        replicated = ("hidden", local_hidden) if group is not None else None
        shard = _local_shard(HeadShard("weight", local_weight, 0), local_hidden.shape[0], plan, replicated)
    dtype = statistics_dtype(local_hidden, local_weight)
    with torch.no_grad():
        return _extract(_prepared(group, shard, plan, dtype), HeadLogits(local_hidden, local_weight), dtype)


def _local_logits(logits: Tensor) -> tuple[Tensor, dist.ProcessGroup | None]:
    """This rank's columns of ``logits`` and the group of a DTensor's 1-D mesh (``Shard(1)``)."""
    if not is_dtensor(logits):
        return logits, None
    mesh, placements = logits.device_mesh, tuple(logits.placements)
    if mesh.ndim != 1 or not (isinstance(placements[0], Shard) and placements[0].dim in (1, -1)):
        raise ValueError(
            f"logits as a DTensor must be Shard(1) (its vocabulary columns) on a 1-D mesh, got {placement_text(logits)}"
        )
    return logits.to_local(), mesh.get_group()


def teacher_topk_of_logits(
    logits: Tensor,
    k: int,
    *,
    temperature: float = 1.0,
    logit_softcap: float | None = None,
    vocab_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    backend: str = "auto",
    config: ExecutionConfig | None = None,
) -> TeacherTopK:
    """:func:`teacher_topk` of logits a caller holds: ``logits`` (rows, V_local), the whole
    vocabulary or this rank's columns of it with ``tp_group`` (a DTensor: ``Shard(1)``), in any
    floating dtype (read as stored; never copied whole)."""
    with raised_on_every_rank(lambda: call_group(logits, tp_group)):
        plan = TopKPlan.checked(k, temperature, logit_softcap, vocab_size, backend, config)
        check_floating("logits", logits, "(rows, vocab)", dims=2)
        local, mesh_group = _local_logits(logits)
        group = _check_tp_group(tp_group, mesh_group)
        shard = _local_shard(HeadShard("logits", local, 1), local.shape[0], plan, None)
    dtype = statistics_dtype(local)
    with torch.no_grad():
        return _extract(_prepared(group, shard, plan, dtype), StoredLogits(local), dtype)


def _local_topk(call: Call[TopKPlan], source: SideLogits, begin: int, end: int, dtype: torch.dtype) -> TopKRows:
    """This rank's candidates and log-partition for rows ``[begin, end)`` (in ``dtype``), merged
    block by block: the kernels' whole chunk at once (its logits in fp32, stored logits as stored),
    the torch backend's blocks of ``vocab_block`` columns, the reference's one fp64 block."""
    plan, layout, math = call.plan, call.layout, call.math
    real, first_id = layout.real_local_columns, layout.vocab_start
    if real == 0:  # a shard of padding only: no candidate, log-partition −inf
        empty = torch.full((end - begin, plan.k), float("-inf"), dtype=dtype, device=call.labels.device)
        return TopKRows(empty, torch.full_like(empty, UNSEEN, dtype=torch.int64), empty[:, 0])
    whole = math is None or math.whole_blocks
    width = real if whole else min(plan.config.vocab_block, real)
    as_stored = math is not None and math.reads_stored_cache
    # The kernels take a formed block in fp32 and stored logits as stored; the others, blocks in ``dtype``.
    block_dtype = torch.float32 if as_stored else dtype
    topk = block_topk if math is None else math.topk
    found: TopKRows | None = None
    for start in range(0, real, width):
        block = source.block(begin, end, start, min(real, start + width), block_dtype, as_stored)
        part = topk(block, plan.k, first_id + start, plan.temperature, plan.logit_softcap)
        # Merged block by block: a row holds k candidates at a time, whatever the vocabulary.
        found = part if found is None else merge_topk([found, part], plan.k)
    assert found is not None
    return found


def _as_int64(values: Tensor) -> Tensor:
    """fp32/fp64 ``values`` bit for bit in int64 (fp32 sign-extended from its int32 bits)."""
    return values.view(torch.int64) if values.dtype == torch.float64 else values.view(torch.int32).to(torch.int64)


def _from_int64(packed: Tensor, dtype: torch.dtype) -> Tensor:
    return packed.contiguous().view(dtype) if dtype == torch.float64 else packed.to(torch.int32).view(dtype)


def _merged_across(call: Call[TopKPlan], local: TopKRows) -> TopKRows:
    """Every rank's candidates and log-partitions of the same rows, gathered by the exchange in one
    all-gather of ``(rows, 2k + 1)`` int64 and merged (the same on every rank)."""
    assert call.exchange is not None
    k, dtype = call.plan.k, local.values.dtype
    # One int64 all-gather: the values and log-sums travel as their bit patterns, exactly.
    packed = torch.cat([_as_int64(local.values), local.ids, _as_int64(local.log_sum[:, None])], dim=1)
    parts = [
        TopKRows(_from_int64(part[:, :k], dtype), part[:, k : 2 * k], _from_int64(part[:, 2 * k], dtype))
        for part in call.exchange.gather_stacked(packed)
    ]
    return merge_topk(parts, k)


def _extract(call: Call[TopKPlan], source: SideLogits, dtype: torch.dtype) -> TeacherTopK:
    """The chunks' candidates, merged across the group, as log-probabilities; raises on every rank
    (the merged values are the same on each) where a row's log-partition is not finite. Rows per
    chunk: the workspace's (:func:`~orda_tp.engine.workspace.row_layout`, a chunk's logits over the
    widest shard in ``dtype``); the reference backend walks every row at once, in fp64."""
    plan, layout, rows, device = call.plan, call.layout, call.labels.shape[0], call.labels.device
    if call.math is None:  # the reference: every row at once, in fp64
        dtype, chunk = torch.float64, max(rows, 1)
    else:
        shards, workspace = layout.world_size, layout.workspace_mib
        chunk = row_layout(plan.config, rows, layout.max_local_columns, dtype.itemsize, 0, shards, workspace).chunk_rows
    ids = torch.empty(rows, plan.k, dtype=torch.int64, device=device)
    logprobs = torch.empty(rows, plan.k, dtype=dtype, device=device)
    log_partition = torch.empty(rows, dtype=dtype, device=device)
    for begin, end in row_ranges(0, rows, chunk):
        found = _local_topk(call, source, begin, end, dtype)
        if call.exchange is not None:
            found = _merged_across(call, found)
        ids[begin:end], log_partition[begin:end] = found.ids, found.log_partition
        # Relative to the row's best value: a peaked row's log-probabilities stay as exact as log_softmax's.
        logprobs[begin:end] = (found.values - found.values[:, :1]) - found.log_sum[:, None]
    bad = ~torch.isfinite(log_partition)
    # One host read; the merged values are the same on every rank, so every rank raises alike.
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"the teacher's scaled logits of row {row} hold NaN or +inf, or no finite value (log-partition "
            f"{float(log_partition[row])}): check the hidden states and the head (or the logits)"
        )
    return TeacherTopK(ids, logprobs, log_partition, plan.temperature, plan.logit_softcap, layout.vocab_size)
