"""A teacher's top-k log-probabilities on disk: safetensors shards that many writers fill at once.

A cache is a directory of shards, each a contiguous range of global token offsets (rows), named by
its first offset: ``topk-000000000000.safetensors`` holds rows ``[start, start + rows)``. A shard
holds two tensors and string metadata (safetensors' header)::

    tensor     shape      dtype
    ids        (rows, k)  int32 (int64 when vocab_size >= 2**31): global vocabulary ids
    logprobs   (rows, k)  logprob_dtype: float16 (default), bfloat16 or float32

    metadata key    value
    format          "orda_tp.topk_cache"           version   "1"
    vocab_size, k   ints                           teacher   a name or head_digest(weight)
    temperature     a float (repr)                 logit_softcap   a float (repr) or "none"
    logprob_dtype   "float16" | "bfloat16" | "float32"
    start, rows     the shard's first global offset and its number of rows

Each :class:`TopKCacheWriter` covers the offsets from its ``start`` on (data-parallel ranks write
disjoint ranges into one directory; there is no shared index to race on). A shard is written to a
hidden temporary name, synced and renamed (``os.replace``), so a crash never leaves a partial
shard under a shard's name; a restarted writer with ``resume=True`` continues after its last shard.
Rows are buffered and written every ``rows_per_shard`` rows and on close; the rows appended before
an exception inside ``with`` are written too (every appended row is complete and checked).

The stored log-probabilities are the input rounded to nearest in ``logprob_dtype``, except in a
row whose rounded mass would exceed 1 (a peaked teacher's), which is rounded toward −inf
(:func:`~.writer.stored_logprobs`: :class:`~orda_tp.PrecomputedTeacher` refuses a mass above 1);
a value below float16's range, −65504, becomes −inf (a probability that is 0 in float32 too);
−inf (no mass) stays −inf. float16
is the default: against a float32 cache it moves the loss and its gradients far less than rounding
the student's inputs to bfloat16 does, and about eight times less than bfloat16 storage
(docs/benchmarks.md, "cache on disk"; V = 32000, k ≤ 128).

:class:`TopKCacheReader` checks every shard's header, size and settings and that the shards
tile ``[0, num_tokens)``; it reads the rows asked for from the memory-mapped files and
returns ids as int64 and log-probabilities as float32 (the exact upcast of the stored values).

``from orda_tp.topk_cache import CacheSettings, TopKCacheWriter, TopKCacheReader, head_digest``
(``import orda_tp`` does not import this module: it needs ``pip install 'orda_tp[cache]'``).
"""

from .reader import OPEN_SHARDS, TopKCacheReader
from .shards import FORMAT, FORMAT_VERSION, LOGPROB_DTYPES, CacheSettings, head_digest, shard_name
from .writer import TopKCacheWriter, stored_logprobs

__all__ = ["FORMAT", "FORMAT_VERSION", "LOGPROB_DTYPES", "OPEN_SHARDS", "CacheSettings", "TopKCacheReader"]
__all__ += ["TopKCacheWriter", "head_digest", "shard_name", "stored_logprobs"]
