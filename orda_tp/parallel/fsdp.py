"""Parameters that FSDP2 (``fully_shard``) holds sharded over data parallelism.

Outside the forward of the module that ``fully_shard`` wrapped, each of that module's parameters
is a ``Shard(0)`` DTensor over the *data-parallel* mesh: this rank's slice of rows of the full
parameter. A head weight in that state looks exactly like a vocabulary shard, but the other
ranks hold other batches, so reading it as one gives a wrong loss. :func:`check_not_fsdp_sharded`
refuses it with the fix; inside the module's forward FSDP has gathered the full parameter (or its
tensor-parallel shard on a 2-D mesh) and the loss reads it as it is.

:func:`unsharded_head_weight` gathers a *frozen* teacher head's weight for one call, as FSDP's
forward would (the student's head computes its loss inside its own forward instead: see
:class:`orda_tp.DistillationHead`).

FSDP2 keeps no public record of which parameters it shards: this module reads its per-module
state (``FSDPModule._get_fsdp_state()._fsdp_param_groups[*].fsdp_params[*].sharded_param``), the
only place in the library that does. ``tests/test_training_stacks.py`` fails if torch changes it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor, nn

from .dtensor import is_dtensor, placement_text

try:  # the public name since torch 2.6
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - torch 2.4/2.5 keep FSDP2 under _composable
    try:
        from torch.distributed._composable.fsdp import FSDPModule
    except ImportError:
        FSDPModule = None  # type: ignore[assignment, misc]  # the fallback binding; mypy reads the installed torch

try:
    from torch.distributed._composable_state import _module_state_mapping
except ImportError:  # pragma: no cover
    _module_state_mapping = weakref.WeakKeyDictionary()

__all__ = ["FsdpShard", "check_not_fsdp_sharded", "fsdp_shard_of", "head_weight", "unsharded_head_weight"]


@dataclass(frozen=True)
class FsdpShard:
    """``tensor`` is the FSDP-sharded form of a parameter of ``module`` (the module ``fully_shard``
    wrapped, whose forward gathers it)."""

    module: FSDPModule


def _fsdp_modules() -> Iterator[FSDPModule]:
    if FSDPModule is None:
        return
    for module in list(_module_state_mapping.keys()):
        if isinstance(module, FSDPModule):
            yield module


def _sharded_parameters(module: FSDPModule) -> Iterator[Tensor]:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.7: a single optional group
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    for group in groups:
        for fsdp_param in group.fsdp_params:
            yield fsdp_param.sharded_param


def fsdp_shard_of(tensor: object) -> FsdpShard | None:
    """The FSDP2 module whose data-parallel sharded parameter ``tensor`` is, or None.

    FSDP2 shards parameters as DTensors, so plain tensors (an unsharded parameter inside
    forward, a user's own shard) return None at once."""
    if not is_dtensor(tensor):
        return None
    for module in _fsdp_modules():
        if any(parameter is tensor for parameter in _sharded_parameters(module)):
            return FsdpShard(module)
    return None


def check_not_fsdp_sharded(name: str, tensor: object) -> None:
    """Raise if ``tensor`` is a parameter that FSDP2 holds sharded over data parallelism.

    Every rank of the data-parallel group holds the same FSDP structure, so every rank raises
    here, before any collective."""
    shard = fsdp_shard_of(tensor)
    if shard is None:
        return
    assert is_dtensor(tensor)  # FSDP2 shards parameters as DTensors
    owner = type(shard.module).__name__
    raise ValueError(
        f"{name} is a parameter that FSDP2 (fully_shard) holds sharded over data parallelism "
        f"({placement_text(tensor)}, owned by the {owner} module it wrapped), not a vocabulary shard: outside "
        "that module's forward each rank holds only a slice of its rows, and reading it as a tensor-parallel "
        "head gives a wrong loss. Compute the loss inside the forward of the module FSDP wrapped (use "
        "orda_tp.DistillationHead as the LM head and call it with labels=...), register the method that calls "
        "the loss with torch.distributed.fsdp.register_fsdp_forward_method, or, for a frozen teacher's head, "
        "pass orda_tp.TeacherHead(hidden, head_module), which gathers the weight for the call"
    )


def head_weight(head: nn.Module) -> Tensor:
    """``head.weight``, a tensor (:class:`orda_tp.TeacherHead` checks it at construction)."""
    weight = head.weight
    assert isinstance(weight, Tensor)
    return weight


@contextmanager
def unsharded_head_weight(head: nn.Module, receives_grad: bool, read_after_block: bool) -> Iterator[Tensor]:
    """``head.weight`` as FSDP's forward of its owner would read it: gathered for the duration
    of the block (and released afterwards) when FSDP2 holds it sharded, else as it is.

    A gathered weight gets no gradient back to FSDP's shards, so a head that would receive a
    gradient (``receives_grad``) raises instead: it must compute inside its own forward. When the
    weight is ``read_after_block`` (a backward that recomputes logits), the block gets a copy
    that outlives FSDP's release of the gathered storage."""
    weight = head_weight(head)
    shard = fsdp_shard_of(weight)
    if shard is None:
        yield weight
        return
    if receives_grad:
        raise ValueError(
            "TeacherHead.head's weight is sharded by FSDP2 and the loss would train it (teacher_ce_weight > 0 or "
            "a co-trained variant): a weight gathered outside its module's forward sends no gradient back to "
            "FSDP's shards. Freeze the teacher head (requires_grad_(False)), or train it through its own forward "
            "(orda_tp.DistillationHead)"
        )
    owner = shard.module
    owner.unshard()
    try:
        gathered = head_weight(head).detach()  # the unsharded parameter, until reshard()
        yield gathered.clone() if read_after_block else gathered
    finally:
        owner.reshard()
