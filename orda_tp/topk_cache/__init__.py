"""Offline teachers: a teacher's top-k log-probabilities, extracted without its logits
(:mod:`.extraction`, ``orda_tp.teacher_topk``), and teacher caches on disk — top-k caches and the
exact hidden-state caches (:mod:`.hidden`) — as directories of safetensors shards, each a contiguous
range of global token offsets with its checksums, that many writers fill at once
(:class:`TopKCacheWriter`, :class:`HiddenCacheWriter`) and readers read back checked and verified
(docs/guide.md, "Top-k teacher caches"; the format and errors: docs/reference.md, "Top-k extraction
and caches"). ``python -m orda_tp.topk_cache verify DIR`` verifies a whole cache.

``from orda_tp.topk_cache import CacheSettings, TopKCacheWriter, TopKCacheReader, head_digest``
needs ``pip install 'orda_tp[cache]'`` (safetensors); the extraction, which ``import orda_tp``
imports, does not: the cache's names are imported when first named.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .extraction import TeacherTopK, TopKPlan, teacher_topk, teacher_topk_of_logits

if TYPE_CHECKING:
    from .hidden import HiddenCacheReader, HiddenCacheSettings, HiddenCacheWriter
    from .reader import OPEN_SHARDS, TopKCacheReader, Verification
    from .rounding import stored_logprobs
    from .shards import (
        ENCODINGS,
        FORMAT,
        FORMAT_VERSION,
        LOGPROB_DTYPES,
        CacheSettings,
        UncheckedShardWarning,
        head_digest,
        shard_name,
    )
    from .writer import TopKCacheWriter

# The cache's names and their modules, which import safetensors (an optional extra).
_CACHE = {name: ".reader" for name in ("OPEN_SHARDS", "TopKCacheReader", "Verification")}
_CACHE |= {name: ".shards" for name in ("FORMAT", "FORMAT_VERSION", "LOGPROB_DTYPES", "CacheSettings")}
_CACHE |= {name: ".shards" for name in ("UncheckedShardWarning", "head_digest", "shard_name")}
_CACHE |= {name: ".hidden" for name in ("HiddenCacheReader", "HiddenCacheSettings", "HiddenCacheWriter")}
_CACHE |= {name: ".writer" for name in ("TopKCacheWriter",)}
_CACHE |= {name: ".rounding" for name in ("stored_logprobs",)}
_CACHE |= {name: ".shards" for name in ("ENCODINGS",)}

__all__ = [
    "ENCODINGS",
    "FORMAT",
    "FORMAT_VERSION",
    "LOGPROB_DTYPES",
    "OPEN_SHARDS",
    "CacheSettings",
    "HiddenCacheReader",
    "HiddenCacheSettings",
    "HiddenCacheWriter",
    "TeacherTopK",
    "TopKCacheReader",
    "TopKCacheWriter",
    "TopKPlan",
    "UncheckedShardWarning",
    "Verification",
    "head_digest",
    "shard_name",
    "stored_logprobs",
    "teacher_topk",
    "teacher_topk_of_logits",
]


def __getattr__(name: str) -> Any:
    """A cache name, imported when first named (PEP 562): ``import orda_tp`` needs no safetensors."""
    if name not in _CACHE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_CACHE[name], __name__), name)
