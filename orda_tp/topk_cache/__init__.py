"""A teacher's top-k log-probabilities on disk: a directory of safetensors shards, each a contiguous
range of global token offsets, that many writers fill at once (:class:`TopKCacheWriter`) and
:class:`TopKCacheReader` reads back checked (docs/guide.md, "Top-k teacher caches"; the shard format
and errors: docs/reference.md, "Top-k extraction and caches").

``from orda_tp.topk_cache import CacheSettings, TopKCacheWriter, TopKCacheReader, head_digest``
(``import orda_tp`` does not import this module: it needs ``pip install 'orda_tp[cache]'``).
"""

from .reader import OPEN_SHARDS, TopKCacheReader
from .shards import FORMAT, FORMAT_VERSION, LOGPROB_DTYPES, CacheSettings, head_digest, shard_name
from .writer import TopKCacheWriter, stored_logprobs

__all__ = ["FORMAT", "FORMAT_VERSION", "LOGPROB_DTYPES", "OPEN_SHARDS", "CacheSettings", "TopKCacheReader"]
__all__ += ["TopKCacheWriter", "head_digest", "shard_name", "stored_logprobs"]
