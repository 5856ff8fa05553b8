"""Teacher descriptors: where the teacher's logits come from.

- :class:`TiedTeacher`: the teacher shares the student's head, ``t = h_t Wᵀ``.
- :class:`SeparateTeacher`: the teacher has its own head, ``t = h_t W_tᵀ``.
- :class:`PrecomputedTeacher`: cached teacher outputs (logits, or hidden + head); never trained.
- :class:`TeacherHead`: a separate teacher given by its LM-head module rather than its weight
  (the call reads the weight as the module's forward would, gathering an FSDP2-sharded one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from .parallel.dtensor import is_dtensor

__all__ = ["TiedTeacher", "SeparateTeacher", "PrecomputedTeacher", "TeacherHead", "Teacher", "TEACHER_MODES"]

TEACHER_MODES = ("trained", "frozen", "cotrained")


def _check_tensor(value: object, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")
    if value.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(value.shape)}")
    return value


@dataclass(frozen=True)
class TiedTeacher:
    """Teacher hidden states ``hidden`` (BT, H) read through the student's own head ``weight``.

    ``mode`` ("trained", "frozen", "cotrained") optionally asserts the role that the loss weights
    imply; a mismatch raises instead of changing the routing.
    """

    hidden: torch.Tensor
    mode: str | None = None

    def __post_init__(self) -> None:
        _check_tensor(self.hidden, "TiedTeacher.hidden")
        if self.mode is not None and self.mode not in TEACHER_MODES:
            raise ValueError(f"TiedTeacher.mode must be one of {TEACHER_MODES} or None, got {self.mode!r}")

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [("hidden", self.hidden)]

    def head_inputs(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``(hidden, head weight, logits)``: the head is the student's own (None)."""
        return self.hidden, None, None


@dataclass(frozen=True)
class SeparateTeacher:
    """Teacher with its own hidden states ``hidden`` (BT, D_t) and head ``weight`` (V, D_t)."""

    hidden: torch.Tensor
    weight: torch.Tensor

    def __post_init__(self) -> None:
        _check_tensor(self.hidden, "SeparateTeacher.hidden")
        _check_tensor(self.weight, "SeparateTeacher.weight")
        if self.hidden.shape[1] != self.weight.shape[1]:
            raise ValueError(
                "SeparateTeacher.hidden and SeparateTeacher.weight must share their last dimension, got "
                f"hidden {tuple(self.hidden.shape)} and weight {tuple(self.weight.shape)}"
            )

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [("hidden", self.hidden), ("weight", self.weight)]

    def head_inputs(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``(hidden, head weight, logits)``."""
        return self.hidden, self.weight, None


CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class PrecomputedTeacher:
    """Cached teacher outputs: ``logits`` (BT, V), or ``teacher_hidden`` (BT, D_t) with
    ``teacher_weight`` (V, D_t) whose product is formed chunk by chunk.

    No gradient reaches the cache, so none of its tensors may require grad. ``logits_temperature=T``
    declares logits that were already divided by T (e.g. by ``project_teacher_logits``): the KL then
    uses them as they are (the teacher temperature defaults to 1 instead of ``kl_temperature``).
    The tensors' version counters are recorded here; a cache modified in place afterwards is
    rejected when the loss reads it. A tensor without a version counter (made under
    ``torch.inference_mode()``) cannot be watched: it is refused unless
    ``trust_cache_immutability=True`` promises that it stays unchanged (orda-kernel's meaning; the
    other tensors are still watched).
    """

    logits: torch.Tensor | None = None
    teacher_hidden: torch.Tensor | None = None
    teacher_weight: torch.Tensor | None = None
    trust_cache_immutability: bool = False
    logits_temperature: float | None = None
    _versions: tuple[int | None, ...] = field(init=False, repr=False, compare=False)
    # Set by prepare_logits when it shifted the rows of plain (not DTensor) logits by their
    # maximum: right for whole rows, wrong for one vocabulary shard of them.
    _rows_shifted_locally: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.trust_cache_immutability, bool):
            raise TypeError(
                f"PrecomputedTeacher.trust_cache_immutability must be a bool, got {self.trust_cache_immutability!r}"
            )
        has_logits = self.logits is not None
        has_hidden = self.teacher_hidden is not None or self.teacher_weight is not None
        if has_logits == has_hidden:
            raise ValueError(
                "PrecomputedTeacher needs exactly one of logits=... or teacher_hidden=... with "
                "teacher_weight=..., got " + ("both" if has_logits else "neither")
            )
        if has_hidden and (self.teacher_hidden is None or self.teacher_weight is None):
            raise ValueError("PrecomputedTeacher needs teacher_hidden and teacher_weight together, got only one")
        for name, tensor in self.named_tensors():
            _check_tensor(tensor, f"PrecomputedTeacher.{name}")
            if tensor.requires_grad:
                raise ValueError(
                    f"PrecomputedTeacher.{name} must not require grad (no gradient reaches a cached "
                    "teacher), got a tensor with requires_grad=True; pass tensor.detach()"
                )
        if has_hidden:
            assert self.teacher_hidden is not None and self.teacher_weight is not None
            if self.teacher_hidden.shape[1] != self.teacher_weight.shape[1]:
                raise ValueError(
                    "PrecomputedTeacher.teacher_hidden and teacher_weight must share their last dimension, got "
                    f"{tuple(self.teacher_hidden.shape)} and {tuple(self.teacher_weight.shape)}"
                )
        if self.logits_temperature is not None:
            value = self.logits_temperature
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"PrecomputedTeacher.logits_temperature must be a finite float > 0, got {value!r}")
        object.__setattr__(self, "_versions", tuple(self._version_of(name, t) for name, t in self.named_tensors()))

    def _version_of(self, name: str, tensor: torch.Tensor) -> int | None:
        """The tensor's version counter, or None for a tensor without one, which only a cache
        declared immutable may hold."""
        try:
            return tensor._version
        except RuntimeError as error:  # an inference tensor
            if not self.trust_cache_immutability:
                raise ValueError(
                    f"PrecomputedTeacher.{name} has no version counter (a tensor made under "
                    "torch.inference_mode()), so an in-place change to it could not be detected; build it outside "
                    "inference mode, or pass trust_cache_immutability=True to promise that it stays unchanged"
                ) from error
            return None

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The cached tensors with their field names."""
        names = ("logits", "teacher_hidden", "teacher_weight")
        return [(name, getattr(self, name)) for name in names if getattr(self, name) is not None]

    def head_inputs(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``(hidden, head weight, logits)``: either the cached logits or the cached hidden and head
        (a trusted inference tensor as an ordinary tensor over the same memory, see
        :func:`_savable`)."""
        hidden, weight, logits = self.teacher_hidden, self.teacher_weight, self.logits
        return _savable(hidden), _savable(weight), _savable(logits)

    def modified_tensor(self) -> tuple[str, int, int] | None:
        """``(name, recorded version, current version)`` of a tensor modified in place since
        construction, or None (a tensor without a version counter is trusted, not watched)."""
        for (name, tensor), version in zip(self.named_tensors(), self._versions):
            if version is not None and tensor._version != version:
                return name, version, tensor._version
        return None

    def check_unmodified(self) -> None:
        """Raise if a cached tensor was modified in place since construction."""
        modified = self.modified_tensor()
        if modified is not None:
            name, version, current = modified
            raise ValueError(
                f"PrecomputedTeacher.{name} was modified in place after the PrecomputedTeacher was built "
                f"(version {version} -> {current}); build a new PrecomputedTeacher"
            )

    @property
    def rows_shifted_locally(self) -> bool:
        """Whether :meth:`prepare_logits` shifted each row of these (plain, not DTensor) logits by
        the row's maximum over the columns they hold: on a vocabulary shard, a shift that differs
        from the other shards' (the tensor-parallel loss rejects such a cache)."""
        return self._rows_shifted_locally

    def prepare_logits(self, dtype: torch.dtype) -> PrecomputedTeacher:
        """orda-kernel's method: a descriptor whose cached logits are ``dtype`` and contiguous
        (``self`` when they already are), with the same ``trust_cache_immutability`` and
        ``logits_temperature``; a logits cache only.

        As in orda-kernel, a cast to another dtype first shifts each row by its largest finite
        value (softmax and the cross-entropy do not see a shift per row), so that a narrower dtype
        neither overflows nor spends its precision on the row's offset; finite values below the
        dtype's range become its lowest finite value. NaN and ±inf stay as they are. The shift is
        taken over the columns the tensor holds: on a DTensor the whole row; plain logits of one
        vocabulary shard are shifted by the shard's own maximum, which the tensor-parallel loss
        rejects (cast such a shard with ``logits.to(dtype)`` instead). Made outside inference
        mode, so the new tensor's changes are watched.
        """
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"PrecomputedTeacher.prepare_logits dtype must be a torch.dtype, got {dtype!r}")
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"PrecomputedTeacher.prepare_logits dtype must be one of {CACHE_DTYPES}, got {dtype}")
        self.check_unmodified()
        if self.logits is None:
            raise ValueError(
                "PrecomputedTeacher.prepare_logits needs a logits cache; this one holds teacher_hidden and "
                "teacher_weight (pass PrecomputedTeacher(logits=...))"
            )
        logits = self.logits
        if logits.dtype == dtype and logits.is_contiguous():
            return self
        shifted = logits.dtype != dtype
        with torch.inference_mode(False):
            prepared = (_shift_rows_and_cast(logits, dtype) if shifted else logits).contiguous()
        teacher = PrecomputedTeacher(
            logits=prepared,
            trust_cache_immutability=self.trust_cache_immutability,
            logits_temperature=self.logits_temperature,
        )
        local_shift = self._rows_shifted_locally or (shifted and not is_dtensor(logits))
        object.__setattr__(teacher, "_rows_shifted_locally", local_shift)
        return teacher


def _savable(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """``tensor``, or for an inference tensor (only in a cache declared immutable) an ordinary
    tensor over the same memory, no copy: autograd refuses to save an inference tensor for the
    backward, and the cache is promised not to change."""
    if tensor is None or not tensor.is_inference():
        return tensor
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return alias.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())


def _shift_rows_and_cast(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``logits − m`` per row, ``m`` the row's largest finite value (0 for a row with none),
    finite results clamped at ``dtype``'s lowest finite value, cast to ``dtype``: orda-kernel's
    conversion of a cache (for a cache of finite values and −inf, bitwise the same)."""
    finite = torch.isfinite(logits)
    top = torch.where(finite, logits, float("-inf")).amax(dim=-1, keepdim=True)
    shifted = logits - torch.where(torch.isneginf(top), 0.0, top)
    lowest = torch.finfo(dtype).min
    return torch.where(finite, shifted.clamp_min(lowest), shifted).to(dtype)


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
        _check_tensor(self.hidden, "TeacherHead.hidden")
        if not isinstance(self.head, nn.Module):
            raise TypeError(f"TeacherHead.head must be an nn.Module with a weight, got {type(self.head).__name__}")
        weight = getattr(self.head, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise TypeError(
                f"TeacherHead.head must have a 2-D weight (vocab × hidden), got {type(self.head).__name__} "
                f"with weight {None if weight is None else tuple(weight.shape)}"
            )


Teacher = TiedTeacher | SeparateTeacher | PrecomputedTeacher
