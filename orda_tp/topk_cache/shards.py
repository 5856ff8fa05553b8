"""The shards of a teacher cache: their names, the settings their metadata states, the checksums of
their tensors, and the check of a shard's header against its file (docs/reference.md, "Top-k
extraction and caches").

A cache is a directory of safetensors shards of one kind (a top-k cache's ``topk-…``, a hidden-state
cache's ``hidden-…``), each holding rows ``[start, start + rows)`` of the global token offsets. The
kind's settings (:class:`ShardSettings`) say what its metadata states and which tensors a shard of
``rows`` rows holds; every shard also states its ``start``, ``rows`` and the CRC-32 of each tensor's
bytes (``checksum.<name>``), which a reader verifies before it serves a row of the shard.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import ClassVar, NamedTuple, Protocol, TypeVar

import torch
from torch import Tensor

from ..arguments.validation import check_count, check_number
from ..parallel.dtensor import is_dtensor
from .compact import TENSORS as COMPACT_TENSORS
from .compact import layout as compact_layout

try:
    from safetensors import SafetensorError, safe_open
except ImportError as error:  # pragma: no cover - the extra is missing
    raise ImportError("orda_tp.topk_cache needs safetensors: pip install 'orda_tp[cache]'") from error

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ENCODINGS",
    "LOGPROB_DTYPES",
    "CacheSettings",
    "Shard",
    "ShardSettings",
    "UncheckedShardWarning",
    "checksum",
    "head_digest",
    "open_shard",
    "shard_name",
    "shard_ranges",
    "temporary_name",
    "verify_shard",
]

FORMAT, FORMAT_VERSION = "orda_tp.topk_cache", "2"
#: How a top-k cache's rows are stored: "plain" (int32 ids, ``logprob_dtype`` values; version 1's
#: only encoding) or "compact" (:mod:`.compact`: Elias-Fano ids and float16 magnitudes, 208–232 B/token at k = 64).
ENCODINGS = ("plain", "compact")
LOGPROB_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_STORED_DTYPES = {"U8": torch.uint8, "I32": torch.int32, "I64": torch.int64, "F16": torch.float16}
_STORED_DTYPES |= {"BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
_CHECKSUM = "checksum."  # metadata key prefix: "checksum.<tensor>" = "crc32:<8 hex digits>"
_READ_BYTES = 64 << 20  # a shard is verified 64 MiB of file at a time


class UncheckedShardWarning(UserWarning):
    """A cache's shards carry no checksums (written before they were stored): their bytes cannot be
    verified."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class ShardSettings(Protocol):
    """What the shards of one kind of cache share, and what a shard of ``rows`` rows holds."""

    #: The metadata's ``format`` and the shards' file-name prefix.
    FORMAT: ClassVar[str]
    PREFIX: ClassVar[str]

    def metadata(self) -> dict[str, str]: ...

    def tensors(self, rows: int) -> dict[str, tuple[list[int], torch.dtype]]:
        """The tensors of a shard of ``rows`` rows: name → (shape, dtype)."""
        ...

    def mismatches(self, other: ShardSettings) -> list[str]: ...


S = TypeVar("S", bound=ShardSettings)


def settings_mismatches(settings: object, other: object) -> list[str]:
    """``name: settings' value != other's`` for every dataclass field in which the two differ."""
    if type(settings) is not type(other):
        return [f"kind: {type(settings).__name__} != {type(other).__name__}"]
    return [
        f"{field.name}: {getattr(settings, field.name)!r} != {getattr(other, field.name)!r}"
        for field in fields(settings)  # type: ignore[arg-type]
        if getattr(settings, field.name) != getattr(other, field.name)
    ]


def read_format(metadata: Mapping[str, str], format_name: str, versions: tuple[str, ...], where: str) -> str:
    """The version ``metadata`` states; raise unless it states ``format_name`` at one of ``versions``."""
    version = metadata.get("version")
    if metadata.get("format") != format_name or version not in versions:
        raise ValueError(
            f"{where} is not an {format_name} shard of version {' or '.join(versions)}: its metadata states format "
            f"{metadata.get('format')!r}, version {version!r}"
        )
    return version


@dataclass(frozen=True)
class CacheSettings:
    """What every shard of a top-k cache shares: the teacher's real ``vocab_size``, ``k``, the
    extraction's ``temperature`` and ``logit_softcap``, a ``teacher`` name (a model name or
    :func:`head_digest` of its head; "" for none), the stored log-probabilities' ``logprob_dtype``
    and the rows' ``encoding`` (:data:`ENCODINGS`; "compact" stores float16 values exactly in
    fewer bytes, so it needs ``logprob_dtype=torch.float16``)."""

    FORMAT: ClassVar[str] = FORMAT
    PREFIX: ClassVar[str] = "topk"

    vocab_size: int
    k: int
    temperature: float = 1.0
    logit_softcap: float | None = None
    teacher: str = ""
    logprob_dtype: torch.dtype = torch.float16
    encoding: str = "plain"

    def __post_init__(self) -> None:
        object.__setattr__(self, "vocab_size", check_count("CacheSettings.vocab_size", self.vocab_size, 1))
        object.__setattr__(self, "k", check_count("CacheSettings.k", self.k, 1))
        if self.k > self.vocab_size:
            raise ValueError(f"CacheSettings.k must be at most vocab_size ({self.vocab_size}), got {self.k}")
        object.__setattr__(
            self, "temperature", check_number("CacheSettings.temperature", self.temperature, positive=True)
        )
        if self.logit_softcap is not None:
            cap = check_number("CacheSettings.logit_softcap", self.logit_softcap, positive=True)
            object.__setattr__(self, "logit_softcap", cap)
        if not isinstance(self.teacher, str):
            raise TypeError(f"CacheSettings.teacher must be a str, got {type(self.teacher).__name__}")
        if self.logprob_dtype not in LOGPROB_DTYPES.values():
            raise ValueError(
                f"CacheSettings.logprob_dtype must be one of {list(LOGPROB_DTYPES)}, got {self.logprob_dtype!r}"
            )
        if self.encoding not in ENCODINGS:
            raise ValueError(f"CacheSettings.encoding must be one of {list(ENCODINGS)}, got {self.encoding!r}")
        if self.encoding == "compact":
            compact_layout(self.k, self.vocab_size)  # the codec's limits: vocab_size <= 2**31
            if self.logprob_dtype != torch.float16:
                raise ValueError(
                    f"CacheSettings.encoding='compact' stores float16 log-probabilities; got logprob_dtype="
                    f"{self.logprob_dtype!r} (use encoding='plain' for it)"
                )

    @property
    def ids_dtype(self) -> torch.dtype:
        """The stored ids' dtype: int32 where every id fits in it."""
        return torch.int32 if self.vocab_size < 2**31 else torch.int64

    def tensors(self, rows: int) -> dict[str, tuple[list[int], torch.dtype]]:
        if self.encoding == "compact":  # the codec's two byte tables, a fixed width per row
            plan = compact_layout(self.k, self.vocab_size)
            widths = (plan.id_bytes, plan.logprob_bytes)
            return {name: ([rows, width], torch.uint8) for name, width in zip(COMPACT_TENSORS, widths)}
        return {"ids": ([rows, self.k], self.ids_dtype), "logprobs": ([rows, self.k], self.logprob_dtype)}

    def metadata(self) -> dict[str, str]:
        """The settings as safetensors metadata (strings), with the format and its version."""
        cap = "none" if self.logit_softcap is None else repr(self.logit_softcap)
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "vocab_size": str(self.vocab_size),
            "k": str(self.k),
            "temperature": repr(self.temperature),  # repr: the float reads back exactly
            "logit_softcap": cap,
            "teacher": self.teacher,
            "logprob_dtype": dtype_name(self.logprob_dtype),
            "encoding": self.encoding,
        }

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str], where: str) -> CacheSettings:
        """The settings a shard's metadata states (``where`` names the shard in errors)."""
        version = read_format(metadata, FORMAT, ("1", FORMAT_VERSION), where)
        try:
            cap = metadata["logit_softcap"]
            return cls(
                vocab_size=int(metadata["vocab_size"]),
                k=int(metadata["k"]),
                temperature=float(metadata["temperature"]),
                logit_softcap=None if cap == "none" else float(cap),
                teacher=metadata["teacher"],
                logprob_dtype=LOGPROB_DTYPES[metadata["logprob_dtype"]],
                encoding="plain" if version == "1" else metadata["encoding"],  # version 1 had no other
            )
        except (KeyError, ValueError, TypeError) as error:
            raise ValueError(f"{where} has unreadable metadata ({type(error).__name__}: {error})") from error

    def mismatches(self, other: ShardSettings) -> list[str]:
        """``name: self's value != other's`` for every field in which the two differ."""
        return settings_mismatches(self, other)


def head_digest(weight: Tensor) -> str:
    """A short stable name of a teacher's LM head: the first 16 hex digits of the SHA-256 of its
    dtype, shape and values (row-major, little-endian bytes). A tensor-parallel shard hashes its
    local shard; a DTensor hashes its full tensor (``full_tensor()``: a collective)."""
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if is_dtensor(weight):
        weight = weight.full_tensor()
    # Row-major bytes on the host: the digest depends on neither the device nor the strides.
    flat = weight.detach().to("cpu").contiguous().reshape(-1)
    # The dtype and shape first: the same bytes as another dtype or shape hash differently.
    digest = hashlib.sha256(f"{dtype_name(flat.dtype)}|{tuple(weight.shape)}|".encode())
    step = max(1, (64 << 20) // max(1, flat.element_size()))  # hash 64 MiB at a time
    for begin in range(0, flat.numel(), step):
        part = flat[begin : begin + step]
        # The raw bytes through ctypes, not NumPy, which has no bfloat16.
        digest.update(ctypes.string_at(part.data_ptr(), part.numel() * part.element_size()))
    return digest.hexdigest()[:16]


def checksum(tensor: Tensor) -> str:
    """``crc32:<hex>`` of a CPU tensor's row-major bytes, as safetensors stores them."""
    flat = tensor.detach().contiguous().reshape(-1)
    # The raw bytes through ctypes (no NumPy bfloat16); CRC-32 finds every flipped byte at ~4 GB/s.
    data = ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size())
    return f"crc32:{zlib.crc32(data):08x}"


def shard_name(start: int, prefix: str = "topk") -> str:
    """The file name of the shard whose first global offset is ``start``."""
    return f"{prefix}-{start:012d}.safetensors"


def temporary_name(start: int, prefix: str = "topk") -> str:
    """Where the shard at ``start`` is written before its rename (hidden, not ``*.safetensors``)."""
    return f".{shard_name(start, prefix)}.tmp"


def _shard_pattern(prefix: str) -> re.Pattern[str]:
    # shard_name's twelve digits, or more past 10¹² rows; a hidden temporary file does not match.
    return re.compile(rf"{re.escape(prefix)}-(\d{{12,}})\.safetensors")


class Shard(NamedTuple):
    """A checked shard header: its path, settings, first global offset, rows, and its tensors'
    stated checksums and byte ranges in the file (name → (checksum or None, begin, end))."""

    path: str
    settings: ShardSettings
    start: int
    rows: int
    payload: dict[str, tuple[str | None, int, int]]


def open_shard(path: str, start: int, settings_type: type[S]) -> Shard:
    """Read and check a shard's header: metadata, offset, tensors' shapes and dtypes, file size."""
    try:
        with open(path, "rb") as file:  # safetensors' first 8 bytes: the header's length, little-endian
            header_bytes = int.from_bytes(file.read(8), "little")
            header = json.loads(file.read(header_bytes))
        handle = safe_open(path, framework="pt")
        metadata = handle.metadata() or {}
        slices = {name: handle.get_slice(name) for name in handle.keys()}
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): {error}") from error
    settings = settings_type.from_metadata(metadata, path)  # type: ignore[attr-defined]
    if metadata.get("start") != str(start) or not metadata.get("rows", "").isdigit():
        raise ValueError(
            f"{path} states start={metadata.get('start')!r}, rows={metadata.get('rows')!r}; its name says {start}"
        )
    rows = int(metadata["rows"])
    expected = settings.tensors(rows)
    if set(slices) != set(expected):
        raise ValueError(f"{path} holds tensors {sorted(slices)}, expected {sorted(expected)}")
    size, data_start, payload = 8 + header_bytes, 8 + header_bytes, {}
    for name, (shape, dtype) in expected.items():
        stated, stored = list(slices[name].get_shape()), _STORED_DTYPES.get(slices[name].get_dtype())
        if stated != shape or stored != dtype:
            raise ValueError(f"{path}: {name} is {stored} {stated}, its metadata says {dtype} {shape}")
        begin, end = header[name]["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{path}: {name}'s bytes [{begin}, {end}) do not hold a {dtype} {shape} tensor")
        payload[name] = (metadata.get(_CHECKSUM + name), data_start + begin, data_start + end)
        size += end - begin
    # The file must be exactly the header and the tensors it declares: a truncated write shows here.
    actual = os.path.getsize(path)
    if actual != size:
        raise ValueError(f"{path} is {actual} bytes, its header says {size}: a truncated or corrupt shard")
    return Shard(path, settings, start, rows, payload)


def checksum_metadata(tensors: Mapping[str, Tensor]) -> dict[str, str]:
    """The ``checksum.<name>`` metadata entries of a shard's tensors."""
    return {_CHECKSUM + name: checksum(tensor) for name, tensor in tensors.items()}


def verify_shard(shard: Shard) -> bool:
    """Read every byte of ``shard``'s tensors and raise a ValueError naming the shard and the tensor
    whose CRC-32 is not the one its header states. False (nothing read) for a shard that states no
    checksums: one written before orda_tp stored them."""
    if any(stated is None for stated, _, _ in shard.payload.values()):
        return False
    with open(shard.path, "rb") as file:
        for name, (stated, begin, end) in shard.payload.items():
            file.seek(begin)
            crc, remaining = 0, end - begin
            while remaining:
                block = file.read(min(_READ_BYTES, remaining))
                if not block:  # a file cut short since its header was read
                    break
                crc, remaining = zlib.crc32(block, crc), remaining - len(block)
            if f"crc32:{crc:08x}" != stated or remaining:
                raise ValueError(
                    f"{shard.path}: the bytes of its tensor {name!r} do not match their checksum ({stated} stated, "
                    f"crc32:{crc:08x} read): a damaged shard; rewrite it (or restore it) before training on it"
                )
    return True


def shard_ranges(directory: str, settings_type: type[S]) -> list[Shard]:
    """The shards of ``settings_type``'s kind in ``directory``, headers checked, by first offset."""
    pattern = _shard_pattern(settings_type.PREFIX)
    starts = sorted(int(match.group(1)) for name in os.listdir(directory) if (match := pattern.fullmatch(name)))
    return [open_shard(os.path.join(directory, shard_name(s, settings_type.PREFIX)), s, settings_type) for s in starts]
