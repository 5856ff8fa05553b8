"""The few collectives of a tensor-parallel loss call, each issued once per use.

- :func:`all_gather_rows`: gather a (rows, K) tensor from every rank, stacked in rank order.
- :func:`gather_sequence_rows`: sequence parallelism's row gather of several hidden tensors in one
  collective.
- :func:`reduce_scatter_rows`: under sequence parallelism, sum the hidden gradients over the
  shards and keep this rank's rows, in one collective (without it, the row walk all-reduces each
  row group's hidden gradients as they complete: ``ShardExchange.start_row_gradient_sum``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_gather_rows", "gather_sequence_rows", "reduce_scatter_rows"]


def all_gather_rows(local: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every rank's (rows, K) ``local`` (same shape on all ranks) stacked in rank order as
    (world, rows, K), gathered straight into one tensor."""
    local = local.contiguous()
    world = dist.get_world_size(group)
    gathered = local.new_empty(world * local.shape[0], *local.shape[1:])  # concatenated along rows
    dist.all_gather_into_tensor(gathered, local, group=group)
    return gathered.view(world, *local.shape)


def _pack_columns(tensors: list[Tensor]) -> tuple[Tensor, list[int]]:
    dtype = tensors[0].dtype
    for tensor in tensors[1:]:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return torch.cat([t.to(dtype) for t in tensors], dim=1), [t.shape[1] for t in tensors]


def gather_sequence_rows(tensors: list[Tensor], group: dist.ProcessGroup) -> list[Tensor]:
    """Full-batch rows of each (local_rows, width_i) tensor: the ranks' rows in rank order."""
    packed, widths = _pack_columns([t.detach() for t in tensors])
    full = all_gather_rows(packed, group).flatten(0, 1)
    return [part.to(t.dtype) for part, t in zip(full.split(widths, dim=1), tensors)]


def reduce_scatter_rows(grads: list[Tensor], group: dist.ProcessGroup) -> list[Tensor]:
    """Sequence parallelism: each (rows, width_i) gradient summed over the ranks, keeping this
    rank's rows (reduce-scatter where the backend has it, else all-reduce and slice), in one
    collective."""
    packed, widths = _pack_columns(grads)
    world = dist.get_world_size(group)
    rows = packed.shape[0] // world
    if dist.get_backend(group) == dist.Backend.NCCL:
        local = torch.empty(rows, packed.shape[1], dtype=packed.dtype, device=packed.device)
        dist.reduce_scatter_tensor(local, packed, group=group)
        packed = local
    else:
        dist.all_reduce(packed, group=group)
        start = dist.get_rank(group) * rows
        packed = packed[start : start + rows]
    return list(packed.split(widths, dim=1))
