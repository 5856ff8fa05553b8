"""Writing a top-k cache: :class:`TopKCacheWriter`, one per contiguous range of global offsets."""

from __future__ import annotations

import os
from types import TracebackType

import torch
from torch import Tensor

from ..arguments.validation import check_count, check_flag
from .extraction import TeacherTopK
from .shards import CacheSettings, open_shard, shard_name, shard_offsets, temporary_name

try:
    from safetensors.torch import save as safetensors_save
except ImportError as error:  # pragma: no cover - the extra is missing
    raise ImportError("orda_tp.topk_cache needs safetensors: pip install 'orda_tp[cache]'") from error

__all__ = ["TopKCacheWriter", "rounded_down", "stored_logprobs"]

_SMALLEST_NEGATIVE = -32767  # int16 bits 0x8001: the negative float16 / bfloat16 closest to 0


def stored_logprobs(logprobs: Tensor, dtype: torch.dtype) -> Tensor:
    """``logprobs`` (rows, k) as stored in ``dtype``: rounded to nearest, except in the rows whose
    rounded mass ``Σ e^l`` would exceed 1 (a peaked teacher's top-k holds nearly all the mass; to
    nearest its k values can sum past 1 by ``Σ p·|l|·2⁻¹¹`` in float16, which
    :class:`~orda_tp.PrecomputedTeacher` refuses), which are rounded toward −inf (:func:`rounded_down`)."""
    stored = logprobs.to(dtype)
    # Only the rows whose rounded mass exceeds 1 are rounded down: the rest keep round-to-nearest's accuracy.
    over = torch.exp(stored.double()).sum(dim=1) > 1
    if bool(over.any()):
        stored[over] = rounded_down(logprobs[over], dtype)  # in place: only those rows change
    return stored


def rounded_down(logprobs: Tensor, dtype: torch.dtype) -> Tensor:
    """``logprobs`` (≤ 0) in ``dtype``, rounded toward −inf: each stored probability is at most
    the given one, so a row's mass never rounds above what it was. For the 16-bit dtypes the next
    value down from a nonpositive ``y`` is its bits plus one (sign and magnitude), from ``±0`` the
    smallest negative subnormal; values below the dtype's range become −inf."""
    stored = logprobs.to(dtype)
    if dtype not in (torch.float16, torch.bfloat16):
        return (
            stored
            if dtype == logprobs.dtype
            else stored.where(stored.to(logprobs.dtype) <= logprobs, stored.nextafter(stored.new_tensor(float("-inf"))))
        )
    # Sign and magnitude: for y ≤ 0 the next value down has bits + 1; from ±0, the smallest negative subnormal.
    bits = stored.view(torch.int16)
    lower = torch.where(stored == 0, torch.full_like(bits, _SMALLEST_NEGATIVE), bits + 1).view(dtype)
    # Stepped down only where rounding to nearest went up.
    return torch.where(stored.to(logprobs.dtype) > logprobs, lower, stored)


def _check_rows(ids: object, logprobs: object, settings: CacheSettings) -> tuple[Tensor, Tensor]:
    """``ids`` and ``logprobs`` (rows, k) checked against the settings, on the CPU."""
    if not isinstance(ids, Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"ids must be an integer tensor (rows, k), got {getattr(ids, 'dtype', type(ids).__name__)}")
    if not isinstance(logprobs, Tensor) or not logprobs.is_floating_point():
        got = getattr(logprobs, "dtype", type(logprobs).__name__)
        raise TypeError(f"logprobs must be a floating-point tensor (rows, k), got {got}")
    if ids.dim() != 2 or ids.shape[1] != settings.k or logprobs.shape != ids.shape:
        raise ValueError(
            f"ids and logprobs must both be (rows, k={settings.k}), got {tuple(ids.shape)} and {tuple(logprobs.shape)}"
        )
    # Shards are written from the host: the rows are checked there, once, before they are buffered.
    ids, logprobs = ids.detach().to("cpu"), logprobs.detach().to("cpu")
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


class TopKCacheWriter:
    """Writes rows from global offset ``start`` on into ``directory`` (made if missing), a shard every
    ``rows_per_shard`` rows and one on :meth:`close` (module docstring). With ``resume=True`` it
    continues after its own shards (those from ``start`` on, contiguous; their settings must equal
    ``settings``): :attr:`num_written` counts them, and the caller skips that many of its rows.
    Without it, a shard at ``start`` already there raises FileExistsError (nothing is overwritten)."""

    def __init__(
        self, directory: str | os.PathLike[str], settings: CacheSettings, start: int = 0,
        rows_per_shard: int = 65536, resume: bool = False,
    ) -> None:  # fmt: skip
        if not isinstance(settings, CacheSettings):
            raise TypeError(f"settings must be an orda_tp.topk_cache.CacheSettings, got {type(settings).__name__}")
        self.directory = os.fspath(directory)
        self.settings = settings
        self.start = check_count("start", start, 0)
        self.rows_per_shard = check_count("rows_per_shard", rows_per_shard, 1)
        os.makedirs(self.directory, exist_ok=True)  # writers of one directory start at once
        self._flushed = self.start + _resumed_rows(self.directory, settings, self.start, check_flag("resume", resume))
        self._buffer: list[tuple[Tensor, Tensor]] = []
        self._buffered = 0
        self._closed = False
        stale = os.path.join(self.directory, temporary_name(self._flushed))
        if os.path.exists(stale):  # what a crash left while writing the next shard
            os.remove(stale)

    @property
    def num_written(self) -> int:
        """The rows this writer's range holds so far: resumed, written and buffered."""
        return self._flushed - self.start + self._buffered

    def append(self, topk: TeacherTopK | tuple[Tensor, Tensor] | Tensor, logprobs: Tensor | None = None) -> None:
        """Append rows: a :class:`~orda_tp.TeacherTopK`, an ``(ids, logprobs)`` pair, or ``ids``
        with ``logprobs`` given; (rows, k) on any device (copied to the CPU and checked)."""
        if self._closed:
            raise ValueError("append on a closed TopKCacheWriter")
        if logprobs is not None:
            ids = topk
        elif isinstance(topk, TeacherTopK):
            ids, logprobs = topk.ids, topk.logprobs
        elif isinstance(topk, (tuple, list)) and len(topk) == 2:
            ids, logprobs = topk
        else:
            raise TypeError(f"append takes a TeacherTopK or (ids, logprobs), got {type(topk).__name__}")
        ids, logprobs = _check_rows(ids, logprobs, self.settings)
        self._buffer.append((ids.to(self.settings.ids_dtype), stored_logprobs(logprobs, self.settings.logprob_dtype)))
        self._buffered += ids.shape[0]
        # Full shards now; a shorter remainder waits for more rows or for close().
        while self._buffered >= self.rows_per_shard:
            self._flush(self.rows_per_shard)

    def close(self) -> None:
        """Write the buffered rows (a last, shorter shard); later calls do nothing."""
        if not self._closed:
            self._closed = True
            if self._buffered:
                self._flush(self._buffered)

    def __enter__(self) -> TopKCacheWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, trace: TracebackType | None
    ) -> None:
        # Also on an exception: every row appended so far is complete and checked, so it is written.
        self.close()

    def _flush(self, rows: int) -> None:
        """Write the first ``rows`` buffered rows as the shard at the next offset."""
        start, name = self._flushed, shard_name(self._flushed)
        # Another writer's shard inside this range: ranges must be disjoint, and nothing is overwritten.
        for offset in shard_offsets(self.directory):
            if start <= offset < start + rows:
                raise FileExistsError(
                    f"{os.path.join(self.directory, shard_name(offset))} lies in rows [{start}, {start + rows}) "
                    "that this writer is writing: writers' ranges must be disjoint"
                )
        ids = torch.cat([pair[0] for pair in self._buffer])
        logprobs = torch.cat([pair[1] for pair in self._buffer])
        metadata = self.settings.metadata() | {"start": str(start), "rows": str(rows)}
        data = safetensors_save({"ids": ids[:rows].contiguous(), "logprobs": logprobs[:rows].contiguous()}, metadata)
        # A hidden temporary name, synced, then renamed: a crash never leaves a partial shard under a shard's name.
        temporary = os.path.join(self.directory, temporary_name(start))
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())  # the bytes are on disk before the name says the shard is complete
        os.replace(temporary, os.path.join(self.directory, name))  # atomic: readers see the whole shard or none
        # The rows past this shard stay buffered, as one piece.
        self._buffer = [(ids[rows:], logprobs[rows:])] if rows < ids.shape[0] else []
        self._flushed += rows
        self._buffered -= rows


def _resumed_rows(directory: str, settings: CacheSettings, start: int, resume: bool) -> int:
    """How many rows from ``start`` on the shards already in ``directory`` hold, contiguous (checked
    like the reader checks them); raises if there are some and ``resume`` is False."""
    offsets = set(shard_offsets(directory))
    rows = 0
    while start + rows in offsets:
        path = os.path.join(directory, shard_name(start + rows))
        if not resume:
            raise FileExistsError(f"{path} exists: pass resume=True to continue after it, or use another directory")
        shard = open_shard(path, start + rows)
        mismatched = shard.settings.mismatches(settings)
        if mismatched:
            raise ValueError(f"{path} was written with other settings (shard's != writer's): {'; '.join(mismatched)}")
        rows += shard.rows
    return rows
