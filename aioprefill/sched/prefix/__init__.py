"""The prefix cache, engine side: block hashes (`hashing`), one worker's block index
(`index`), a batch's reads and writes (`plan`) and every worker's index with the counters and
the routing rule (`cache`). The worker side (the blocks themselves) lives in `workers/`.
See docs/prefix-cache.md."""

from aioprefill.sched.prefix.cache import PrefixCache, PrefixCacheStats
from aioprefill.sched.prefix.hashing import block_hashes, check_salt
from aioprefill.sched.prefix.index import BlockIndex, CacheObserver
from aioprefill.sched.prefix.plan import BatchPlan, Pins

__all__ = [
    "BatchPlan",
    "BlockIndex",
    "CacheObserver",
    "Pins",
    "PrefixCache",
    "PrefixCacheStats",
    "block_hashes",
    "check_salt",
]
