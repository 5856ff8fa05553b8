"""A teacher's top-k log-probabilities, extracted without its (tokens × vocab) logits.

:func:`teacher_topk` (from hidden states and an LM head) and :func:`teacher_topk_of_logits` (from
logits a caller holds) return, for every row, the ``k`` largest log-probabilities of the scaled
teacher ``t = cap(z)/T`` (``z`` the logits, ``cap(z) = c·tanh(z/c)`` with ``logit_softcap=c``),
their global vocabulary ids and the row's log-partition over the real vocabulary::

    log_partition = LSE_{j < V} t_j,        logprobs = t_{ids} − log_partition

ordered by log-probability, largest first, and among equal values by id, lowest first (the order
of :mod:`orda_tp.engine.topk_rows`, the same on every backend and for every sharding). Padding
columns (at or past ``vocab_size``) are never read. The rows are walked in chunks whose fp32
logits fit the workspace (``KernelConfig.workspace_mib``, default :data:`WORKSPACE_MIB`); on CUDA
the Triton kernel (:mod:`orda_tp.kernels.topk`) reads each chunk's logits once, elsewhere the
torch backend sorts them block by block (``KernelConfig.vocab_block`` columns); "reference" forms
each rank's logits in fp64 at once, the oracle.

Under tensor parallelism (``tp_group``, or a DTensor head ``Shard(0)`` / logits ``Shard(1)``)
every rank passes its vocabulary shard (in rank order) and the same hidden rows; each rank's
candidates and log-partition are gathered once per chunk and merged, so every rank returns the
same, single-device result. The result is what ``PrecomputedTeacher(topk_ids=, topk_logprobs=)``
reads (:meth:`TeacherTopK.teacher`) and what :mod:`orda_tp.topk_cache` stores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import Shard

from ..arguments.config import ExecutionConfig
from ..arguments.options import check_group
from ..arguments.orda_kernel import own_config
from ..arguments.validation import check_choice, check_count, check_floating, check_number, check_same_device
from ..engine.logits import logits_mm, softcapped, statistics_dtype
from ..engine.topk_rows import UNSEEN, TopKRows, block_topk, kernel_topk, merge_topk
from ..kernels import unavailable_reason
from ..loss import agreed_call
from ..parallel.collectives import all_gather_rows
from ..parallel.dtensor import is_dtensor, local_shard, placement_text, shard_axis
from ..parallel.layout import HeadShard, LocalShard, VocabLayout
from ..parallel.local_shards import call_group, same_ranks
from ..teachers import PrecomputedTeacher

__all__ = ["BACKENDS", "KERNEL_MAX_K", "WORKSPACE_MIB", "TeacherTopK", "teacher_topk", "teacher_topk_of_logits"]

BACKENDS = ("auto", "triton", "torch", "reference")
#: The default workspace: a chunk's fp32 logits over the widest shard fit in it.
WORKSPACE_MIB = 512
#: The largest ``k`` the Triton kernel extracts ("auto" takes the torch backend above it).
KERNEL_MAX_K = 256


class TeacherTopK(NamedTuple):
    """Per row: ``ids`` (rows, k) int64 global vocabulary ids, ``logprobs`` (rows, k) their
    log-probabilities (fp32; fp64 for fp64 inputs), largest first, and ``log_partition`` (rows,)
    the ``LSE`` of the scaled logits over the real vocabulary."""

    ids: Tensor
    logprobs: Tensor
    log_partition: Tensor

    def teacher(self, tail: str = "uniform") -> PrecomputedTeacher:
        """The cache as the teacher of a loss (``tail``: :class:`PrecomputedTeacher`'s)."""
        return PrecomputedTeacher(topk_ids=self.ids, topk_logprobs=self.logprobs, tail=tail)


@dataclass(frozen=True)
class _Extraction:
    """A call's checked settings and the backend it runs: "triton", "torch" or "reference"."""

    k: int
    temperature: float
    logit_softcap: float | None
    vocab_size: int | None
    backend: str
    config: ExecutionConfig

    def text(self) -> str:
        """The settings every rank of a group must share, as ``name=value`` lines."""
        return "\n".join(f"{name}={value!r}" for name, value in vars(self).items())


def _settings(
    k: object, temperature: object, logit_softcap: object, vocab_size: object, backend: object, config: object,
    device: torch.device, dtype: torch.dtype,
) -> _Extraction:  # fmt: skip
    """The checked keywords, with the backend "auto" resolved for inputs on ``device``
    whose statistics are ``dtype``."""
    k = check_count("k", k, 1)
    temperature = check_number("temperature", temperature, positive=True)
    cap = None if logit_softcap is None else check_number("logit_softcap", logit_softcap, positive=True)
    vocab = None if vocab_size is None else check_count("vocab_size", vocab_size, 1)
    backend = check_choice("backend", backend, BACKENDS)
    if config is not None and not isinstance(config, ExecutionConfig):
        raise TypeError(f"config must be an orda_tp.KernelConfig or None, got {type(config).__name__}")
    reason = unavailable_reason(device, dtype)
    if backend == "triton" and reason is not None:
        raise ValueError(f"backend='triton' is unavailable for these inputs: {reason}")
    if backend == "triton" and k > KERNEL_MAX_K:
        raise ValueError(f"backend='triton' extracts k <= {KERNEL_MAX_K}, got k={k} (use backend='torch')")
    if backend == "auto":
        backend = "triton" if reason is None and device.type == "cuda" and k <= KERNEL_MAX_K else "torch"
    return _Extraction(
        k, temperature, cap, vocab, backend, own_config(config) if config is not None else ExecutionConfig()
    )


def _check_tp_group(tp_group: object, mesh_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The call's group: ``tp_group`` (a process group, or None), or a DTensor's mesh group."""
    tp_group = check_group(tp_group)
    if tp_group is not None and mesh_group is not None and not same_ranks(tp_group, mesh_group):
        raise ValueError("tp_group must be the process group of the DTensor's tensor-parallel mesh dimension")
    return tp_group if tp_group is not None else mesh_group


class _Source(NamedTuple):
    """Where a chunk's logits come from: ``block(b, e, s, t, dtype)``, rows ``[b, e)`` on local
    columns ``[s, t)`` as a new tensor of ``dtype`` (the torch backends scale it in place);
    ``kernel(b, e)``, rows ``[b, e)`` on every real local column, as the kernel reads them (fp32,
    or stored logits as stored; columns contiguous)."""

    block: Callable[[int, int, int, int, torch.dtype], Tensor]
    kernel: Callable[[int, int], Tensor]


def _agreed(
    group: dist.ProcessGroup | None, checks: Callable[[], tuple[tuple[Tensor, ...], _Extraction, LocalShard]]
) -> tuple[tuple[Tensor, ...], _Extraction, VocabLayout]:
    """:func:`orda_tp.loss.agreed_call` of an extraction (host checks on: an extraction is offline, and
    a head that is not a vocabulary shard must raise on every rank), and its vocabulary checked."""
    held: list[_Extraction] = []

    def checked() -> tuple[tuple[Tensor, ...], LocalShard]:
        tensors, settings, shard = checks()
        held.append(settings)
        return tensors, shard

    tensors, layout = agreed_call(group, checked, True, lambda: held[0].text())
    settings = held[0]
    if layout.vocab_size > layout.total_columns:
        raise ValueError(f"vocab_size must lie in [1, {layout.total_columns}] (the columns), got {layout.vocab_size}")
    if settings.k > layout.vocab_size:
        raise ValueError(f"k must be at most the real vocabulary ({layout.vocab_size} ids), got k={settings.k}")
    return tensors, settings, layout


def _local_shard(
    head: HeadShard, rows: int, settings: _Extraction, replicated: tuple[str, Tensor] | None
) -> LocalShard:
    """This rank's share for the handshake: its head, ``rows`` rows (as labels, which every rank
    must agree on) and the tensor every rank must hold alike."""
    labels = torch.zeros(rows, dtype=torch.int64, device=head.tensor.device)
    return LocalShard(
        head=head, labels=labels, vocab_size=settings.vocab_size, replicated=(replicated,) if replicated else ()
    )


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
    """The top-``k`` log-probabilities of the teacher ``hidden · weightᵀ`` (module docstring).

    ``hidden`` (rows, H): the teacher's final hidden states, the same on every rank of a group (a
    DTensor: Replicate); ``weight`` (V_local, H): its LM head, or this rank's vocabulary shard
    with ``tp_group`` (a DTensor: ``Shard(0)``); ``vocab_size``: the real vocabulary, when the
    head has padding rows past it. Runs without autograd."""

    def checks() -> tuple[tuple[Tensor, ...], _Extraction, LocalShard]:
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
        dtype = statistics_dtype(local_hidden, local_weight)
        settings = _settings(k, temperature, logit_softcap, vocab_size, backend, config, local_hidden.device, dtype)
        replicated = ("hidden", local_hidden) if group is not None else None
        shard = _local_shard(HeadShard("weight", local_weight, 0), local_hidden.shape[0], settings, replicated)
        return (local_hidden, local_weight), settings, shard

    (local_hidden, local_weight), settings, layout = _agreed(call_group(weight, tp_group), checks)
    real = layout.real_local_columns
    source = _Source(
        block=lambda b, e, s, t, dtype: logits_mm(local_hidden[b:e], local_weight[s:t], dtype),
        kernel=lambda b, e: logits_mm(local_hidden[b:e], local_weight[:real], torch.float32),
    )
    with torch.no_grad():
        dtype = statistics_dtype(local_hidden, local_weight)
        return _extract(source, local_hidden.shape[0], dtype, local_hidden.device, layout, settings)


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

    def checks() -> tuple[tuple[Tensor, ...], _Extraction, LocalShard]:
        check_floating("logits", logits, "(rows, vocab)", dims=2)
        local, mesh_group = _local_logits(logits)
        _check_tp_group(tp_group, mesh_group)
        settings = _settings(k, temperature, logit_softcap, vocab_size, backend, config, local.device, local.dtype)
        return (local,), settings, _local_shard(HeadShard("logits", local, 1), local.shape[0], settings, None)

    (local,), settings, layout = _agreed(call_group(logits, tp_group), checks)
    real = layout.real_local_columns
    source = _Source(
        block=lambda b, e, s, t, dtype: local[b:e, s:t].to(dtype, copy=True),
        kernel=lambda b, e: local[b:e, :real] if local.stride(1) == 1 else local[b:e, :real].contiguous(),
    )
    with torch.no_grad():
        return _extract(source, local.shape[0], statistics_dtype(local), local.device, layout, settings)


def _chunk_rows(config: ExecutionConfig, columns: int) -> int:
    """Rows per chunk: ``config.chunk_size.nrows``, or as many as keep fp32 logits over ``columns``
    (the widest shard's: the same on every rank) within the workspace, a multiple of 64 where
    that is at least 64."""
    if config.chunk_size.nrows is not None:
        return config.chunk_size.nrows
    budget = (WORKSPACE_MIB if config.workspace_mib is None else config.workspace_mib) << 20
    rows = budget // (4 * max(columns, 1))
    return max(1, rows - rows % 64 if rows >= 64 else rows)


def _scaled(logits: Tensor, settings: _Extraction) -> Tensor:
    """``cap(logits)/T`` in place."""
    softcapped(logits, settings.logit_softcap)
    return logits if settings.temperature == 1.0 else logits.div_(settings.temperature)


def _local_topk(
    source: _Source,
    rows: tuple[int, int],
    dtype: torch.dtype,
    device: torch.device,
    layout: VocabLayout,
    s: _Extraction,
) -> TopKRows:
    """This rank's candidates and log-partition for ``rows`` ``[begin, end)`` (on ``device``, in
    ``dtype``): from the kernel, or merged block by block (the reference: one block)."""
    (begin, end), real, first_id = rows, layout.real_local_columns, layout.vocab_start
    if real == 0:  # a shard of padding only
        empty = torch.full((end - begin, s.k), float("-inf"), dtype=dtype, device=device)
        return TopKRows(empty, torch.full_like(empty, UNSEEN, dtype=torch.int64), empty[:, 0])  # log_sum: -inf
    if s.backend == "triton":
        return kernel_topk(source.kernel(begin, end), s.k, first_id, 1.0 / s.temperature, s.logit_softcap)
    width = real if s.backend == "reference" else min(s.config.vocab_block, real)
    found: TopKRows | None = None
    for start in range(0, real, width):
        stop = min(real, start + width)
        block = block_topk(_scaled(source.block(begin, end, start, stop, dtype), s), first_id + start, s.k)
        found = block if found is None else merge_topk([found, block], s.k)
    assert found is not None
    return found


def _as_int64(values: Tensor) -> Tensor:
    """fp32/fp64 ``values`` bit for bit in int64 (fp32 sign-extended from its int32 bits)."""
    return values.view(torch.int64) if values.dtype == torch.float64 else values.view(torch.int32).to(torch.int64)


def _from_int64(packed: Tensor, dtype: torch.dtype) -> Tensor:
    return packed.contiguous().view(dtype) if dtype == torch.float64 else packed.to(torch.int32).view(dtype)


def _merged_across(local: TopKRows, k: int, group: dist.ProcessGroup) -> TopKRows:
    """Every rank's candidates and log-partitions of the same rows, gathered in one all-gather of
    ``(rows, 2k + 1)`` int64 and merged (the same on every rank)."""
    dtype = local.values.dtype
    packed = torch.cat([_as_int64(local.values), local.ids, _as_int64(local.log_sum[:, None])], dim=1)
    parts = [
        TopKRows(_from_int64(part[:, :k], dtype), part[:, k : 2 * k], _from_int64(part[:, 2 * k], dtype))
        for part in all_gather_rows(packed, group)
    ]
    return merge_topk(parts, k)


def _extract(
    source: _Source, rows: int, dtype: torch.dtype, device: torch.device, layout: VocabLayout, settings: _Extraction
) -> TeacherTopK:
    """The chunks' candidates, merged across the group, as log-probabilities; raises on every rank
    (the merged values are the same on each) where a row's log-partition is not finite."""
    k = settings.k
    dtype = torch.float64 if settings.backend == "reference" else dtype
    chunk = rows if settings.backend == "reference" else _chunk_rows(settings.config, layout.max_local_columns)
    ids = torch.empty(rows, k, dtype=torch.int64, device=device)
    logprobs = torch.empty(rows, k, dtype=dtype, device=device)
    log_partition = torch.empty(rows, dtype=dtype, device=device)
    for begin in range(0, rows, max(chunk, 1)):
        end = min(rows, begin + chunk)
        found = _local_topk(source, (begin, end), dtype, device, layout, settings)
        if layout.group is not None:
            found = _merged_across(found, k, layout.group)
        ids[begin:end], log_partition[begin:end] = found.ids, found.log_partition
        logprobs[begin:end] = (found.values - found.values[:, :1]) - found.log_sum[:, None]
    bad = ~torch.isfinite(log_partition)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"the teacher's scaled logits of row {row} hold NaN or +inf, or no finite value (log-partition "
            f"{float(log_partition[row])}): check the hidden states and the head (or the logits)"
        )
    return TeacherTopK(ids, logprobs, log_partition)
