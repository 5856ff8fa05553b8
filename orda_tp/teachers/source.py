"""What the loss asks of a teacher: :class:`TeacherSource`, which every descriptor implements."""

from __future__ import annotations

from typing import ClassVar, NamedTuple, Protocol

import torch
from torch import Tensor

__all__ = ["ShardReader", "TeacherSource", "ValueCheck", "check_tensor", "columns"]


def check_tensor(value: object, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")
    if value.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(value.shape)}")
    return value


class ShardReader(Protocol):
    """How a tensor-parallel call takes this rank's part of a teacher tensor that may be a
    DTensor (:class:`orda_tp.parallel.local_shards.DTensorShards`); plain tensors pass through."""

    def hidden(self, tensor: Tensor, name: str) -> Tensor:
        """Hidden states: the rows this rank holds (sequence parallelism like the student's)."""
        ...

    def head(self, tensor: Tensor, name: str) -> Tensor:
        """A head weight: this rank's vocabulary rows."""
        ...

    def logits(self, tensor: Tensor, name: str) -> Tensor:
        """Logits: this rank's vocabulary columns."""
        ...


class ValueCheck(NamedTuple):
    """A teacher tensor whose values a check reads: finite everywhere, or finite or −inf
    (``allow_neg_inf``, a logits cache where −inf marks an impossible token)."""

    name: str
    tensor: Tensor
    allow_neg_inf: bool


class TeacherSource:
    """What the loss asks of a teacher descriptor (defaults for a trainable teacher); a new kind of
    teacher is one subclass.

    ``kind``: "tied", "separate", "precomputed_logits" or "precomputed_hidden" (the plan's
    routing); ``trainable``: whether a loss term may send it a gradient; ``default_ce_weight``:
    ``teacher_ce_weight`` when the call leaves it None (orda-kernel trains a tied teacher's CE).
    """

    trainable: ClassVar[bool] = True
    default_ce_weight: ClassVar[float] = 0.0

    @property
    def kind(self) -> str:
        raise NotImplementedError

    @property
    def cache_temperature(self) -> float | None:
        """The temperature a cache of logits was already divided by, or None."""
        return None

    def named_tensors(self) -> list[tuple[str, Tensor]]:
        raise NotImplementedError

    def head_inputs(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """``(hidden, head weight, logits)``: the head is None when it is the student's own."""
        raise NotImplementedError

    def check_shapes(self, rows: int, width: int, label_rows: int, vocab: int | None) -> None:
        """Shapes against the student's ``rows`` × ``width`` hidden states and ``label_rows``
        labels; ``vocab``: the student head's rows, or None on a vocabulary shard (whose column
        counts the tensor-parallel handshake compares across ranks)."""
        raise NotImplementedError

    def localized(self, reader: ShardReader) -> TeacherSource:
        """This descriptor over this rank's shards of its (possibly DTensor) tensors."""
        raise NotImplementedError

    def vocab_columns(self) -> int | None:
        """The vocabulary columns of its own head or logits (None: it reads the student's head)."""
        return None

    def check_role(self, role: str, weights: str) -> None:
        """Raise if the descriptor asserts another role than the one the loss ``weights`` give."""

    def checked_values(self, real_columns: int) -> list[ValueCheck]:
        """The cached values a host check reads (``real_columns``: its local real columns)."""
        return []

    def trained_tensors(self) -> list[tuple[str, Tensor]]:
        """The tensors ``KernelConfig.check_finite_inputs`` covers (a cache has its own checks)."""
        return [(f"teacher {name}", tensor) for name, tensor in self.named_tensors()]

    def check_unmodified(self) -> None:
        """Raise if a cached tensor changed in place since the descriptor was built."""

    def check_shardable(self) -> None:
        """Raise if the descriptor cannot be read as one vocabulary shard of a teacher."""


def columns(tensor: Tensor, axis: int, vocab: int | None) -> int:
    """The column count a teacher tensor must have: the student's vocabulary, or its own on a shard."""
    return tensor.shape[axis] if vocab is None else vocab
