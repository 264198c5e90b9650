"""Prefix reuse in a trace: each hash id's own tokens, and the hit ratios a cache could reach.

A Mooncake trace names each prompt's blocks by chained hash ids (`traces.py`): equal ids at the
start of two lists mean an equal prefix. The replay gives every hash id its own deterministic
tokens (a function of the id, the position in its block and the seed), so shared ids are
shared tokens and the engine's own hashing finds them; a prompt's last block is partial.

The ceilings are offline simulations in the engine's units (`block_tokens`-token blocks, of
which a request reads at most `(n - 1) // block_tokens`: its last token is always computed):
no eviction (everything ever seen stays), and LRU under a budget of `capacity` blocks, where
after each request its blocks are the most recent, its last block the least recent of them (a
chain's last block is evicted before its parents). With several workers each keeps its own
cache of `capacity // workers` blocks, and requests go round-robin (the yardstick a
prefix-aware dispatcher must beat) or by prefix affinity (each where most of its prompt is
cached, ties to the least loaded: what such a dispatcher can reach). A block here is named by
the hash id holding its last token and that token's place in it: the same content as the
engine's chained token hash, without hashing any tokens.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from aioprefill.bench.workload import Schedule

__all__ = [
    "CacheBudget",
    "block_keys",
    "ceilings",
    "distinct_blocks",
    "hit_tokens",
    "prompt_tokens",
    "scale_blocks",
    "trace_prompts",
]

_U = np.uint64


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijection of uint64 that scatters neighbouring inputs."""
    x = x + _U(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U(30))) * _U(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U(27))) * _U(0x94D049BB133111EB)
    return x ^ (x >> _U(31))


def prompt_tokens(
    hash_ids: np.ndarray, length: int, block_tokens: int, vocab_size: int, seed: int = 0
) -> np.ndarray:
    """int32[length]: token `p` is a hash of (seed, `hash_ids[p // block_tokens]`,
    `p % block_tokens`), in [1, vocab_size)."""
    pos = np.arange(length, dtype=np.int64)
    ids = hash_ids[pos // block_tokens].astype(np.uint64)
    salted = _mix(ids ^ _mix(np.full(1, seed, dtype=np.uint64)))
    x = _mix(salted + (pos % block_tokens).astype(np.uint64))
    return (x % _U(max(1, vocab_size - 1)) + _U(1)).astype(np.int32)


def trace_prompts(sched: Schedule, vocab_size: int, seed: int = 0) -> list[np.ndarray]:
    """Every request's tokens (`prompt_tokens`); the schedule must carry hash ids."""
    if sched.hash_ids is None:
        raise ValueError("the schedule has no hash ids")
    return [
        prompt_tokens(h, int(n), sched.block_tokens, vocab_size, seed)
        for h, n in zip(sched.hash_ids, sched.lengths, strict=True)
    ]


def scale_blocks(sched: Schedule, block_tokens: int) -> Schedule:
    """The trace with each hash id standing for `block_tokens` tokens: a prompt of k ids keeps
    k-1 full blocks and its partial last block in proportion (rounded up, at least 1 token)."""
    if sched.hash_ids is None:
        raise ValueError("the schedule has no hash ids")
    old = sched.block_tokens
    k = np.fromiter((len(h) for h in sched.hash_ids), dtype=np.int64, count=len(sched))
    last = sched.lengths - (k - 1) * old
    lengths = (k - 1) * block_tokens + np.maximum(1, -(-last * block_tokens // old))
    return Schedule(sched.arrivals_s, lengths, sched.hash_ids, block_tokens)


def block_keys(hash_ids: np.ndarray, length: int, trace_block: int, block: int) -> np.ndarray:
    """int64[length // block]: a name for each full engine block of the prompt, equal for two
    prompts exactly when their tokens up to that block's end are equal."""
    last = (np.arange(length // block, dtype=np.int64) + 1) * block - 1
    return hash_ids[last // trace_block] * trace_block + last % trace_block


def _all_keys(sched: Schedule, block: int) -> list[list[int]]:
    if sched.hash_ids is None:
        raise ValueError("the schedule has no hash ids")
    return [
        block_keys(h, int(n), sched.block_tokens, block).tolist()
        for h, n in zip(sched.hash_ids, sched.lengths, strict=True)
    ]


def distinct_blocks(sched: Schedule, block: int) -> int:
    """How many different full engine blocks the trace's prompts hold (a cache of this many
    blocks never evicts)."""
    return len({k for keys in _all_keys(sched, block) for k in keys})


def hit_tokens(
    keys: Sequence[Sequence[int]],
    lengths: np.ndarray,
    block: int,
    capacity: int | None,
    *,
    workers: int = 1,
    route: str = "round_robin",
) -> np.ndarray:
    """int64[n]: tokens each request reads from the cache, requests in order, over `workers`
    caches of `capacity // workers` blocks each (None: no eviction). `route`: `round_robin`
    deals requests in turn; `affinity` sends each to the cache holding most of its prompt,
    ties to the one that computed the fewest tokens so far."""
    per = None if capacity is None else capacity // workers
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(workers)]
    computed = [0] * workers
    out = np.zeros(len(keys), dtype=np.int64)
    for i, (ks, n) in enumerate(zip(keys, lengths, strict=True)):
        usable = ks[: (int(n) - 1) // block]
        if route == "affinity":
            hits = [_prefix_hits(c, usable) for c in caches]
            w = min(range(workers), key=lambda w: (-hits[w], computed[w]))
            found = hits[w]
        else:
            w = i % workers
            found = _prefix_hits(caches[w], usable)
        cache = caches[w]
        out[i] = found * block
        computed[w] += int(n) - int(out[i])
        if per == 0:
            continue
        for key in reversed(ks):  # the first block ends up most recent, the last least
            cache[key] = None
            cache.move_to_end(key)
        while per is not None and len(cache) > per:
            cache.popitem(last=False)
    return out


def _prefix_hits(cache: OrderedDict[int, None], keys: Sequence[int]) -> int:
    hits = 0
    for key in keys:
        if key not in cache:
            break
        hits += 1
    return hits


def ceilings(
    sched: Schedule, block: int, capacity: int | None, *, workers: int = 1
) -> dict[str, float | int | None]:
    """Hit ratios (cached / prompt tokens) the trace allows: `no_eviction`, `lru` (one cache
    of `capacity` blocks), and with `workers` > 1 that budget split evenly with requests
    dealt in turn (`round_robin`) or each sent where most of its prompt is (`affinity`)."""
    keys = _all_keys(sched, block)
    total = float(sched.lengths.sum())

    def ratio(cap: int | None, w: int = 1, route: str = "round_robin") -> float:
        hits = hit_tokens(keys, sched.lengths, block, cap, workers=w, route=route)
        return float(hits.sum()) / total

    several = workers > 1 and capacity is not None
    return {
        "block_tokens": block,
        "capacity_blocks": capacity,
        "distinct_blocks": len({k for ks in keys for k in ks}),
        "no_eviction": ratio(None),
        "lru": ratio(capacity) if capacity is not None else None,
        "round_robin": ratio(capacity, workers) if several else None,
        "affinity": ratio(capacity, workers, "affinity") if several else None,
        "workers": workers,
    }


_SIZE = re.compile(r"^([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*(b|kb|mb|gb|kib|mib|gib)?$")
_UNITS = {None: 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20}
_UNITS["gib"] = 2**30


@dataclass(frozen=True, slots=True)
class CacheBudget:
    """One `--prefix-cache` setting: `default` (the engine's), `off` (0), bytes per worker
    (`256MiB`), or a share of the trace's distinct blocks over all workers (`10%`, `all`)."""

    label: str
    kind: str  # "default" | "bytes" | "share"
    value: float = 0.0

    @classmethod
    def parse(cls, text: str) -> CacheBudget:
        t = text.strip().lower()
        if t == "default":
            return cls("default", "default")
        if t in ("off", "0"):
            return cls("off", "bytes", 0)
        if t == "all":
            return cls("all", "share", 1.0)
        if t.endswith("%"):
            try:
                pct = float(t[:-1])
            except ValueError:
                raise ValueError(f"not a percentage: {text!r}") from None
            if not (math.isfinite(pct) and 0 < pct <= 1000):
                raise ValueError(f"a share must be in (0, 1000]%, got {text!r}")
            return cls(f"{pct:g}%", "share", pct / 100)
        m = _SIZE.match(t)
        if m is None:
            raise ValueError(
                f"not a cache budget: {text!r} (use default, off, all, 10% or a size like 256MiB)"
            )
        size = float(m.group(1)) * _UNITS[m.group(2)]
        if not math.isfinite(size):
            raise ValueError(f"budget is not finite: {text!r}")
        return cls(t.replace(" ", ""), "bytes", int(size))

    @property
    def is_off(self) -> bool:
        return self.kind == "bytes" and self.value == 0

    def bytes_per_worker(
        self, *, default: int, block_bytes: int, distinct: int | None, workers: int
    ) -> int:
        """The engine's `prefix_cache_bytes` for this setting."""
        if self.kind == "default":
            return default
        if self.kind == "bytes":
            return int(self.value)
        if distinct is None:
            raise ValueError(f"--prefix-cache {self.label}: only with a trace that has hash ids")
        blocks = math.ceil(self.value * distinct / workers)
        return blocks * block_bytes
