"""The shards of a top-k cache: their names, the settings their metadata states, and the check of
a shard's header against its file (the format: :mod:`orda_tp.topk_cache`)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
from torch import Tensor

from ..arguments.validation import check_count, check_number
from ..parallel.dtensor import is_dtensor

try:
    from safetensors import SafetensorError, safe_open
except ImportError as error:  # pragma: no cover - the extra is missing
    raise ImportError("orda_tp.topk_cache needs safetensors: pip install 'orda_tp[cache]'") from error

__all__ = ["FORMAT", "FORMAT_VERSION", "LOGPROB_DTYPES", "CacheSettings", "Shard", "head_digest", "open_shard"]
__all__ += ["shard_name", "shard_offsets", "temporary_name"]

FORMAT, FORMAT_VERSION = "orda_tp.topk_cache", "1"
LOGPROB_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# shard_name's twelve digits, or more past 10¹² rows; a hidden temporary file does not match.
_SHARD = re.compile(r"topk-(\d{12,})\.safetensors")
_STORED_DTYPES = {"I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16}
_STORED_DTYPES["F32"] = torch.float32


def shard_name(start: int) -> str:
    """The file name of the shard whose first global offset is ``start``."""
    return f"topk-{start:012d}.safetensors"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class CacheSettings:
    """What every shard of a cache shares: the teacher's real ``vocab_size``, ``k``, the extraction's
    ``temperature`` and ``logit_softcap``, a ``teacher`` name (a model name or :func:`head_digest`
    of its head; "" for none) and the stored log-probabilities' ``logprob_dtype``."""

    vocab_size: int
    k: int
    temperature: float = 1.0
    logit_softcap: float | None = None
    teacher: str = ""
    logprob_dtype: torch.dtype = torch.float16

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

    @property
    def ids_dtype(self) -> torch.dtype:
        """The stored ids' dtype: int32 where every id fits in it."""
        return torch.int32 if self.vocab_size < 2**31 else torch.int64

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
            "logprob_dtype": _dtype_name(self.logprob_dtype),
        }

    @classmethod
    def from_metadata(cls, metadata: dict[str, str], where: str) -> CacheSettings:
        """The settings a shard's metadata states (``where`` names the shard in errors)."""
        if metadata.get("format") != FORMAT or metadata.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"{where} is not an {FORMAT} shard of version {FORMAT_VERSION}: its metadata states format "
                f"{metadata.get('format')!r}, version {metadata.get('version')!r}"
            )
        try:
            cap = metadata["logit_softcap"]
            return cls(
                vocab_size=int(metadata["vocab_size"]),
                k=int(metadata["k"]),
                temperature=float(metadata["temperature"]),
                logit_softcap=None if cap == "none" else float(cap),
                teacher=metadata["teacher"],
                logprob_dtype=LOGPROB_DTYPES[metadata["logprob_dtype"]],
            )
        except (KeyError, ValueError, TypeError) as error:
            raise ValueError(f"{where} has unreadable metadata ({type(error).__name__}: {error})") from error

    def mismatches(self, other: CacheSettings) -> list[str]:
        """``name: self's value != other's`` for every field in which the two differ."""
        return [
            f"{field.name}: {getattr(self, field.name)!r} != {getattr(other, field.name)!r}"
            for field in fields(self)
            if getattr(self, field.name) != getattr(other, field.name)
        ]


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
    digest = hashlib.sha256(f"{_dtype_name(flat.dtype)}|{tuple(weight.shape)}|".encode())
    step = max(1, (64 << 20) // max(1, flat.element_size()))  # hash 64 MiB at a time
    for begin in range(0, flat.numel(), step):
        part = flat[begin : begin + step]
        # The raw bytes through ctypes, not NumPy, which has no bfloat16.
        digest.update(ctypes.string_at(part.data_ptr(), part.numel() * part.element_size()))
    return digest.hexdigest()[:16]


def temporary_name(start: int) -> str:
    """Where the shard at ``start`` is written before its rename (hidden, not ``*.safetensors``)."""
    return f".{shard_name(start)}.tmp"


def shard_offsets(directory: str) -> list[int]:
    """The first offsets of the shards in ``directory``, ascending."""
    return sorted(int(match.group(1)) for name in os.listdir(directory) if (match := _SHARD.fullmatch(name)))


class Shard(NamedTuple):
    """A checked shard: its path, settings, first global offset and rows."""

    path: str
    settings: CacheSettings
    start: int
    rows: int


def open_shard(path: str, start: int) -> Shard:
    """Read and check a shard's header: metadata, offset, tensors' shapes and dtypes, file size."""
    try:
        with open(path, "rb") as file:  # safetensors' first 8 bytes: the header's length, little-endian
            header_bytes = int.from_bytes(file.read(8), "little")
        handle = safe_open(path, framework="pt")
        metadata = handle.metadata() or {}
        slices = {name: handle.get_slice(name) for name in handle.keys()}
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): {error}") from error
    settings = CacheSettings.from_metadata(metadata, path)
    if metadata.get("start") != str(start) or not metadata.get("rows", "").isdigit():
        raise ValueError(
            f"{path} states start={metadata.get('start')!r}, rows={metadata.get('rows')!r}; its name says {start}"
        )
    rows = int(metadata["rows"])
    expected = {"ids": settings.ids_dtype, "logprobs": settings.logprob_dtype}
    if set(slices) != set(expected):
        raise ValueError(f"{path} holds tensors {sorted(slices)}, expected {sorted(expected)}")
    size = 8 + header_bytes
    for name, dtype in expected.items():
        shape, stored = list(slices[name].get_shape()), _STORED_DTYPES.get(slices[name].get_dtype())
        if shape != [rows, settings.k] or stored != dtype:
            raise ValueError(f"{path}: {name} is {stored} {shape}, its metadata says {dtype} {[rows, settings.k]}")
        size += rows * settings.k * dtype.itemsize
    # The file must be exactly the header and the tensors it declares: a truncated write shows here.
    actual = os.path.getsize(path)
    if actual != size:
        raise ValueError(f"{path} is {actual} bytes, its header says {size}: a truncated or corrupt shard")
    return Shard(path, settings, start, rows)
