"""DTensor inputs: the tensor-parallel group, vocabulary range and sequence parallelism read off
the placements, and the local shards handed to the loss through the differentiable
``DTensor.to_local`` (docs/architecture.md, "Inputs").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard

import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # torch without DTensor
    DTensor = None  # type: ignore[assignment, misc]  # the fallback binding; mypy reads the installed torch

__all__ = ["MeshAxis", "chunk_range", "is_dtensor", "local_shard", "mesh_group", "placement_text", "shard_axis"]


def is_dtensor(value: object) -> TypeGuard[DTensor]:
    return DTensor is not None and isinstance(value, DTensor)


@dataclass(frozen=True)
class MeshAxis:
    """The tensor-parallel dimension of a DTensor's mesh: its group and this rank's coordinate."""

    group: dist.ProcessGroup
    dim: int
    size: int
    coordinate: int
    mesh: DeviceMesh


def placement_text(tensor: DTensor) -> str:
    return f"{tuple(tensor.placements)} on mesh {tensor.device_mesh}"


def _is_shard(placement: object, dims: tuple[int, ...]) -> bool:
    return isinstance(placement, Shard) and placement.dim in dims


def shard_axis(weight: DTensor, name: str) -> MeshAxis:
    """The mesh dimension along which a head ``weight`` DTensor is sharded on its rows."""
    placements = tuple(weight.placements)
    sharded = [i for i, p in enumerate(placements) if _is_shard(p, (0,))]
    others_ok = all(isinstance(p, Replicate) for i, p in enumerate(placements) if i not in sharded)
    if len(sharded) != 1 or not others_ok:
        raise ValueError(
            f"{name} as a DTensor must be Shard(0) on exactly one mesh dimension (the tensor-parallel one) and "
            f"Replicate on the others, got {placement_text(weight)}"
        )
    mesh = weight.device_mesh
    dim = sharded[0]
    return MeshAxis(mesh.get_group(dim), dim, mesh.size(dim), mesh.get_local_rank(dim), mesh)


def chunk_range(total: int, parts: int, coordinate: int) -> tuple[int, int]:
    """Rows of part ``coordinate`` when ``total`` rows are split in ``torch.chunk`` order."""
    size = -(-total // parts) if total else 0  # torch.chunk: ceil(total/parts) each, the last parts short or empty
    start = min(coordinate * size, total)
    return start, min(start + size, total)


def local_shard(tensor: DTensor, axis: MeshAxis, name: str, shard_dims: tuple[int, ...]) -> tuple[Tensor, bool]:
    """``(local tensor, sharded on the tp axis)`` of a DTensor on ``axis``'s mesh: Replicate or Shard
    on one of ``shard_dims`` on the tp axis, Replicate or Shard(0) (data-parallel rows) elsewhere."""
    if tensor.device_mesh != axis.mesh:
        raise ValueError(f"{name} is a DTensor on another mesh than the head weight: {placement_text(tensor)}")
    placements = tuple(tensor.placements)
    tp_placement = placements[axis.dim]
    others_ok = all(isinstance(p, Replicate) or _is_shard(p, (0,)) for i, p in enumerate(placements) if i != axis.dim)
    sharded = _is_shard(tp_placement, shard_dims)
    if not others_ok or not (sharded or isinstance(tp_placement, Replicate)):
        raise ValueError(f"{name} has a DTensor placement this loss cannot handle: {placement_text(tensor)}")
    if sharded and any(_is_shard(p, (0,)) for i, p in enumerate(placements) if i != axis.dim) and 0 in shard_dims:
        raise ValueError(
            f"{name} is row-sharded on two mesh dimensions, which this loss cannot handle: {placement_text(tensor)}"
        )
    return tensor.to_local(), sharded


def mesh_group(tensor: object) -> dist.ProcessGroup | None:
    """The process group of a DTensor's 1-D mesh (None for a plain tensor or another mesh): where
    a call whose placements are refused tells the other ranks."""
    mesh = tensor.device_mesh if is_dtensor(tensor) else None
    # Only a 1-D mesh names its group without a valid placement to pick the dimension.
    return mesh.get_group() if mesh is not None and mesh.ndim == 1 else None
