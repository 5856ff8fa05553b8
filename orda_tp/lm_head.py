"""An LM head that owns its weight and computes the distillation loss in its own forward, where
FSDP2, ``parallelize_module`` and forward hooks see the call (docs/integrations.md, "The module head")."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .arguments.options import check_loss_keywords
from .engine.call import raised_on_every_rank
from .loss import DistillationLoss, DistillationLossOutput, TeacherArgument
from .parallel.local_shards import call_group
from .teachers import SeparateTeacher

__all__ = ["DistillationHead", "HeadOutput"]


class HeadOutput(DistillationLossOutput):
    """:class:`orda_tp.DistillationLossOutput` as :class:`DistillationHead` returns it: complete and alike on
    every rank, so the DTensor methods tensor-parallel styles call on a head's output return it unchanged."""

    __slots__ = ()

    @property
    def placements(self) -> tuple[()]:
        return ()

    def redistribute(self, *args: object, **kwargs: object) -> HeadOutput:
        return self

    def to_local(self) -> HeadOutput:
        return self


class DistillationHead(nn.Linear):
    """``nn.Linear(in_features, out_features, bias=False)`` (same parameter, same state-dict key)
    whose forward with ``labels`` is the distillation loss.

    ``loss_options``: the keywords of :class:`orda_tp.DistillationLoss` (``kl_weight``,
    ``kl_temperature``, ``kl_divergence``, ``reduction``, ``vocab_size``, ``tp_group``, ...),
    validated here; ``vocab_size`` marks padding rows of the head (no probability at or past it).

    ``forward(hidden, labels=None, *, teacher=None, num_valid_tokens=None)``:

    - without ``labels``: the logits ``F.linear(hidden, weight)``;
    - with ``labels`` (shape ``hidden.shape[:-1]``, ``torch.long``, ``ignore_index`` for ignored
      positions): the loss of the rows ``hidden.reshape(-1, H)`` (row-major), whose teacher holds
      the same rows in the same order (e.g. ``TiedTeacher(teacher_hidden.reshape(-1, H))``), as a
      :class:`HeadOutput`; with ``reduction="none"`` its per-row tensors have ``labels``' shape.
      ``teacher`` may be left out when no term reads it (``kl_weight=0`` and ``teacher_ce_weight``
      0 or None): the loss is then the student CE.

    Tensor-parallel styles (``VocabParallel``) redistribute the first positional argument only; a
    failed check of the arguments on some rank raises on every rank.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **loss_options: Any,
    ) -> None:
        check_loss_keywords(type(self).__name__, loss_options)
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)
        self.loss = DistillationLoss(**loss_options)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **loss_options: Any) -> DistillationHead:
        """A head around ``linear``'s own weight Parameter; ``linear`` must have no bias."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        if linear.bias is not None:
            raise ValueError("linear has a bias; an LM head for DistillationHead must have bias=False")
        # On the meta device: the head's own weight is never allocated, as linear's replaces it.
        head = cls(linear.in_features, linear.out_features, device="meta", dtype=linear.weight.dtype, **loss_options)
        # The same Parameter: a weight tied to the embeddings stays tied, an optimizer holding it trains it.
        head.weight = linear.weight
        return head

    def _check_rows(self, hidden: object, labels: object) -> None:
        """``hidden`` (..., in_features) and one ``labels`` entry per position."""
        if not isinstance(hidden, Tensor) or hidden.dim() < 1 or hidden.shape[-1] != self.in_features:
            shape = tuple(hidden.shape) if isinstance(hidden, Tensor) else type(hidden).__name__
            raise ValueError(
                f"hidden must have shape (..., {self.in_features}) (this DistillationHead's in_features), got {shape}"
            )
        if not isinstance(labels, Tensor) or tuple(labels.shape) != tuple(hidden.shape[:-1]):
            shape = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
            raise ValueError(
                f"labels must have hidden's leading shape {tuple(hidden.shape[:-1])} (one label per position), "
                f"got {shape}"
            )

    def _unread_teacher(self, rows: Tensor) -> SeparateTeacher:
        """A call without a teacher is the student CE alone, allowed when no term reads a teacher."""
        options = self.loss.options
        if options.kl_weight != 0 or options.teacher_ce_weight not in (None, 0.0):
            raise ValueError(
                f"DistillationHead(hidden, labels=...) needs teacher=... (TiedTeacher, SeparateTeacher, "
                f"PrecomputedTeacher or TeacherHead): its loss reads one (kl_weight={options.kl_weight}, "
                f"teacher_ce_weight={options.teacher_ce_weight})"
            )
        return SeparateTeacher(rows.detach(), self.weight.detach())  # no term has weight: never read

    # Not nn.Linear's signature: the input is named ``hidden``, and the keywords select the loss.
    def forward(  # type: ignore[override]
        self,
        hidden: Tensor,
        labels: Tensor | None = None,
        *,
        teacher: TeacherArgument | None = None,
        num_valid_tokens: float | Tensor | None = None,
    ) -> Tensor | HeadOutput:
        # A failed check raises on every rank of the head's group, through the loss's handshake.
        with raised_on_every_rank(lambda: call_group(self.weight, self.loss.options.tp_group)):
            if labels is None:
                if teacher is not None or num_valid_tokens is not None:  # meant as a loss call: the others' may be
                    raise ValueError(
                        "DistillationHead(hidden) returns logits; teacher= and num_valid_tokens= need labels=..."
                    )
                return F.linear(hidden, self.weight)
            self._check_rows(hidden, labels)
            rows = hidden.reshape(math.prod(hidden.shape[:-1]), hidden.shape[-1])
            if teacher is None:
                teacher = self._unread_teacher(rows)
        out = self.loss(rows, self.weight, labels.reshape(-1), teacher, num_valid_tokens=num_valid_tokens)
        if self.loss.options.reduction == "none":  # per-row outputs back in the positions' shape
            return HeadOutput(*(value.reshape(labels.shape) for value in out))
        return HeadOutput(*out)
