"""A cache of a teacher's final hidden states: the exact offline teacher. Read with the teacher's LM
head (or this rank's vocabulary shard of it), a row is the teacher itself at every temperature and
over the whole vocabulary: ``PrecomputedTeacher(teacher_hidden=..., teacher_weight=...)``
(docs/guide.md, "Top-k teacher caches"; the format: docs/reference.md, "Top-k extraction and caches")."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ..arguments.validation import check_count, check_finite
from ..teachers import PrecomputedTeacher
from .reader import ShardReader
from .shards import ShardSettings, dtype_name, read_format, settings_mismatches
from .writer import ShardWriter

__all__ = ["HIDDEN_DTYPES", "HiddenCacheReader", "HiddenCacheSettings", "HiddenCacheWriter"]

HIDDEN_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
HIDDEN_DTYPES["float64"] = torch.float64


@dataclass(frozen=True)
class HiddenCacheSettings:
    """What every shard of a hidden-state cache shares: the teacher's ``hidden_size``, the stored
    ``dtype`` (the teacher's own, e.g. bfloat16, keeps its hidden states exactly) and a ``teacher``
    name (a model name, or ``head_digest`` of its head; "" for none)."""

    FORMAT: ClassVar[str] = "orda_tp.hidden_cache"
    PREFIX: ClassVar[str] = "hidden"

    hidden_size: int
    dtype: torch.dtype = torch.bfloat16
    teacher: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden_size", check_count("HiddenCacheSettings.hidden_size", self.hidden_size, 1))
        if self.dtype not in HIDDEN_DTYPES.values():
            raise ValueError(f"HiddenCacheSettings.dtype must be one of {list(HIDDEN_DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.teacher, str):
            raise TypeError(f"HiddenCacheSettings.teacher must be a str, got {type(self.teacher).__name__}")

    def tensors(self, rows: int) -> dict[str, tuple[list[int], torch.dtype]]:
        return {"hidden": ([rows, self.hidden_size], self.dtype)}

    def metadata(self) -> dict[str, str]:
        return {
            "format": self.FORMAT,
            "version": "1",
            "hidden_size": str(self.hidden_size),
            "dtype": dtype_name(self.dtype),
            "teacher": self.teacher,
        }

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str], where: str) -> HiddenCacheSettings:
        read_format(metadata, cls.FORMAT, ("1",), where)
        try:
            return cls(int(metadata["hidden_size"]), HIDDEN_DTYPES[metadata["dtype"]], metadata["teacher"])
        except (KeyError, ValueError, TypeError) as error:
            raise ValueError(f"{where} has unreadable metadata ({type(error).__name__}: {error})") from error

    def mismatches(self, other: ShardSettings) -> list[str]:
        return settings_mismatches(self, other)


class HiddenCacheWriter(ShardWriter[HiddenCacheSettings]):
    """A :class:`~.writer.ShardWriter` of a hidden-state cache: rows of the teacher's final hidden
    states, (rows, hidden_size), stored in the settings' dtype (finite, checked on the CPU)."""

    def __init__(
        self, directory: str | os.PathLike[str], settings: HiddenCacheSettings, start: int = 0,
        rows_per_shard: int = 8192, resume: bool = False, stop: int | None = None,
    ) -> None:  # fmt: skip
        if not isinstance(settings, HiddenCacheSettings):
            raise TypeError(
                f"settings must be an orda_tp.topk_cache.HiddenCacheSettings, got {type(settings).__name__}"
            )
        super().__init__(directory, settings, start, rows_per_shard, resume, stop)

    def append(self, hidden: Tensor) -> None:
        """Append rows of hidden states, (rows, hidden_size), on any device (copied to the CPU,
        cast to the settings' dtype)."""
        if not isinstance(hidden, Tensor) or not hidden.is_floating_point():
            got = getattr(hidden, "dtype", type(hidden).__name__)
            raise TypeError(f"hidden must be a floating-point tensor (rows, hidden_size), got {got}")
        if hidden.dim() != 2 or hidden.shape[1] != self.settings.hidden_size:
            raise ValueError(
                f"hidden must be (rows, hidden_size={self.settings.hidden_size}), got {tuple(hidden.shape)}"
            )
        stored = hidden.detach().to("cpu", self.settings.dtype)
        check_finite("hidden", stored)  # a cache of NaN or inf rows would train on them
        self.append_tensors({"hidden": stored})


class HiddenCacheReader(ShardReader[HiddenCacheSettings]):
    """A hidden-state cache (:class:`~.reader.ShardReader`): rows as stored, and as the teacher of
    a loss with the teacher's head."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        super().__init__(directory, HiddenCacheSettings)

    def check(self, *, hidden_size: int | None = None, teacher: str | None = None) -> None:
        """Raise a ValueError naming every given setting the cache does not have (None: not checked)."""
        self.check_settings("hidden-state", {"hidden_size": hidden_size, "teacher": teacher})

    def rows(self, start: int, stop: int) -> Tensor:
        """Rows ``[start, stop)``, (stop − start, hidden_size), in the stored dtype."""
        return self.tensor_rows(start, stop)["hidden"]

    def gather(self, offsets: Tensor) -> Tensor:
        """The rows at ``offsets`` (:meth:`~.reader.ShardReader.tensor_gather`), in the stored dtype."""
        return self.tensor_gather(offsets)["hidden"]

    def teacher(
        self, start: int, stop: int, weight: Tensor, device: torch.device | str | None = None
    ) -> PrecomputedTeacher:
        """Rows ``[start, stop)`` with the teacher's head ``weight`` (V, hidden_size) — under tensor
        parallelism this rank's vocabulary shard of it, passed with the loss's ``tp_group`` — as the
        teacher of a loss, on ``device`` (default: the weight's): the teacher itself."""
        if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[1] != self.settings.hidden_size:
            shape = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
            raise ValueError(f"weight must be the teacher's head (V, {self.settings.hidden_size}), got {shape}")
        hidden = self.rows(start, stop).to(weight.device if device is None else device)
        return PrecomputedTeacher(teacher_hidden=hidden, teacher_weight=weight.detach())
