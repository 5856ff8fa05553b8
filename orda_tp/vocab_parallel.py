"""``VocabParallel``: the ``parallelize_module`` style of a vocabulary-parallel LM head (docs/integrations.md)."""

from __future__ import annotations

from typing import Any

from torch import nn

try:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle
except ImportError:  # pragma: no cover - torch without DTensor
    ParallelStyle = object  # type: ignore[assignment, misc]  # the fallback binding; mypy reads the installed torch

from .loss import DistillationLossOutput

__all__ = ["VocabParallel"]


class VocabParallel(ParallelStyle):
    """Shard an LM head (a module with a 2-D ``weight`` and no bias: :class:`orda_tp.DistillationHead`,
    or an ``nn.Linear(H, V, bias=False)`` for logits) along the vocabulary over a 1-D mesh:
    ``parallelize_module(model, tp_mesh, {"lm_head": orda_tp.VocabParallel()})``.

    The weight becomes a ``Shard(0)`` DTensor (``torch.chunk`` order). The hidden states (the first
    positional argument) are marked ``input_layouts`` (default ``Replicate()``; ``Shard(1)`` for
    sequence-parallel ``[batch, seq, hidden]`` activations) and redistributed to ``Replicate``, as
    ``ColwiseParallel`` does; other arguments pass unchanged. A loss output is returned as it is,
    logits as a ``Shard(-1)`` DTensor (this rank's columns with ``use_local_output=True``). A head
    with a bias or without a 2-D weight, or a mesh that is not 1-D, raises ValueError.
    """

    def __init__(self, *, input_layouts: Placement | None = None, use_local_output: bool = False) -> None:
        super().__init__()
        self.input_layouts = (input_layouts or Replicate(),)
        self.use_local_output = use_local_output

    def _partition(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if name:  # submodules (a DistillationHead's loss) hold no parameters
            return
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            raise ValueError(
                f"VocabParallel shards a module's 2-D weight (vocab × hidden); {type(module).__name__} has "
                f"{None if weight is None else tuple(weight.shape)}"
            )
        if getattr(module, "bias", None) is not None:
            raise ValueError(f"VocabParallel shards LM heads without bias; {type(module).__name__} has a bias")
        # From the detached weight: the new Parameter is a leaf of its own, with the old one's requires_grad.
        sharded = distribute_tensor(weight.detach(), device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
        module.register_parameter("weight", nn.Parameter(sharded, requires_grad=weight.requires_grad))

    def _prepare_input(self, module: nn.Module, inputs: tuple[Any, ...], device_mesh: DeviceMesh) -> tuple[Any, ...]:
        if not inputs:
            return inputs
        hidden = inputs[0]
        if not isinstance(hidden, DTensor):
            # run_check=False, as ColwiseParallel: the placement is the caller's word, not checked by a collective.
            hidden = DTensor.from_local(hidden, device_mesh, self.input_layouts, run_check=False)
        if tuple(hidden.placements) != (Replicate(),):  # each rank's columns need every hidden row
            hidden = hidden.redistribute(placements=(Replicate(),))
        return (hidden, *inputs[1:])

    def _prepare_output(self, module: nn.Module, outputs: Any, device_mesh: DeviceMesh) -> Any:
        # A loss output is already complete and alike on every rank; only logits are a DTensor.
        if isinstance(outputs, DistillationLossOutput) or not self.use_local_output:
            return outputs
        return outputs.to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if device_mesh.ndim != 1:
            raise ValueError(
                f"VocabParallel needs the 1-D tensor-parallel mesh (e.g. mesh['tp']), got a {device_mesh.ndim}-D mesh"
            )
        # torch types input_fn as returning None, but installs it as a forward pre-hook, whose
        # return value replaces the inputs (as torch's own ColwiseParallel uses it).
        return distribute_module(
            module,
            device_mesh,
            self._partition,
            self._prepare_input,  # type: ignore[arg-type]
            self._prepare_output,
        )
