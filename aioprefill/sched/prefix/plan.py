"""`BatchPlan`: the prefix cache instructions of one batch as it is formed for one worker group.

The batch former (`take_batch`, `Scheduler.dispatch_alone`, `dispatch_step`) asks the plan two
questions per request and tells it each chunk it takes, in batch order:

- `lookup(req)`: how many of the prompt's first tokens this group can read instead of computing
  (whole blocks, never the last token: at most `(n - 1) // B` blocks), counting blocks that a
  request *earlier in this batch* writes ("piggyback": the worker writes a layer's K/V into the
  slot before later requests of the batch attend at that layer, so a prefix that several
  requests of one batch share is computed once, by the first, and nobody waits a forward);
- `elsewhere(req, cached)`: whether another group holds so much more of it that the request
  should wait for that group (the routing rule, `PrefixCache` docs);
- `place(req, start, end, cached)`: the chunk, its reads and its writes decided and pinned.

How `place` slices one prompt of n tokens in blocks of B (here a first chunk, `start` 0):

    tokens   0         cached         end                       n
             |==========|==============|.........................|
    blocks   | read     | written      | later chunks            |
             |<- reads: whole blocks held by this group (never the last token)
                        |<- run: the full blocks [cached/B, end/B) the group does not hold,
                            stopping at the first one it holds; `taken` of them get slots
                            (written), the rest are the tail (a store puts them)
    a later chunk starts at its `start`, reads nothing, and re-pins its earlier blocks.

A request asking for prompt log-probabilities, prompt top-k or mean pooling (`needs_rows`)
reads only blocks that kept their final hidden rows, and writes again (with them) the rowless
ones it computes; the blocks any other request writes keep none (`BlockIndex.rowless`: its
worker may run the last layer on each prompt's last row alone), unless a KV store puts them.

Only the first chunk computed of a prompt reads; every chunk writes the full blocks it
completes that the group does not hold yet (stopping at the first one it holds, or when every
slot is pinned). With a KV store (`store_keys`), the written blocks' hashes travel too, and so
do the hashes of the chunk's *tail*: the blocks of that run that no slot took (every slot
pinned, a prompt longer than the cache, a run whose parent is gone), which the worker's store
writes to scratch slots and puts, so no computed block is lost to the other nodes.

`columns()` gives the `PrefillBatch` columns (kept in wire bytes as chunks are placed, so
handing them over costs nothing); once the pool took the batch, `commit()` counts the lookups
and tells the observer; if it did not, `abort()` gives back every slot taken (blocks evicted
meanwhile stay forgotten: harmless).
"""

from __future__ import annotations

import struct

import numpy as np

from aioprefill.sched.prefix.index import BlockIndex, CacheObserver
from aioprefill.sched.units import Chunk, Request
from aioprefill.wire.outputs import OPTS_OVER_PROMPT

__all__ = ["BatchPlan", "Pins", "PlanShared"]


class PlanShared:
    """What a `PrefixCache` shares with each `BatchPlan` it makes: its settings, every group's
    index (for routing), its observer, and the counters a plan adds to when it is sent. The
    cache reads the counters back from here (`PrefixCache.stats`)."""

    __slots__ = (
        "block_tokens",
        "evictions",
        "hit_tokens",
        "indexes",
        "max_read_blocks",
        "observer",
        "queried_tokens",
        "store_keys",
    )

    def __init__(
        self, block_tokens: int, max_read_blocks: int, store_keys: bool, indexes: list[BlockIndex]
    ) -> None:
        self.block_tokens = block_tokens
        self.max_read_blocks = max_read_blocks  # per batch: its frame must fit the ring
        self.store_keys = store_keys  # batches carry their written blocks' hashes (a KV store)
        self.indexes = indexes  # one per group, the cache's own list
        self.observer: CacheObserver | None = None
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0


class Pins:
    """The slots a sent batch pinned on one group's index, released with its answer."""

    __slots__ = ("epoch", "group", "slots", "written")

    def __init__(self, group: int, epoch: int, slots: list[int], written: list[int]) -> None:
        self.group = group
        self.epoch = epoch
        self.slots = slots  # every pin, in the order taken
        self.written = written  # the slots it writes


class BatchPlan:
    __slots__ = (
        "block_tokens",
        "cache",
        "deferred",
        "group",
        "hit",
        "index",
        "new",
        "num_reads",
        "num_tails",
        "num_writes",
        "pins",
        "queried",
        "queued",
        "read_offsets",
        "read_slots",
        "reads_left",
        "rewritten",
        "tail_hashes",
        "tail_offsets",
        "tailed",
        "waits",
        "write_first",
        "write_hashes",
        "write_offsets",
        "write_slots",
        "written",
    )

    def __init__(
        self, cache: PlanShared, group: int, index: BlockIndex, waits: list[int | None] | None
    ) -> None:
        self.cache = cache
        self.group = group
        self.index = index
        self.block_tokens = cache.block_tokens
        self.reads_left = cache.max_read_blocks  # keeps the batch's frame within the ring
        # Routing: tokens in flight on each group (None: not usable); None: no routing.
        self.waits = waits
        self.queued = [0] * len(waits) if waits is not None else []  # tokens left to each
        self.deferred = 0  # requests left to another group in this pass
        # The wire columns, built as chunks are placed, already in wire bytes (`columns()`
        # hands these very buffers over: nothing is left to do for them when the batch is
        # sent): per request the running totals of its reads and writes, the slots, each
        # writer's first block, and the written blocks' hashes (parallel to write_slots).
        self.read_offsets = bytearray(_ZERO)
        self.read_slots = bytearray()
        self.write_offsets = bytearray(_ZERO)
        self.write_slots = bytearray()
        self.write_first = bytearray()
        self.write_hashes = bytearray()
        # With a store: per request the running total of, and the hashes of, the full blocks
        # it computes past its writes (no slot here holds them; the worker's store puts them).
        self.tail_offsets = bytearray(_ZERO) if cache.store_keys else bytearray()
        self.tail_hashes = bytearray()
        self.num_reads = 0
        self.num_writes = 0
        self.num_tails = 0
        self.pins: list[int] = []  # every pin this batch took, in order
        self.new: list[int] = []  # slots it writes
        self.written: list[tuple[Request, int, int]] = []  # (request, first block, count)
        self.tailed: list[tuple[Request, int, int]] = []  # the same, of each chunk's tail
        self.queried = 0
        self.hit = 0
        self.rewritten = 0  # rowless blocks forgotten to be written again (not evictions)

    def lookup(self, req: Request) -> int:
        """Tokens of `req`'s prompt this group can read (whole blocks, not the last token)."""
        hashes = req.hashes
        if not hashes:
            return 0
        limit = min((req.num_tokens - 1) // self.block_tokens, self.reads_left)
        return self.index.count(hashes, limit, rows=needs_rows(req)) * self.block_tokens

    def elsewhere(self, req: Request, cached: int) -> bool:
        """Whether `req` should wait for its *home*, the group holding most of its prompt
        (blocks that a batch in flight writes included): when `2 * gain > wait`, with `gain`
        the tokens it would read there and not here, and `wait` half the tokens that group has
        in flight (its forward is half done, on average) plus the uncached tokens of the
        requests this pass already left to it (they go first). The saving counts twice: the
        tokens are not computed, and their blocks are not stored a second time. Ties go to the
        home with less to wait for. If it does not wait (its home is that busy), it runs here
        and writes its blocks like any other: a prefix that queues at its home gets a second
        one, so a hot prefix (a few-shot context) is not computed by one group alone."""
        waits = self.waits
        hashes = req.hashes
        if waits is None or not hashes:
            return False
        limit = (req.num_tokens - 1) // self.block_tokens
        indexes, queued, size = self.cache.indexes, self.queued, self.block_tokens
        rows, home = needs_rows(req), -1
        best = cost = 0
        for g, wait in enumerate(waits):
            if wait is None or g == self.group:
                continue
            gain = indexes[g].count(hashes, limit, rows=rows) * size - cached
            if gain <= 0:
                continue
            wait = (wait >> 1) + queued[g]
            if 2 * gain > wait and (gain > best or (gain == best and wait < cost)):
                home, best, cost = g, gain, wait
        if home < 0:
            return False
        queued[home] += req.num_tokens - cached - best
        self.deferred += 1
        return True

    def place(self, req: Request, start: int, end: int, cached: int = 0) -> Chunk:
        """`req`'s chunk up to `end`, reading `cached` tokens (`lookup`'s answer, first chunk
        only) and writing the blocks it completes; every slot it uses is pinned."""
        index, size, pins = self.index, self.block_tokens, self.pins
        hashes: list[int] = req.hashes or []
        rows = needs_rows(req)
        reads: list[int] = []
        if start == 0:
            if hashes:  # (a prompt without a full block is never looked up)
                self.queried += req.num_tokens
            if cached:
                reads = index.match(hashes, min(cached, end - 1) // size, rows=rows)
                for slot in reads:
                    index.pin(slot)
                pins.extend(reads)
                self.reads_left -= len(reads)
                start = cached = len(reads) * size
                self.hit += cached
        elif hashes:  # a later chunk: its prompt's earlier blocks are used again (LRU order)
            for slot in index.match(hashes, start // size):
                index.pin(slot)
                pins.append(slot)
        if reads:
            self.read_slots += _int32s(reads)
            self.num_reads += len(reads)
        self.read_offsets += _INT32(self.num_reads)
        first = start // size
        slot_of = index.slot_of
        run = hashes[first : end // size]
        if rows and index.rowless:  # held without their rows: forgotten, written again with them
            gone = [h for h in run if slot_of.get(h) in index.rowless and index.discard(slot_of[h])]
            index.evicted.extend(gone)
            self.rewritten += len(gone)
        if not slot_of.keys().isdisjoint(run):  # stop at the first block held already (or
            run = run[: next(i for i, h in enumerate(run) if h in slot_of)]  # written before)
        # (a run whose chain's parent is not here is not written: a block nobody could reach)
        orphan = bool(run and first and hashes[first - 1] not in slot_of)
        taken = index.take(len(run)) if run and not orphan else []
        count = len(taken)
        if count:  # fewer than asked when the rest of the slots are pinned
            # rowless unless a KV store puts them (their workers then keep every row)
            index.put(run[:count], taken, rowless=not (rows or self.cache.store_keys))
            pins.extend(taken)
            self.new.extend(taken)
            self.write_slots += _int32s(taken)
            self.num_writes += count
            if self.cache.store_keys:
                self.write_hashes += struct.pack(f"<{count}Q", *run[:count])
        self.write_offsets += _INT32(self.num_writes)
        self.write_first += _INT32(first)
        if self.cache.store_keys:  # the blocks it computes and no slot takes: pinned, or orphans
            if count < len(run):
                self.tail_hashes += struct.pack(f"<{len(run) - count}Q", *run[count:])
                self.num_tails += len(run) - count
                self.tailed.append((req, first + count, len(run) - count))
            self.tail_offsets += _INT32(self.num_tails)
        if count:
            self.written.append((req, first, count))
        return Chunk(req, start, end, cached)

    def columns(self) -> tuple[bytes, ...] | None:
        """(read_offsets, read_slots, write_offsets, write_slots, write_first, write_hashes,
        tail_offsets, tail_hashes) for the `PrefillBatch` (little-endian int32, the hashes
        uint64), or None when the batch neither reads nor writes a block nor computes a tail.
        O(1): the plan's own buffers, built in wire bytes as chunks were placed (so a batch's
        hand-off does nothing for them; msgspec encodes a bytearray as it does bytes). No
        chunk is placed after this."""
        if not self.num_reads and not self.num_writes and not self.num_tails:
            return None
        # (bytearrays, read-only from here on: msgspec encodes them as bytes)
        return (  # type: ignore[return-value]
            self.read_offsets,
            self.read_slots,
            self.write_offsets,
            self.write_slots,
            self.write_first,
            self.write_hashes,
            self.tail_offsets,
            self.tail_hashes,
        )

    def commit(self) -> Pins | None:
        """The pool took the batch: count its lookups, tell the observer, return its pins."""
        cache = self.cache
        cache.queried_tokens += self.queried
        cache.hit_tokens += self.hit
        self._flush_evicted()
        observer = cache.observer
        if observer is not None:
            for blocks, tell in (
                (self.written, observer.stored),
                (self.tailed, observer.put_past_cache),
            ):
                for req, first, count in blocks:
                    tell(self.group, *self._chain(req, first, count))
        if not self.pins:
            return None
        return Pins(self.group, self.index.epoch, self.pins, self.new)

    def _chain(
        self, req: Request, first: int, count: int
    ) -> tuple[list[int], int | None, list[int]]:
        """Blocks first .. first + count of `req`'s prompt: hashes, parent, token ids."""
        hashes, size = req.hashes, self.block_tokens
        assert hashes is not None
        ids = np.frombuffer(req.tokens, dtype="<i4")[first * size : (first + count) * size]
        return hashes[first : first + count], hashes[first - 1] if first else None, ids.tolist()

    def abort(self) -> None:
        """The batch was not sent: give back every pin and every slot it was to write."""
        index = self.index
        new = set(self.new)
        for slot in reversed(self.pins):
            if slot in new and index.pins[slot] == 1:  # (its write pin: the last one left)
                index.forget(slot)
            else:
                index.unpin(slot)
        self._flush_evicted()

    def _flush_evicted(self) -> None:
        evicted = self.index.evicted
        if evicted:
            self.cache.evictions += len(evicted) - self.rewritten
            self.rewritten = 0
            if self.cache.observer is not None:
                self.cache.observer.removed(self.group, list(evicted))
            evicted.clear()


def needs_rows(req: Request) -> bool:
    """Whether `req` asks for what the final hidden rows of its prompt's positions give
    (prompt log-probabilities or top-k, mean pooling): it reads only blocks that kept them, and
    the blocks it writes keep them."""
    outputs = req.outputs
    return outputs is not None and bool(outputs.bits & OPTS_OVER_PROMPT)


_INT32 = struct.Struct("<i").pack
_ZERO = _INT32(0)


def _int32s(values: list[int]) -> bytes:
    """Little-endian int32 bytes of `values`."""
    return struct.pack(f"<{len(values)}i", *values)
