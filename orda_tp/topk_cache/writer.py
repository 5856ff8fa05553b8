"""Writing a teacher cache: :class:`ShardWriter`, one per contiguous range of global offsets, and
the top-k cache's :class:`TopKCacheWriter`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import TracebackType
from typing import Generic

import torch
from torch import Tensor

from ..arguments.validation import check_count, check_flag
from . import compact
from .extraction import TeacherTopK
from .rounding import stored_logprobs
from .shards import CacheSettings, S, Shard, checksum_metadata, shard_name, shard_ranges, temporary_name

try:
    from safetensors.torch import save as safetensors_save
except ImportError as error:  # pragma: no cover - the extra is missing
    raise ImportError("orda_tp.topk_cache needs safetensors: pip install 'orda_tp[cache]'") from error

__all__ = ["ShardWriter", "TopKCacheWriter", "stored_logprobs"]


class ShardWriter(Generic[S]):
    """Writes rows of one kind of cache (``settings``'s) from global offset ``start`` on into
    ``directory`` (made if missing): a shard every ``rows_per_shard`` rows and one on :meth:`close`,
    each written to a hidden name, synced and renamed, its tensors' checksums in its header.

    ``stop``: the end of this writer's range (None: open), past which appending raises. Ranges of
    writers never overlap: a writer whose range covers a row that a shard of another writer holds
    raises before it writes anything (with ``stop``, over its whole range; without, where it
    starts, and before each shard, over that shard's rows), naming both ranges. With
    ``resume=True`` it continues after its own shards (those from ``start`` on, contiguous, within
    its range; their settings must equal ``settings``): :attr:`num_written` counts them, and the
    caller skips that many of its rows. Without it, a shard at ``start`` raises FileExistsError.
    """

    def __init__(
        self, directory: str | os.PathLike[str], settings: S, start: int = 0, rows_per_shard: int = 65536,
        resume: bool = False, stop: int | None = None,
    ) -> None:  # fmt: skip
        self.directory, self.settings = os.fspath(directory), settings
        self.start = check_count("start", start, 0)
        self.stop = None if stop is None else check_count("stop", stop, self.start)
        self.rows_per_shard = check_count("rows_per_shard", rows_per_shard, 1)
        os.makedirs(self.directory, exist_ok=True)  # writers of one directory start at once
        shards = shard_ranges(self.directory, type(settings))
        self._flushed = self.start + self._resumed(shards, check_flag("resume", resume))
        self._check_disjoint(shards, self._flushed, self.stop)
        self._buffer: dict[str, list[Tensor]] = {}
        self._buffered = 0
        self._closed = False
        stale = os.path.join(self.directory, temporary_name(self._flushed, settings.PREFIX))
        if os.path.exists(stale):  # what a crash left while writing the next shard
            os.remove(stale)

    @property
    def num_written(self) -> int:
        """The rows this writer's range holds so far: resumed, written and buffered."""
        return self._flushed - self.start + self._buffered

    def close(self) -> None:
        """Write the buffered rows (a last, shorter shard); later calls do nothing."""
        if not self._closed:
            self._closed = True
            if self._buffered:
                self._flush(self._buffered)

    def __enter__(self) -> ShardWriter[S]:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, trace: TracebackType | None
    ) -> None:
        # Also on an exception: every row appended so far is complete and checked, so it is written.
        self.close()

    def append_tensors(self, tensors: Mapping[str, Tensor]) -> None:
        """Buffer a block of rows, the shard's tensors by name (checked, on the CPU), and write
        every full shard."""
        if self._closed:
            raise ValueError(f"append on a closed {type(self).__name__}")
        rows = next(iter(tensors.values())).shape[0]
        if self.stop is not None and self.start + self.num_written + rows > self.stop:
            raise ValueError(
                f"appending {rows} rows would pass this writer's stop={self.stop} (it holds rows [{self.start}, "
                f"{self.start + self.num_written}))"
            )
        for name, tensor in tensors.items():
            self._buffer.setdefault(name, []).append(tensor)
        self._buffered += rows
        # Full shards now; a shorter remainder waits for more rows or for close().
        while self._buffered >= self.rows_per_shard:
            self._flush(self.rows_per_shard)

    def _resumed(self, shards: list[Shard], resume: bool) -> int:
        """How many rows from ``start`` on this writer's own shards already hold, contiguous and
        within its range; raises if there are some and ``resume`` is False."""
        by_start = {shard.start: shard for shard in shards}
        rows = 0
        while (shard := by_start.get(self.start + rows)) is not None:
            if self.stop is not None and shard.start + shard.rows > self.stop:
                break  # past this writer's range: another writer's
            if not resume:
                raise FileExistsError(
                    f"{shard.path} exists: pass resume=True to continue after it, or use another directory"
                )
            mismatched = shard.settings.mismatches(self.settings)
            if mismatched:
                raise ValueError(
                    f"{shard.path} was written with other settings (shard's != writer's): {'; '.join(mismatched)}"
                )
            rows += shard.rows
        return rows

    def _check_disjoint(self, shards: list[Shard], begin: int, end: int | None) -> None:
        """Raise FileExistsError if a shard in ``shards`` holds a row of ``[begin, end)`` (None: up
        to the shard that starts there, a writer's open range)."""
        for shard in shards:
            last = shard.start + shard.rows
            # An open range is known where it starts; a closed one intersects the shard's rows.
            overlap = shard.start <= begin < last if end is None else shard.start < end and begin < last
            if overlap:
                upto = "on" if end is None else f"to {end}"
                raise FileExistsError(
                    f"this writer's rows from {begin} {upto} overlap rows [{shard.start}, {last}) that {shard.path} "
                    "holds: writers' ranges must be disjoint"
                )

    def _flush(self, rows: int) -> None:
        """Write the first ``rows`` buffered rows as the shard at the next offset."""
        start, prefix = self._flushed, self.settings.PREFIX
        # Another writer's shard inside this shard's rows: nothing is overwritten, nothing overlaps.
        self._check_disjoint(shard_ranges(self.directory, type(self.settings)), start, start + rows)
        joined = {name: torch.cat(parts) for name, parts in self._buffer.items()}
        tensors = {name: tensor[:rows].contiguous() for name, tensor in joined.items()}
        metadata = self.settings.metadata() | {"start": str(start), "rows": str(rows)} | checksum_metadata(tensors)
        data = safetensors_save(tensors, metadata)
        # A hidden temporary name, synced, then renamed: a crash never leaves a partial shard under a shard's name.
        temporary = os.path.join(self.directory, temporary_name(start, prefix))
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())  # the bytes are on disk before the name says the shard is complete
        os.replace(temporary, os.path.join(self.directory, shard_name(start, prefix)))  # atomic: whole or none
        # The rows past this shard stay buffered, as one piece.
        self._buffer = {name: [tensor[rows:]] for name, tensor in joined.items()} if rows < self._buffered else {}
        self._flushed += rows
        self._buffered -= rows


def _check_rows(ids: object, logprobs: object, settings: CacheSettings) -> tuple[Tensor, Tensor]:
    """``ids`` and ``logprobs`` (rows, k) checked against the settings, detached, on their device."""
    if not isinstance(ids, Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"ids must be an integer tensor (rows, k), got {getattr(ids, 'dtype', type(ids).__name__)}")
    if not isinstance(logprobs, Tensor) or not logprobs.is_floating_point():
        got = getattr(logprobs, "dtype", type(logprobs).__name__)
        raise TypeError(f"logprobs must be a floating-point tensor (rows, k), got {got}")
    if ids.dim() != 2 or ids.shape[1] != settings.k or logprobs.shape != ids.shape or ids.device != logprobs.device:
        raise ValueError(
            f"ids and logprobs must both be (rows, k={settings.k}) on one device, got {tuple(ids.shape)} on "
            f"{ids.device} and {tuple(logprobs.shape)} on {logprobs.device}"
        )
    # Checked once where the rows are, before they are encoded or copied to the host.
    ids, logprobs = ids.detach(), logprobs.detach()
    bad = (ids < 0) | (ids >= settings.vocab_size)
    if bool(bad.any()):
        row, column = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"ids must lie in [0, {settings.vocab_size}); ids[{row}, {column}] = {int(ids[row, column])}")
    ordered = ids.sort(dim=1).values
    repeated = ordered[:, 1:] == ordered[:, :-1]
    if bool(repeated.any()):
        row, column = (int(i) for i in repeated.nonzero()[0])
        raise ValueError(f"ids must be distinct in each row; row {row} holds id {int(ordered[row, column])} twice")
    bad = torch.isnan(logprobs) | (logprobs > 0)
    if bool(bad.any()):
        row, column = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"logprobs must be log-probabilities (<= 0, or -inf for no mass); "
            f"logprobs[{row}, {column}] = {float(logprobs[row, column])}"
        )
    return ids, logprobs


def _check_extraction(topk: TeacherTopK, settings: CacheSettings) -> None:
    """A :class:`~orda_tp.TeacherTopK` states what it was extracted at: the cache's settings."""
    stated = {"temperature": topk.temperature, "logit_softcap": topk.logit_softcap}
    differing = [f"{name}={value!r}" for name, value in stated.items() if value != getattr(settings, name)]
    if differing:
        raise ValueError(
            f"the rows were extracted at {', '.join(differing)}, the cache holds "
            + ", ".join(f"{name}={getattr(settings, name)!r}" for name in stated)
        )
    if topk.vocab_size is not None and topk.vocab_size != settings.vocab_size:
        raise ValueError(
            f"the rows were extracted over a vocabulary of {topk.vocab_size} ids, the cache is for vocab_size="
            f"{settings.vocab_size}: a head shard passed to teacher_topk without its tp_group? (each rank then ranks "
            "only its own columns)"
        )


class TopKCacheWriter(ShardWriter[CacheSettings]):
    """A :class:`ShardWriter` of a top-k cache (:class:`~.shards.CacheSettings`): rows of
    ``k`` ids and their log-probabilities, stored as :func:`~.rounding.stored_logprobs` rounds
    them; with ``encoding="plain"`` as int32 ids (int64 from vocabularies of 2³¹ ids) and
    ``logprob_dtype`` values, with ``encoding="compact"`` as :mod:`.compact` packs them."""

    def __init__(
        self, directory: str | os.PathLike[str], settings: CacheSettings, start: int = 0,
        rows_per_shard: int = 65536, resume: bool = False, stop: int | None = None,
    ) -> None:  # fmt: skip
        if not isinstance(settings, CacheSettings):
            raise TypeError(f"settings must be an orda_tp.topk_cache.CacheSettings, got {type(settings).__name__}")
        super().__init__(directory, settings, start, rows_per_shard, resume, stop)

    def append(self, topk: TeacherTopK | tuple[Tensor, Tensor] | Tensor, logprobs: Tensor | None = None) -> None:
        """Append rows: a :class:`~orda_tp.TeacherTopK` (whose temperature, soft-cap and vocabulary
        must be the cache's), an ``(ids, logprobs)`` pair, or ``ids`` with ``logprobs`` given;
        (rows, k) on any device (checked there; a compact cache encodes them there too, then the
        stored form is copied to the CPU)."""
        if self._closed:
            raise ValueError("append on a closed TopKCacheWriter")
        if logprobs is not None:
            ids = topk
        elif isinstance(topk, TeacherTopK):
            _check_extraction(topk, self.settings)
            ids, logprobs = topk.ids, topk.logprobs
        elif isinstance(topk, (tuple, list)) and len(topk) == 2:
            ids, logprobs = topk
        else:
            raise TypeError(f"append takes a TeacherTopK or (ids, logprobs), got {type(topk).__name__}")
        ids, logprobs = _check_rows(ids, logprobs, self.settings)
        if self.settings.encoding == "compact":
            # Encoded where the rows are (checked above); only the packed bytes travel to the host.
            packed = compact.encode_checked(ids, logprobs, self.settings.vocab_size)
            self.append_tensors({name: tensor.to("cpu") for name, tensor in packed.items()})
            return
        stored = stored_logprobs(logprobs.to("cpu"), self.settings.logprob_dtype)
        self.append_tensors({"ids": ids.to("cpu", self.settings.ids_dtype), "logprobs": stored})
