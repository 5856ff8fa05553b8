"""Parameters that FSDP2 (``fully_shard``) holds sharded over data parallelism: refused as
vocabulary shards (:func:`check_not_fsdp_sharded`), or gathered for one call for a frozen teacher's
head (:func:`unsharded_head`); docs/architecture.md, "Inside training stacks".
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

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

__all__ = [
    "FsdpShard",
    "check_not_fsdp_sharded",
    "fsdp_shard_of",
    "gradient_divide_factor",
    "head_parameters",
    "unsharded_head",
]


@dataclass(frozen=True)
class FsdpShard:
    """The owner of an FSDP-sharded parameter: ``module``, which ``fully_shard`` wrapped and whose
    forward gathers it."""

    module: FSDPModule


def _fsdp_modules() -> Iterator[FSDPModule]:
    if FSDPModule is None:
        return
    for module in list(_module_state_mapping.keys()):
        if isinstance(module, FSDPModule):
            yield module


def _param_groups(module: FSDPModule) -> list[Any]:
    # FSDP2 keeps no public record of what it shards: its private per-module state, read here alone in
    # orda_tp (tests/test_training_stacks.py fails if torch changes it).
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.7: a single optional group
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def _sharded_parameters(module: FSDPModule) -> Iterator[Tensor]:
    for group in _param_groups(module):
        for fsdp_param in group.fsdp_params:
            yield fsdp_param.sharded_param


def fsdp_shard_of(tensor: object) -> FsdpShard | None:
    """The FSDP2 module whose data-parallel sharded parameter ``tensor`` is, or None."""
    # FSDP2 shards parameters as DTensors: a plain tensor (a parameter gathered inside forward) is none.
    if not is_dtensor(tensor):
        return None
    for module in _fsdp_modules():
        # By identity: a slice or copy of the parameter is not recognized.
        if any(parameter is tensor for parameter in _sharded_parameters(module)):
            return FsdpShard(module)
    return None


def gradient_divide_factor(shard: FsdpShard) -> float | None:
    """The factor by which FSDP2 divides the gradients it sums over the data-parallel ranks for
    ``shard.module``'s parameters, where ``set_gradient_divide_factor`` set one; None: the
    default, the data-parallel size (a mean)."""
    factors = {getattr(group, "gradient_divide_factor", None) for group in _param_groups(shard.module)}
    # set_gradient_divide_factor sets every group of a module alike.
    return factors.pop() if len(factors) == 1 else None


def check_not_fsdp_sharded(name: str, tensor: object) -> None:
    """Raise a ValueError, with the fix, if ``tensor`` is a parameter that FSDP2 holds sharded over
    data parallelism: a slice of rows that looks like a vocabulary shard while the ranks hold
    different batches. Every data-parallel rank holds the same FSDP structure, so all raise alike."""
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


def head_parameters(head: nn.Module) -> tuple[Tensor, Tensor | None]:
    """``(head.weight, head.bias)``, the bias None where the head has no tensor bias
    (:class:`orda_tp.TeacherHead` checks both at construction)."""
    weight, bias = head.weight, getattr(head, "bias", None)
    assert isinstance(weight, Tensor)
    return weight, bias if isinstance(bias, Tensor) else None


@contextmanager
def unsharded_head(
    head: nn.Module, receives_grad: bool, read_after_block: bool
) -> Iterator[tuple[Tensor, Tensor | None]]:
    """``(head.weight, head.bias)`` as FSDP's forward of its owner would read them: as they are, or
    where FSDP2 holds them sharded, gathered for the block (copies where they are
    ``read_after_block``: a backward that recomputes logits). A sharded head that ``receives_grad``
    raises a ValueError: a gathered parameter sends no gradient back to FSDP's shards."""
    weight, bias = head_parameters(head)
    shard = fsdp_shard_of(weight)
    if shard is None:
        yield weight, bias
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
        # The unsharded parameters, until reshard(); a copy outlives reshard(), which frees the
        # gathered storage that a later backward would read.
        weight, bias = head_parameters(head)
        weight, bias = weight.detach(), None if bias is None else bias.detach()
        if read_after_block:
            weight, bias = weight.clone(), None if bias is None else bias.clone()
        yield weight, bias
    finally:
        owner.reshard()  # released whatever happens in the block, as FSDP's forward would
