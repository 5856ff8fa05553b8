"""Cached teacher outputs: :class:`PrecomputedTeacher` (logits, hidden states and a head, or a
top-k cache of log-probabilities, :mod:`.topk`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
from torch import Tensor

from .source import (
    ExpectedShape,
    LogitsInputs,
    ShardReader,
    TeacherBlocks,
    TeacherSource,
    ValueCheck,
    bias_shapes,
    check_tensor,
    columns,
)
from .topk import TAILS, TopKBlocks, check_topk_values, retempered_mass, tail_values

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch without DTensor: no cache is one
    DTensor = None  # type: ignore[assignment, misc]  # the fallback binding; mypy reads the installed torch

__all__ = ["CACHE_DTYPES", "PrecomputedTeacher"]

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class PrecomputedTeacher(TeacherSource):
    """Cached teacher outputs, exactly one of: ``logits`` (BT, V); ``teacher_hidden`` (BT, D_t) with
    ``teacher_weight`` (V, D_t) and optionally its ``teacher_bias`` (V,), whose logits
    ``teacher_hidden · teacher_weightᵀ + teacher_bias`` are formed chunk by chunk; or a top-k cache,
    ``topk_ids`` (BT, k) int64 global vocabulary ids and ``topk_logprobs`` (BT, k) their
    log-probabilities, the rest of each row's mass spread evenly over the other real columns
    (``tail="uniform"``) or none (``tail="renormalize"``: the softmax of the cached values).
    A top-k cache is the teacher at the temperature it was made at, ``topk_temperature`` (None: 1,
    raw log-probabilities), from logits soft-capped by ``topk_softcap`` (None: not capped): a loss
    that reads the teacher at that temperature uses it as it is; at another one its values are
    re-tempered, which is exact only when it lists every id: a cut cache raises then, unless
    ``retemper=True`` (:meth:`check_read_at`; docs/guide.md, "Top-k teacher caches").
    No gradient reaches the cache, so none of its tensors may require grad. ``logits_temperature=T``
    declares logits already divided by T (e.g. by ``project_teacher_logits``), which the KL uses as
    they are (teacher temperature 1). A tensor modified in place after construction is rejected when
    the loss reads it; one without a version counter (made under ``torch.inference_mode()``) cannot
    be watched and is refused unless ``trust_cache_immutability=True`` promises that it stays unchanged.
    """

    logits: torch.Tensor | None = None
    teacher_hidden: torch.Tensor | None = None
    teacher_weight: torch.Tensor | None = None
    trust_cache_immutability: bool = False
    logits_temperature: float | None = None
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    tail: str = "uniform"
    topk_temperature: float | None = None
    topk_softcap: float | None = None
    retemper: bool = False
    teacher_bias: torch.Tensor | None = None
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
        has_topk = self.topk_ids is not None or self.topk_logprobs is not None
        given = has_logits + has_hidden + has_topk
        if given != 1:
            raise ValueError(
                "PrecomputedTeacher needs exactly one of logits=..., teacher_hidden=... with teacher_weight=..., "
                f"or topk_ids=... with topk_logprobs=..., got {'more than one' if given else 'none'}"
            )
        if has_hidden and (self.teacher_hidden is None or self.teacher_weight is None):
            raise ValueError("PrecomputedTeacher needs teacher_hidden and teacher_weight together, got only one")
        if self.teacher_bias is not None and not has_hidden:
            raise ValueError("PrecomputedTeacher.teacher_bias is teacher_weight's bias: pass it with teacher_hidden")
        if has_topk:
            self._check_topk()
        for name, tensor in self.named_tensors():
            if not name.startswith("topk_"):  # a top-k cache's tensors were checked by _check_topk
                check_tensor(tensor, f"PrecomputedTeacher.{name}", dims=1 if name == "teacher_bias" else 2)
            if tensor.requires_grad:  # it would silently receive no gradient
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
        self._check_declarations(has_topk)
        if self.logits_temperature is not None:
            value = self.logits_temperature
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"PrecomputedTeacher.logits_temperature must be a finite float > 0, got {value!r}")
        # The version counters now: a later in-place change is caught when the loss reads the cache.
        object.__setattr__(self, "_versions", tuple(self._version_of(name, t) for name, t in self.named_tensors()))
        # What the plan routes on, per instance: this one class holds three kinds of cache.
        kind = "precomputed_logits" if has_logits else "precomputed_hidden" if has_hidden else "precomputed_topk"
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "cache_temperature", self.logits_temperature)
        made_at = (1.0 if self.topk_temperature is None else float(self.topk_temperature)) if has_topk else None
        object.__setattr__(self, "made_at_temperature", made_at)
        object.__setattr__(self, "made_at_softcap", self.topk_softcap)
        # A renormalized top-k cache has no mass off its ids; only a cached head's logits can be soft-capped.
        object.__setattr__(self, "sparse_support", has_topk and self.tail == "renormalize")
        object.__setattr__(self, "reads_head", has_hidden)

    def _check_declarations(self, has_topk: bool) -> None:
        """What a top-k cache declares (``topk_temperature``, ``topk_softcap``, ``retemper``) is a top-k
        cache's alone, and ``logits_temperature`` a cache of logits'."""
        if not isinstance(self.retemper, bool):
            raise TypeError(f"PrecomputedTeacher.retemper must be a bool, got {self.retemper!r}")
        declared = [name for name in ("topk_temperature", "topk_softcap") if getattr(self, name) is not None]
        declared += ["retemper"] if self.retemper else []
        if declared and not has_topk:
            raise ValueError(
                f"PrecomputedTeacher.{declared[0]} describes a top-k cache (topk_ids=..., topk_logprobs=...); "
                "a cache of logits declares its temperature with logits_temperature"
            )
        if self.logits_temperature is not None and has_topk:
            raise ValueError(
                "PrecomputedTeacher.logits_temperature declares logits divided by a temperature; a top-k cache "
                "declares the temperature it was made at with topk_temperature"
            )

    def _check_topk(self) -> None:
        """Types and shapes of a top-k cache (its values are checked where the loss reads them)."""
        ids, logprobs = self.topk_ids, self.topk_logprobs
        if ids is None or logprobs is None:
            raise ValueError("PrecomputedTeacher needs topk_ids and topk_logprobs together, got only one")
        if not isinstance(ids, Tensor) or ids.dtype != torch.int64 or ids.dim() != 2 or ids.shape[1] < 1:
            raise TypeError(
                "PrecomputedTeacher.topk_ids must be a 2-D int64 tensor (rows × k, k ≥ 1), got "
                + (f"dtype {ids.dtype} and shape {tuple(ids.shape)}" if isinstance(ids, Tensor) else type(ids).__name__)
            )
        check_tensor(logprobs, "PrecomputedTeacher.topk_logprobs")
        if logprobs.shape != ids.shape or logprobs.device != ids.device:
            raise ValueError(
                "PrecomputedTeacher.topk_logprobs must have topk_ids' shape and device, got "
                f"{tuple(logprobs.shape)} on {logprobs.device} and {tuple(ids.shape)} on {ids.device}"
            )
        if self.tail not in TAILS:
            raise ValueError(f"PrecomputedTeacher.tail must be one of {TAILS}, got {self.tail!r}")
        for name in ("topk_temperature", "topk_softcap"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)):
                raise TypeError(f"PrecomputedTeacher.{name} must be a float or None, got {value!r}")
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"PrecomputedTeacher.{name} must be a finite float > 0 or None, got {value!r}")

    def _version_of(self, name: str, tensor: torch.Tensor) -> int | None:
        """The tensor's version counter, or None for one without (only in a cache declared immutable)."""
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
        names = ("logits", "teacher_hidden", "teacher_weight", "teacher_bias", "topk_ids", "topk_logprobs")
        return [(name, getattr(self, name)) for name in names if getattr(self, name) is not None]

    trainable: ClassVar[bool] = False

    def logits_inputs(self, vocab_start: int, vocab_size: int) -> LogitsInputs:
        """The cached logits, hidden states and head (each :func:`_savable`), or a top-k cache's blocks."""
        hidden, weight, logits = self.teacher_hidden, self.teacher_weight, self.logits
        blocks, bias = self.block_source(vocab_start, vocab_size), _savable(self.teacher_bias)
        return LogitsInputs(_savable(hidden), _savable(weight), _savable(logits), blocks, bias)

    def block_source(self, vocab_start: int, vocab_size: int) -> TeacherBlocks | None:
        """A top-k cache's blocks over the local columns from global column ``vocab_start`` of a real
        vocabulary of ``vocab_size`` columns (None for the other kinds)."""
        if self.topk_ids is None or self.topk_logprobs is None:
            return None
        logprobs = _savable(self.topk_logprobs)
        assert logprobs is not None
        # τ once per call, per row: every block of every chunk reads it.
        tail = tail_values(logprobs, self.tail, vocab_size)
        return TopKBlocks.from_cache(self.topk_ids, logprobs, tail, vocab_start)

    def check_cache_values(self, vocab_size: int) -> None:
        if self.topk_ids is not None and self.topk_logprobs is not None:
            check_topk_values(self.topk_ids, self.topk_logprobs, vocab_size)

    def expected_shapes(self, rows: int, width: int, label_rows: int, vocab: int | None) -> list[ExpectedShape]:
        if self.topk_ids is not None and self.topk_logprobs is not None:
            k = self.topk_ids.shape[1]
            return [
                ExpectedShape(f"teacher.{name}", tensor, (label_rows, k), "one row per label")
                for name, tensor in (("topk_ids", self.topk_ids), ("topk_logprobs", self.topk_logprobs))
            ]
        if self.logits is not None:
            expected = (label_rows, columns(self.logits, 1, vocab))
            return [
                ExpectedShape("teacher.logits", self.logits, expected, "one row per label × the student's vocab size")
            ]
        assert self.teacher_hidden is not None and self.teacher_weight is not None
        depth = self.teacher_hidden.shape[1]
        return [
            ExpectedShape(
                "teacher.teacher_hidden", self.teacher_hidden, (rows, depth), "one row per row of student_hidden"
            ),
            ExpectedShape(
                "teacher.teacher_weight",
                self.teacher_weight,
                (columns(self.teacher_weight, 0, vocab), depth),
                "the student's vocab size",
            ),
            *bias_shapes("teacher.teacher_bias", self.teacher_bias, self.teacher_weight, vocab),
        ]

    def localized(self, reader: ShardReader) -> PrecomputedTeacher:
        if self.topk_ids is not None:
            return self  # ids are global: every rank holds the whole cache and forms its own columns
        if self.logits is not None:
            return replace(self, logits=reader.logits(self.logits, "teacher.logits"))
        assert self.teacher_hidden is not None and self.teacher_weight is not None
        return replace(
            self,
            teacher_hidden=reader.hidden(self.teacher_hidden, "teacher.teacher_hidden"),
            teacher_weight=reader.head(self.teacher_weight, "teacher.teacher_weight"),
            teacher_bias=None if self.teacher_bias is None else reader.head(self.teacher_bias, "teacher.teacher_bias"),
        )

    def vocab_columns(self) -> int | None:
        if self.topk_ids is not None:
            return None
        tensor = self.logits if self.logits is not None else self.teacher_weight
        assert tensor is not None
        return tensor.shape[1 if self.logits is not None else 0]

    def checked_values(self, real_columns: int) -> list[ValueCheck]:
        if self.logits is not None:
            # The real columns only (padding is never read); −inf allowed: an impossible token.
            return [ValueCheck("teacher.logits", self.logits[:, :real_columns], True)]
        if self.topk_ids is not None:
            return []  # check_cache_values
        return [ValueCheck(f"teacher.{name}", tensor, False) for name, tensor in self.named_tensors()]

    def trained_tensors(self) -> list[tuple[str, Tensor]]:
        return []

    def check_read_at(self, temperature: float, vocab_size: int) -> None:
        """Raise where a loss would read a top-k cache at another ``temperature`` than it was made at
        and the re-tempering is not exact (the cache lists fewer than ``vocab_size`` ids), unless
        ``retemper=True``: the message names both temperatures and the mass the listed ids would
        keep at ``temperature`` (reads the values: only where it raises)."""
        made_at, ids, logprobs = self.made_at_temperature, self.topk_ids, self.topk_logprobs
        if made_at is None or temperature == made_at or self.retemper:
            return
        assert ids is not None and logprobs is not None
        k = ids.shape[1]
        if k >= vocab_size:  # every id listed: re-tempering the values is exact
            return
        kept, now = retempered_mass(logprobs, vocab_size, made_at / temperature)
        raise ValueError(
            f"this PrecomputedTeacher is a top-k cache (k = {k} of {vocab_size} ids) made at temperature {made_at!r}, "
            f"and the loss reads the teacher at temperature {temperature!r}: re-tempered, its ids would hold "
            f"{now:.3g} of the mass (the rows' mean; {kept:.3g} at {made_at!r}), the rest only the tail's guess. "
            f"Extract the cache at {temperature!r} (teacher_topk(..., temperature={temperature!r})), or pass "
            "retemper=True to read it re-tempered anyway"
        )

    def check_shardable(self) -> None:
        if self._rows_shifted_locally:
            raise ValueError(
                "PrecomputedTeacher.prepare_logits shifted each row of this rank's teacher.logits shard by the "
                "shard's own maximum, a shift that differs between the vocabulary shards and so changes the "
                "teacher's distribution; on a tensor-parallel group cast the shard itself (PrecomputedTeacher("
                "logits=shard.to(dtype))), or call prepare_logits on a DTensor of the logits (its rows are whole)"
            )

    def replicated_tensors(self) -> list[tuple[str, Tensor]]:
        if self.topk_ids is None or self.topk_logprobs is None:
            return []
        return [("teacher.topk_ids", self.topk_ids), ("teacher.topk_logprobs", self.topk_logprobs)]

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
        """Whether :meth:`prepare_logits` shifted the rows of these plain (not DTensor) logits by their
        maximum over the columns they hold, which a tensor-parallel loss rejects."""
        return self._rows_shifted_locally

    def prepare_logits(self, dtype: torch.dtype) -> PrecomputedTeacher:
        """A descriptor whose cached logits are ``dtype`` and contiguous (``self`` when they already
        are), with the same ``trust_cache_immutability`` and ``logits_temperature``; a logits cache
        only. As orda-kernel does (bitwise alike for finite and −inf values), a cast to another dtype
        first shifts each row by its largest finite value and clamps finite values at the dtype's
        lowest; NaN and ±inf stay. The shift is over the columns the tensor holds: a DTensor's whole
        rows, but a plain shard's own columns, which the tensor-parallel loss rejects (cast such a
        shard with ``logits.to(dtype)``). The new tensor is made outside inference mode, so watched."""
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"PrecomputedTeacher.prepare_logits dtype must be a torch.dtype, got {dtype!r}")
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"PrecomputedTeacher.prepare_logits dtype must be one of {CACHE_DTYPES}, got {dtype}")
        self.check_unmodified()
        if self.logits is None:
            held = "topk_ids and topk_logprobs" if self.topk_ids is not None else "teacher_hidden and teacher_weight"
            raise ValueError(
                f"PrecomputedTeacher.prepare_logits needs a logits cache; this one holds {held} "
                "(pass PrecomputedTeacher(logits=...))"
            )
        logits = self.logits
        if logits.dtype == dtype and logits.is_contiguous():
            return self
        shifted = logits.dtype != dtype
        with torch.inference_mode(False):  # a tensor with a version counter, whose changes are watched
            prepared = (_shift_rows_and_cast(logits, dtype) if shifted else logits).contiguous()
        teacher = PrecomputedTeacher(
            logits=prepared,
            trust_cache_immutability=self.trust_cache_immutability,
            logits_temperature=self.logits_temperature,
        )
        whole_rows = DTensor is not None and isinstance(logits, DTensor)  # a DTensor's shift saw the whole row
        local_shift = self._rows_shifted_locally or (shifted and not whole_rows)
        object.__setattr__(teacher, "_rows_shifted_locally", local_shift)
        return teacher


def _savable(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """``tensor``, or for an inference tensor (only in a cache declared immutable) an ordinary tensor
    over the same memory, no copy: autograd refuses to save an inference tensor for the backward."""
    if tensor is None or not tensor.is_inference():
        return tensor
    # An ordinary tensor set onto the inference tensor's storage: the same memory, which autograd may save.
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return alias.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())


def _shift_rows_and_cast(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``logits − m`` per row, ``m`` the row's largest finite value (0 for a row with none),
    finite results clamped at ``dtype``'s lowest finite value, cast to ``dtype``."""
    finite = torch.isfinite(logits)
    # Softmax and the CE do not see a shift per row; without the row's offset a narrower dtype neither
    # overflows nor spends its precision on it.
    top = torch.where(finite, logits, float("-inf")).amax(dim=-1, keepdim=True)
    # A row without a finite value is not shifted: −inf − (−inf) would be NaN.
    shifted = logits - torch.where(torch.isneginf(top), 0.0, top)
    lowest = torch.finfo(dtype).min
    # A finite logit stays finite (a possible token stays possible); NaN and ±inf pass unchanged.
    return torch.where(finite, shifted.clamp_min(lowest), shifted).to(dtype)
