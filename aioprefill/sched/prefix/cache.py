"""`PrefixCache`: what every worker group's prefix cache holds, as the engine decided it.

One `BlockIndex` per worker group (pool slot), the hashing settings, the counters behind
`engine.stats().prefix_cache`, and the observer told of every block stored, evicted or lost.
The `Scheduler` owns it: it hashes a prompt once at submit (`hashes`), asks for a `BatchPlan`
each time it forms a batch for a group (`plan`), releases a batch's pins with its answer
(`release`) and drops a group's index when the group dies (`drop`).

Routing (several data-parallel groups): a request's *home* is the group holding most of its
prompt (blocks a batch in flight writes count: a prefix being computed already has a home). A
group forming a batch leaves a request to its home when `2 * gain > wait` (`BatchPlan.elsewhere`:
`gain` the tokens it would read there and not here, `wait` half the home's tokens in flight plus
the requests already left to it); otherwise it takes the request and writes its blocks (a
prefix that queues at its home gets a second home). A free group stays idle only
while every request it could take is answered sooner by its home; the home takes them the
moment its forward ends (forward-gated).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import msgspec

from aioprefill.sched.prefix.hashing import block_hashes
from aioprefill.sched.prefix.index import BlockIndex, CacheObserver
from aioprefill.sched.prefix.plan import BatchPlan, Pins, PlanShared
from aioprefill.sched.units import Budget, Request

__all__ = ["PrefixCache", "PrefixCacheStats"]

_run: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend  # consumes, in C


class PrefixCacheStats(msgspec.Struct, frozen=True, kw_only=True):
    """`engine.stats().prefix_cache`. Counters (`queried_tokens`, `hit_tokens`, `evictions`)
    only grow, across worker deaths and restarts; `blocks` and `bytes` are what the workers
    hold now (every rank of a tensor-parallel group counted in `bytes`)."""

    queried_tokens: int = 0  # prompt tokens of every prompt with a full block, at each lookup
    hit_tokens: int = 0  # of those, read from the cache (piggyback reads included)
    store_hit_tokens: int = 0  # not in hit_tokens: loaded from the KV store (kv_store) instead
    blocks: int = 0
    bytes: int = 0
    evictions: int = 0
    capacity_blocks: int = 0  # slots over every group that reported a cache

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class PrefixCache:
    """`slots`: the pool's worker groups, read only (`cache_blocks`, `block_bytes`,
    `generation` from their ranks' `Ready`; `usable`, `in_flight` for routing)."""

    def __init__(
        self,
        slots: Sequence[Any],
        block_tokens: int,
        *,
        max_read_blocks: int = 1 << 14,
        observer: CacheObserver | None = None,
        store_keys: bool = True,
    ) -> None:
        self.slots = slots
        self.block_tokens = block_tokens
        self.min_bytes = 4 * block_tokens  # a prompt shorter than this has no block to hash
        self.indexes = [BlockIndex() for _ in slots]
        self._generation = [-1] * len(slots)  # the start of each group its index describes
        # settings, observer and counters, shared with every plan (which adds to the counters)
        self.shared = PlanShared(block_tokens, max_read_blocks, store_keys, self.indexes)
        self.shared.observer = observer
        self.store_hit_tokens = 0  # the workers report them in their answers (Outcomes)

    @property
    def observer(self) -> CacheObserver | None:
        return self.shared.observer

    @observer.setter
    def observer(self, observer: CacheObserver | None) -> None:
        self.shared.observer = observer

    @property
    def store_keys(self) -> bool:
        return self.shared.store_keys

    @property
    def queried_tokens(self) -> int:
        return self.shared.queried_tokens

    @property
    def hit_tokens(self) -> int:
        return self.shared.hit_tokens

    @property
    def evictions(self) -> int:
        return self.shared.evictions

    def hashes(self, tokens: bytes, salt: str | None) -> list[int] | None:
        """The prompt's block hashes; None when it has no full block, or when no worker keeps
        a cache (a runner without one: then nothing depends on the cache)."""
        if not any(s.cache_blocks for s in self.slots):
            return None
        return block_hashes(tokens, self.block_tokens, salt) or None

    def defer_hashes(self, req: Request, salt: str | None) -> None:
        """Give a new request the means to hash its blocks when they are first read
        (`Request.hashes`; never for a prompt without a full block)."""
        if len(req.tokens) >= self.min_bytes:
            req.hasher = partial(self.hashes, req.tokens, salt)

    @staticmethod
    def hash_ahead(pending: Iterable[Request], budget: Budget) -> None:
        """Hash the prompts at the queue's head not hashed yet, a batch's worth (a batch was
        just written: its forward runs meanwhile), so the next batch forms without hashing;
        the others are hashed when first read."""
        tokens, count = budget.max_batch_tokens, budget.max_batch_size
        for req in pending:
            if tokens <= 0 or count <= 0:
                return
            if req.hasher is not None:
                req.hashes  # noqa: B018 (computes them)
            tokens -= req.remaining
            count -= 1

    def plan(self, group: int, *, route: bool = False) -> BatchPlan | None:
        """A plan for the next batch of `group` (None when it keeps no cache); with `route`
        and several groups, the plan may leave requests to another group."""
        index = self.index_of(group)
        if index is None:
            return None
        slots = self.slots
        waits = None
        if route and len(slots) > 1:
            waits = [sum(b.num_tokens for b in s.in_flight) if s.usable else None for s in slots]
        return BatchPlan(self.shared, group, index, waits)

    def index_of(self, group: int) -> BlockIndex | None:
        """The group's index (reset first if the group restarted since: the plans made
        before are void), None when the group keeps no cache."""
        slot = self.slots[group]
        index = self.indexes[group]
        if slot.generation != self._generation[group]:  # (re)started: adopt its slot count
            self.drop(group)
            self._generation[group] = slot.generation
            index.reset(slot.cache_blocks, slot.block_bytes)
        return index if index.num_blocks else None

    def release(self, pins: Pins, *, failed: bool = False) -> None:
        """A batch's answer came back: its slots may be evicted again, the chain's last
        blocks first. `failed` (the forward raised): the blocks it was to write are forgotten,
        since the worker may not have written them. Ignored if the group lost its index."""
        index = self.indexes[pins.group]
        if index.epoch != pins.epoch:
            return
        if failed and pins.written:  # (before the unpins: a pinned slot goes free after)
            lost = [index.hash_of[s] for s in pins.written if index.discard(s)]
            if lost and self.observer is not None:
                self.observer.removed(pins.group, lost, in_store=False)
        held, hash_of, lru, free, count = (
            index.slot_of,
            index.hash_of,
            index.lru,
            index.free,
            index.pins,
        )
        slots = pins.slots[::-1]  # the chain's last blocks first: evicted first
        if (
            max(map(count.__getitem__, slots)) == 1
            and list(map(held.get, map(hash_of.__getitem__, slots))) == slots
        ):  # the common case (each pinned once, all held), in C loops
            _run(map(count.__delitem__, slots))
            lru.update(dict.fromkeys(slots))
            return
        for slot in slots:  # `BlockIndex.unpin`, inlined
            n = count[slot]
            if n > 1:
                count[slot] = n - 1
                continue
            del count[slot]
            if held.get(hash_of[slot]) == slot:
                lru[slot] = None
            else:
                free.append(slot)

    def drop(self, group: int) -> None:
        """The group died or restarts: forget everything it held (never read from it again)."""
        index = self.indexes[group]
        had = len(index)
        index.reset(0, index.block_bytes)
        if had and self.observer is not None:
            self.observer.cleared(group)

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            queried_tokens=self.queried_tokens,
            hit_tokens=self.hit_tokens,
            store_hit_tokens=self.store_hit_tokens,
            blocks=sum(len(ix) for ix in self.indexes),
            bytes=sum(len(ix) * ix.block_bytes for ix in self.indexes),
            evictions=self.evictions,
            capacity_blocks=sum(s.cache_blocks for s in self.slots),
        )

    def check(self, pins: Iterable[Pins | None]) -> None:
        """Recount every index, and its pins against the batches in flight (AssertionError)."""
        expected: list[Counter[int]] = [Counter() for _ in self.indexes]
        for p in pins:
            if p is not None and self.indexes[p.group].epoch == p.epoch:
                expected[p.group].update(p.slots)
        for group, index in enumerate(self.indexes):
            index.check()
            held = dict(index.pins)
            if held != dict(expected[group]):
                raise AssertionError(
                    f"prefix index of group {group}: pins {held} but batches in flight "
                    f"hold {dict(expected[group])}"
                )


def prefix_cache_for(config: Any, slots: Sequence[Any]) -> PrefixCache | None:
    """The engine's `PrefixCache` for an `EngineConfig` and the pool's `slots` (None when
    `prefix_cache_bytes` is 0); a batch reads at most 1/16 of the ring in slot ids, and
    carries its written blocks' hashes only to workers with a KV store."""
    if not config.prefix_cache_bytes:
        return None
    max_reads = max(64, config.effective_ring_capacity() // 64)
    return PrefixCache(
        slots,
        config.prefix_block_tokens,
        max_read_blocks=max_reads,
        store_keys=config.kv_store is not None,  # (only a worker's store reads them)
    )
