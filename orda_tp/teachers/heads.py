"""Teachers read through an LM head: the student's own (:class:`TiedTeacher`), their own
(:class:`SeparateTeacher`), or their own head module (:class:`TeacherHead`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..checks import check_shape
from .source import ShardReader, TeacherSource, check_tensor, columns

__all__ = ["TEACHER_MODES", "SeparateTeacher", "TeacherHead", "TiedTeacher"]

TEACHER_MODES = ("trained", "frozen", "cotrained")


@dataclass(frozen=True)
class TiedTeacher(TeacherSource):
    """Teacher hidden states ``hidden`` (BT, H) read through the student's own head ``weight``.

    ``mode`` ("trained", "frozen", "cotrained") optionally asserts the role that the loss weights
    imply; a mismatch raises instead of changing the routing.
    """

    hidden: torch.Tensor
    mode: str | None = None

    def __post_init__(self) -> None:
        check_tensor(self.hidden, "TiedTeacher.hidden")
        if self.mode is not None and self.mode not in TEACHER_MODES:
            raise ValueError(f"TiedTeacher.mode must be one of {TEACHER_MODES} or None, got {self.mode!r}")

    default_ce_weight: ClassVar[float] = 1.0

    @property
    def kind(self) -> str:
        return "tied"

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [("hidden", self.hidden)]

    def head_inputs(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        return self.hidden, None, None

    def check_shapes(self, rows: int, width: int, label_rows: int, vocab: int | None) -> None:
        check_shape("teacher.hidden", self.hidden, (rows, width), "same shape as student_hidden")

    def localized(self, reader: ShardReader) -> TiedTeacher:
        return TiedTeacher(reader.hidden(self.hidden, "teacher.hidden"), self.mode)

    def check_role(self, role: str, weights: str) -> None:
        if self.mode is not None and self.mode != role:
            raise ValueError(
                f"TiedTeacher.mode={self.mode!r} but the loss weights make the teacher {role!r} ({weights})"
            )


@dataclass(frozen=True)
class SeparateTeacher(TeacherSource):
    """Teacher with its own hidden states ``hidden`` (BT, D_t) and head ``weight`` (V, D_t)."""

    hidden: torch.Tensor
    weight: torch.Tensor

    def __post_init__(self) -> None:
        check_tensor(self.hidden, "SeparateTeacher.hidden")
        check_tensor(self.weight, "SeparateTeacher.weight")
        if self.hidden.shape[1] != self.weight.shape[1]:
            raise ValueError(
                "SeparateTeacher.hidden and SeparateTeacher.weight must share their last dimension, got "
                f"hidden {tuple(self.hidden.shape)} and weight {tuple(self.weight.shape)}"
            )

    @property
    def kind(self) -> str:
        return "separate"

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [("hidden", self.hidden), ("weight", self.weight)]

    def head_inputs(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        return self.hidden, self.weight, None

    def check_shapes(self, rows: int, width: int, label_rows: int, vocab: int | None) -> None:
        depth = self.hidden.shape[1]
        check_shape("teacher.hidden", self.hidden, (rows, depth), "one row per row of student_hidden")
        expected = (columns(self.weight, 0, vocab), depth)
        check_shape("teacher.weight", self.weight, expected, "the student's vocab size")

    def localized(self, reader: ShardReader) -> SeparateTeacher:
        return SeparateTeacher(reader.hidden(self.hidden, "teacher.hidden"), reader.head(self.weight, "teacher.weight"))

    def vocab_columns(self) -> int | None:
        return self.weight.shape[0]


@dataclass(frozen=True)
class TeacherHead:
    """A separate teacher read through its own LM-head module: hidden states ``hidden`` (BT, D_t)
    and ``head``, a module whose ``weight`` is (V, D_t) (``nn.Linear(D_t, V, bias=False)``, an
    :class:`orda_tp.DistillationHead`, possibly under ``fully_shard`` or tensor-parallel).

    The loss is that of ``SeparateTeacher(hidden, head.weight)``, with the weight read as the
    head's forward would read it: when FSDP2 holds it sharded over data parallelism (outside its
    module's forward) it is gathered for the call and released afterwards. Such a gathered weight
    sends no gradient back to FSDP's shards, so it must not require grad (a frozen teacher).
    """

    hidden: torch.Tensor
    head: nn.Module

    def __post_init__(self) -> None:
        check_tensor(self.hidden, "TeacherHead.hidden")
        if not isinstance(self.head, nn.Module):
            raise TypeError(f"TeacherHead.head must be an nn.Module with a weight, got {type(self.head).__name__}")
        weight = getattr(self.head, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise TypeError(
                f"TeacherHead.head must have a 2-D weight (vocab × hidden), got {type(self.head).__name__} "
                f"with weight {None if weight is None else tuple(weight.shape)}"
            )
