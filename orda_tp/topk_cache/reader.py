"""Reading a top-k cache: :class:`TopKCacheReader`, every shard checked, rows read memory-mapped."""

from __future__ import annotations

import os
from bisect import bisect_right
from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor

from ..arguments.validation import is_int
from ..teachers import PrecomputedTeacher
from .shards import open_shard, shard_name, shard_offsets

try:
    from safetensors import safe_open
except ImportError as error:  # pragma: no cover - the extra is missing
    raise ImportError("orda_tp.topk_cache needs safetensors: pip install 'orda_tp[cache]'") from error

__all__ = ["OPEN_SHARDS", "TopKCacheReader"]

#: Open shard handles a reader keeps (memory maps; the oldest is closed past this many).
OPEN_SHARDS = 64


class TopKCacheReader:
    """The cache in ``directory``: every shard's header checked, their settings equal and their
    ranges tiling ``[0, num_tokens)``. Reads memory-map the shards (a handle per shard, opened
    when first read; at most :data:`OPEN_SHARDS` kept open)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = os.fspath(directory)
        if not os.path.isdir(self.directory):
            raise ValueError(f"directory must be a top-k cache directory, got {self.directory!r} (not a directory)")
        offsets = shard_offsets(self.directory)
        if not offsets:
            raise ValueError(f"{self.directory} holds no top-k cache shards (topk-<offset>.safetensors)")
        self.shards = tuple(open_shard(os.path.join(self.directory, shard_name(s)), s) for s in offsets)
        self.settings = self.shards[0].settings
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

    def check(
        self, *, vocab_size: int | None = None, k: int | None = None, temperature: float | None = None,
        logit_softcap: float | None = None, teacher: str | None = None,
    ) -> None:  # fmt: skip
        """Raise a ValueError naming every given setting the cache does not have (None: not checked)."""
        asked: dict[str, object] = {"vocab_size": vocab_size, "k": k, "temperature": temperature}
        asked |= {"logit_softcap": logit_softcap, "teacher": teacher}
        mismatched = [
            f"{name}: the cache has {getattr(self.settings, name)!r}, expected {value!r}"
            for name, value in asked.items()
            if value is not None and getattr(self.settings, name) != value
        ]
        if mismatched:
            raise ValueError(f"the top-k cache in {self.directory} does not match: {'; '.join(mismatched)}")

    def rows(self, start: int, stop: int) -> tuple[Tensor, Tensor]:
        """Rows ``[start, stop)``: ids (stop − start, k) int64 and log-probabilities float32."""
        if not (is_int(start) and is_int(stop) and 0 <= int(start) <= int(stop) <= self.num_tokens):
            raise ValueError(
                f"rows needs 0 <= start <= stop <= num_tokens ({self.num_tokens}), got [{start!r}, {stop!r})"
            )
        start, stop = int(start), int(stop)
        parts = []
        # The shard holding start: the last whose first offset is at most start.
        index = max(0, bisect_right(self._starts, start) - 1)
        while index < len(self.shards) and self.shards[index].start < stop:
            shard = self.shards[index]
            begin, end = max(start, shard.start) - shard.start, min(stop, shard.start + shard.rows) - shard.start
            parts.append(self._read(index, begin, end))
            index += 1
        if not parts:
            return torch.empty(0, self.settings.k, dtype=torch.int64), torch.empty(0, self.settings.k)
        return torch.cat([part[0] for part in parts]), torch.cat([part[1] for part in parts])

    def gather(self, offsets: Tensor) -> tuple[Tensor, Tensor]:
        """The rows at ``offsets`` (a 1-D integer tensor of global offsets, in any order, repeats
        allowed): ids (n, k) int64 and log-probabilities float32. Each shard touched is read over
        the span of its requested rows."""
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
        ids = torch.empty(offsets.numel(), self.settings.k, dtype=torch.int64)
        logprobs = torch.empty(offsets.numel(), self.settings.k)
        # Each offset's shard: the last whose first offset is at most it.
        owner = torch.searchsorted(torch.tensor(self._starts), offsets, right=True) - 1
        for index in owner.unique().tolist():
            where = (owner == index).nonzero().squeeze(1)
            local = offsets[where] - self.shards[index].start
            # One read per shard, over the span of its requested rows.
            low = int(local.min())
            part_ids, part_logprobs = self._read(index, low, int(local.max()) + 1)
            ids[where], logprobs[where] = part_ids[local - low], part_logprobs[local - low]
        return ids, logprobs

    def teacher(
        self, start: int, stop: int, tail: str = "uniform", device: torch.device | str | None = None,
        *, retemper: bool = False,
    ) -> PrecomputedTeacher:  # fmt: skip
        """Rows ``[start, stop)`` as the teacher of a loss (``tail``: :class:`~orda_tp.PrecomputedTeacher`'s),
        on ``device`` (default: the CPU)."""
        ids, logprobs = self.rows(start, stop)
        # The teacher at the temperature and soft-cap the cache was made with: a loss at another one re-tempers it.
        return PrecomputedTeacher(
            topk_ids=ids.to(device),
            topk_logprobs=logprobs.to(device),
            tail=tail,
            topk_temperature=self.settings.temperature,
            topk_softcap=self.settings.logit_softcap,
            retemper=retemper,
        )

    def _read(self, index: int, begin: int, end: int) -> tuple[Tensor, Tensor]:
        """Local rows ``[begin, end)`` of shard ``index`` as int64 ids and float32 log-probabilities."""
        handle = self._handles.pop(index, None)
        if handle is None:
            handle = safe_open(self.shards[index].path, framework="pt")
        self._handles[index] = handle  # the most recently read, last
        if len(self._handles) > OPEN_SHARDS:  # the least recently read closes: each holds a file and its map
            self._handles.popitem(last=False)
        ids = handle.get_slice("ids")[begin:end]
        logprobs = handle.get_slice("logprobs")[begin:end]
        # float32 holds every stored float16 and bfloat16 value exactly: the upcast changes nothing.
        return ids.to(torch.int64), logprobs.to(torch.float32)
