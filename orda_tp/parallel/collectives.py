"""The few collectives of a tensor-parallel loss call, each issued once per use: row gathers, the
sequence-parallel gradient reduce-scatter, the host group of the handshake, and
:class:`BackendLoan`, which leaves no host tensor with the process group's worker threads when a
call returns (docs/architecture.md, "The hidden-gradient sum").
"""

from __future__ import annotations

import time
import warnings
import weakref

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "BackendLoan",
    "all_gather_rows",
    "all_gather_texts",
    "carries_host_tensors",
    "gather_sequence_rows",
    "gloo_twin",
    "host_group",
    "reduce_scatter_rows",
]

# Newer torch names these all_gather_single / reduce_scatter_single and warns (FutureWarning) on
# the old names, which are all that older torch has.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# How long :meth:`BackendLoan.settle` waits for a worker thread to let go (microseconds, unless
# the thread is descheduled); past it the call warns and returns.
SETTLE_TIMEOUT_S = 10.0
_LONGEST_POLL_S = 1e-3


class BackendLoan:
    """The host tensors lent to collectives, as aliases whose release can be seen: a collective
    receives ``alias(t)`` instead of ``t``, the caller keeps no reference to it, and :meth:`settle`
    waits until the backend has dropped every alias."""

    def __init__(self) -> None:
        self._aliases: list[weakref.ref[Tensor]] = []

    def alias(self, tensor: Tensor) -> Tensor:
        """``tensor``'s memory as a new tensor object, to hand to a collective (host tensors)."""
        if tensor.device.type != "cpu":
            # Device tensors as they are: their backend holds them until the device finishes, and
            # waiting for that would stall the host.
            return tensor
        alias = tensor.detach()  # a new tensor object over the same memory, which nothing else references
        # Dies with the last strong reference: once the caller has waited, the worker thread letting go.
        self._aliases.append(weakref.ref(alias))
        return alias

    def settle(self) -> None:
        """Wait until the backend has dropped every alias lent so far (their collectives must
        have been waited, and the caller must hold none); warn after :data:`SETTLE_TIMEOUT_S`."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        pause = 0.0
        while any(alias() is not None for alias in self._aliases):
            if time.monotonic() > deadline:
                warnings.warn(
                    f"tensors lent to a collective are still referenced {SETTLE_TIMEOUT_S:.0f} s after it "
                    "completed; if a process group's thread drops them while the interpreter exits, "
                    "the process aborts",
                    RuntimeWarning,
                    stacklevel=2,
                )
                break
            # Sleeping releases the GIL, which the worker thread takes to drop an alias.
            time.sleep(pause)
            pause = min(2 * pause + 1e-5, _LONGEST_POLL_S)
        self._aliases = []


def all_gather_rows(local: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every rank's (rows, K) ``local`` (same shape on all ranks) stacked in rank order as
    (world, rows, K), gathered straight into one tensor."""
    local = local.contiguous()
    world = dist.get_world_size(group)
    gathered = local.new_empty(world * local.shape[0], *local.shape[1:])  # concatenated along rows
    loan = BackendLoan()
    # Not async: on gloo the host waits for it here, and settle() for the worker to drop the aliases.
    all_gather_single(loan.alias(gathered), loan.alias(local), group=group)
    loan.settle()
    return gathered.view(world, *local.shape)


def all_gather_texts(text: str, group: dist.ProcessGroup) -> list[str]:
    """Every rank's ``text`` in rank order, over a group of host tensors (:func:`host_group`), in two
    :func:`all_gather_rows`: the lengths, then the UTF-8 bytes."""
    # Not all_gather_object: it pickles into tensors that no loan settles, which gloo could still hold at exit.
    encoded = torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8)
    lengths = all_gather_rows(torch.tensor([[encoded.numel()]], dtype=torch.int64), group).view(-1).tolist()
    padded = torch.zeros(1, max(max(lengths), 1), dtype=torch.uint8)  # the gather needs one shape: the longest
    padded[0, : encoded.numel()] = encoded
    gathered = all_gather_rows(padded, group).view(len(lengths), -1)
    return [bytes(row[:length].tolist()).decode("utf-8") for row, length in zip(gathered, lengths)]


_GLOO_TWINS: dict[tuple[str, tuple[int, ...]], dist.ProcessGroup] = {}


def carries_host_tensors(group: dist.ProcessGroup) -> bool:
    """Whether ``group``'s backend takes host (CPU) tensors: gloo, alone or beside another."""
    return "gloo" in str(dist.get_backend(group))


def gloo_twin(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A gloo group over ``group``'s ranks, for collectives of host values beside a device group
    (NCCL), created at the first call and kept for later calls."""
    ranks = tuple(dist.get_process_group_ranks(group))
    key = (group.group_name, ranks)
    twin = _GLOO_TWINS.get(key)
    if twin is None:
        # By these ranks alone, which enter the loss together: the world's other ranks need not take part.
        twin = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
        assert twin is not None  # this rank is one of the ranks
        _GLOO_TWINS[key] = twin
    return twin


def host_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The group over ``group``'s ranks that gathers host values without the device: ``group``
    itself when it takes CPU tensors, else its :func:`gloo_twin`."""
    return group if carries_host_tensors(group) else gloo_twin(group)


def _pack_columns(tensors: list[Tensor]) -> tuple[Tensor, list[int]]:
    dtype = tensors[0].dtype
    for tensor in tensors[1:]:  # one dtype that holds every tensor exactly, so one collective carries all
        dtype = torch.promote_types(dtype, tensor.dtype)
    return torch.cat([t.to(dtype) for t in tensors], dim=1), [t.shape[1] for t in tensors]


def gather_sequence_rows(tensors: list[Tensor], group: dist.ProcessGroup) -> list[Tensor]:
    """Full-batch rows of each (local_rows, width_i) tensor: the ranks' rows in rank order."""
    # Detached: the loss's own backward forms these rows' gradients (reduce_scatter_rows), not autograd.
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
    loan = BackendLoan()
    if dist.get_backend(group) == dist.Backend.NCCL:
        local = torch.empty(rows, packed.shape[1], dtype=packed.dtype, device=packed.device)
        reduce_scatter_single(loan.alias(local), loan.alias(packed), group=group)
        packed = local
    else:  # gloo has no reduce-scatter: all-reduce in place, then keep this rank's rows
        dist.all_reduce(loan.alias(packed), group=group)
        start = dist.get_rank(group) * rows
        packed = packed[start : start + rows]
    loan.settle()
    return list(packed.split(widths, dim=1))
