"""Reading a teacher cache: :class:`ShardReader`, every shard's header checked and its bytes
verified before a row of it is served, rows read memory-mapped; the top-k cache's
:class:`TopKCacheReader`."""

from __future__ import annotations

import os
import time
import warnings
from bisect import bisect_right
from collections import OrderedDict
from typing import Any, Generic, NamedTuple

import torch
from torch import Tensor

from ..arguments.validation import is_int
from ..teachers import PrecomputedTeacher
from . import compact
from .shards import CacheSettings, S, UncheckedShardWarning, shard_ranges, verify_shard

try:
    from safetensors import safe_open
except ImportError as error:  # pragma: no cover - the extra is missing
    raise ImportError("orda_tp.topk_cache needs safetensors: pip install 'orda_tp[cache]'") from error

__all__ = ["OPEN_SHARDS", "ShardReader", "TopKCacheReader", "Verification"]

#: Open shard handles a reader keeps (memory maps; the oldest is closed past this many).
OPEN_SHARDS = 64


class Verification(NamedTuple):
    """What :meth:`ShardReader.verify` read: shards whose checksums matched, shards that carry none
    (written before checksums were stored), their bytes, and the seconds it took."""

    verified: int
    unchecked: int
    bytes: int
    seconds: float


class ShardReader(Generic[S]):
    """The cache of ``settings_type``'s kind in ``directory``: every shard's header checked, their
    settings equal and their ranges tiling ``[0, num_tokens)``. A shard's bytes are verified
    against its checksums once, before a row of it is first served (a mismatch raises naming the
    shard and the tensor; a cache written without checksums warns once, UncheckedShardWarning).
    Reads memory-map the shards (a handle per shard, at most :data:`OPEN_SHARDS` kept open)."""

    def __init__(self, directory: str | os.PathLike[str], settings_type: type[S]) -> None:
        self.directory = os.fspath(directory)
        if not os.path.isdir(self.directory):
            raise ValueError(f"directory must be a cache directory, got {self.directory!r} (not a directory)")
        self.shards = tuple(shard_ranges(self.directory, settings_type))
        if not self.shards:
            prefix = settings_type.PREFIX
            raise ValueError(f"{self.directory} holds no cache shards ({prefix}-<offset>.safetensors)")
        self.settings: S = self.shards[0].settings  # type: ignore[assignment]
        end = 0
        for shard in self.shards:
            mismatched = shard.settings.mismatches(self.settings)
            if mismatched:
                raise ValueError(
                    f"{shard.path} has other settings than {self.shards[0].path} (this != first): "
                    + "; ".join(mismatched)
                )
            # The shards must tile [0, num_tokens): a gap or an overlap names the rows.
            if shard.start > end:
                raise ValueError(f"{self.directory} misses rows [{end}, {shard.start}): no shard holds them")
            if shard.start < end:
                raise ValueError(f"{shard.path} overlaps rows [{shard.start}, {end}) of the shard before it")
            end = shard.start + shard.rows
        self.num_tokens = end
        self._starts = [shard.start for shard in self.shards]
        self._handles: OrderedDict[int, Any] = OrderedDict()
        self._verified: set[int] = set()
        self._warned = False

    def check_settings(self, kind: str, asked: dict[str, object]) -> None:
        """Raise a ValueError naming every setting in ``asked`` (None: not checked) that the ``kind``
        cache does not have."""
        mismatched = [
            f"{name}: the cache has {getattr(self.settings, name)!r}, expected {value!r}"
            for name, value in asked.items()
            if value is not None and getattr(self.settings, name) != value
        ]
        if mismatched:
            raise ValueError(f"the {kind} cache in {self.directory} does not match: {'; '.join(mismatched)}")

    def verify(self) -> Verification:
        """Read every shard's bytes and check them against its checksums (raises on the first
        mismatch); shards without checksums are counted, not read."""
        began, verified, unchecked, size = time.perf_counter(), 0, 0, 0
        for index, shard in enumerate(self.shards):
            if verify_shard(shard):
                verified += 1
                size += sum(end - begin for _, begin, end in shard.payload.values())
            else:
                unchecked += 1
            self._verified.add(index)
        return Verification(verified, unchecked, size, time.perf_counter() - began)

    def _verify(self, index: int) -> None:
        """Shard ``index``'s bytes, verified once per reader."""
        if index in self._verified:
            return
        if not verify_shard(self.shards[index]) and not self._warned:
            self._warned = True  # once per reader: an old cache's every shard lacks them
            warnings.warn(
                f"the cache in {self.directory} carries no checksums (written before orda_tp stored them): a damaged "
                "byte in it cannot be detected; rewrite it to have its shards verified",
                UncheckedShardWarning,
                stacklevel=3,
            )
        self._verified.add(index)

    def tensor_rows(self, start: int, stop: int) -> dict[str, Tensor]:
        """Rows ``[start, stop)`` of every tensor of the shards, as stored."""
        if not (is_int(start) and is_int(stop) and 0 <= int(start) <= int(stop) <= self.num_tokens):
            raise ValueError(
                f"rows needs 0 <= start <= stop <= num_tokens ({self.num_tokens}), got [{start!r}, {stop!r})"
            )
        start, stop = int(start), int(stop)
        parts: list[dict[str, Tensor]] = []
        # The shard holding start: the last whose first offset is at most start.
        index = max(0, bisect_right(self._starts, start) - 1)
        while index < len(self.shards) and self.shards[index].start < stop:
            shard = self.shards[index]
            begin, end = max(start, shard.start) - shard.start, min(stop, shard.start + shard.rows) - shard.start
            parts.append(self._read(index, begin, end))
            index += 1
        if not parts:
            shapes = self.settings.tensors(0)
            return {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in shapes.items()}
        return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}

    def tensor_gather(self, offsets: Tensor) -> dict[str, Tensor]:
        """The rows at ``offsets`` (a 1-D integer tensor of global offsets, in any order, repeats
        allowed) of every tensor, as stored. Each shard touched is read over the span of its
        requested rows."""
        if not isinstance(offsets, Tensor) or offsets.dim() != 1 or offsets.is_floating_point() or offsets.is_complex():
            raise TypeError(
                f"offsets must be a 1-D integer tensor, got {getattr(offsets, 'shape', type(offsets).__name__)}"
            )
        offsets = offsets.detach().to("cpu", torch.int64)  # the shards are read on the host
        if offsets.numel() and (int(offsets.min()) < 0 or int(offsets.max()) >= self.num_tokens):
            raise ValueError(
                f"offsets must lie in [0, num_tokens={self.num_tokens}), got values in "
                f"[{int(offsets.min())}, {int(offsets.max())}]"
            )
        gathered = {
            name: torch.empty([offsets.numel(), *shape[1:]], dtype=dtype)
            for name, (shape, dtype) in self.settings.tensors(0).items()
        }
        # Each offset's shard: the last whose first offset is at most it.
        owner = torch.searchsorted(torch.tensor(self._starts), offsets, right=True) - 1
        for index in owner.unique().tolist():
            where = (owner == index).nonzero().squeeze(1)
            local = offsets[where] - self.shards[index].start
            low = int(local.min())  # one read per shard, over the span of its requested rows
            for name, part in self._read(index, low, int(local.max()) + 1).items():
                gathered[name][where] = part[local - low]
        return gathered

    def _read(self, index: int, begin: int, end: int) -> dict[str, Tensor]:
        """Local rows ``[begin, end)`` of shard ``index``'s tensors, its bytes verified first."""
        self._verify(index)
        handle = self._handles.pop(index, None)
        if handle is None:
            handle = safe_open(self.shards[index].path, framework="pt")
        self._handles[index] = handle  # the most recently read, last
        if len(self._handles) > OPEN_SHARDS:  # the least recently read closes: each holds a file and its map
            self._handles.popitem(last=False)
        return {name: handle.get_slice(name)[begin:end] for name in self.shards[index].payload}


class TopKCacheReader(ShardReader[CacheSettings]):
    """A top-k cache (:class:`ShardReader`): rows as int64 ids and float32 log-probabilities (the
    exact upcast of the stored values), and as the teacher of a loss."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        super().__init__(directory, CacheSettings)

    def check(
        self, *, vocab_size: int | None = None, k: int | None = None, temperature: float | None = None,
        logit_softcap: float | None = None, teacher: str | None = None,
    ) -> None:  # fmt: skip
        """Raise a ValueError naming every given setting the cache does not have (None: not checked)."""
        asked: dict[str, object] = {"vocab_size": vocab_size, "k": k, "temperature": temperature}
        self.check_settings("top-k", asked | {"logit_softcap": logit_softcap, "teacher": teacher})

    def rows(self, start: int, stop: int, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
        """Rows ``[start, stop)``: ids (stop − start, k) int64 and log-probabilities float32, on
        ``device`` (default: the CPU; a compact cache's bytes move there and are decoded there)."""
        return self._decoded(self.tensor_rows(start, stop), device)

    def gather(self, offsets: Tensor, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
        """The rows at ``offsets`` (:meth:`ShardReader.tensor_gather`): ids int64, log-probabilities
        float32, on ``device`` (as :meth:`rows`)."""
        return self._decoded(self.tensor_gather(offsets), device)

    def teacher(
        self, start: int, stop: int, tail: str = "uniform", device: torch.device | str | None = None,
        *, retemper: bool = False,
    ) -> PrecomputedTeacher:  # fmt: skip
        """Rows ``[start, stop)`` as the teacher of a loss (``tail``, ``retemper``:
        :class:`~orda_tp.PrecomputedTeacher`'s), on ``device`` (default: the CPU)."""
        ids, logprobs = self.rows(start, stop, device)
        # The teacher at the temperature and soft-cap the cache was made with: a loss at another one re-tempers it.
        return PrecomputedTeacher(
            topk_ids=ids,
            topk_logprobs=logprobs,
            tail=tail,
            topk_temperature=self.settings.temperature,
            topk_softcap=self.settings.logit_softcap,
            retemper=retemper,
        )

    def _decoded(self, stored: dict[str, Tensor], device: torch.device | str | None) -> tuple[Tensor, Tensor]:
        """Stored rows as int64 ids and float32 log-probabilities on ``device``."""
        stored = {name: tensor.to(device) for name, tensor in stored.items()}
        if self.settings.encoding == "compact":
            return compact.decode(stored, self.settings.k, self.settings.vocab_size)
        # float32 holds every stored float16 and bfloat16 value exactly: the upcast changes nothing.
        return stored["ids"].to(torch.int64), stored["logprobs"].to(torch.float32)
