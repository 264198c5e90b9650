"""`BlockIndex`: which of one worker's cache slots holds which block, as the engine decided.

The worker (every rank of a tensor-parallel group alike; each expert-parallel rank for
itself) has `num_blocks` slots and never chooses what goes where: the engine does, here, when it
plans a batch, and the batch carries the decision. Because a worker runs its batches in order,
the index is exact the moment a batch is sent.

- `slot_of`: block hash -> slot, for every block the worker holds (or that a batch already
  sent, or being formed, writes).
- pins: a slot read or written by a batch in flight (or being formed) is pinned until that
  batch's answer (or the worker's death) comes back; a pinned slot is never chosen for a write.
- LRU: the unpinned held slots, least recently used first. A batch releases its slots in reverse
  (a chain's last block first), so a chain's last block is evicted before its parents: a prefix
  stays reachable as long as possible.
- free slots are used before anything is evicted.
- rowless: held slots whose block keeps its K/V and token ids but not its hidden rows (written
  by requests that asked for nothing over the prompt's positions: their workers ran the last
  layer on each prompt's last row alone, `paddle.last_rows`). A request asking for prompt
  log-probabilities, prompt top-k or mean pooling reads only up to the first of them
  (`count`/`match` with `rows`) and computes the rest.

`clear()` forgets everything (the worker died or restarted: nothing is ever read from it
again); the `epoch` it bumps makes late releases of pins taken before it harmless.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from itertools import islice
from typing import Protocol

__all__ = ["BlockIndex", "CacheObserver"]

_run: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend  # consumes, in C


class CacheObserver(Protocol):
    """Told what a worker's cache holds as the engine decides it (vLLM-style KV events).

    `stored` lists consecutive blocks of one prompt, parents first (`parent_hash`: the block
    before the first, None at the prompt's start; `token_ids`: all their ids, in order);
    `removed`: blocks evicted (`in_store` False: lost by a failed forward, never written);
    `cleared`: the worker lost everything (death, restart); `put_past_cache`: blocks a worker
    computes past its slots (a chunk's tail, engine with a KV store), put and never cached.
    """

    def stored(
        self, worker: int, hashes: list[int], parent_hash: int | None, token_ids: list[int]
    ) -> None: ...

    def removed(self, worker: int, hashes: list[int], *, in_store: bool = True) -> None: ...

    def cleared(self, worker: int) -> None: ...

    def put_past_cache(
        self, worker: int, hashes: list[int], parent_hash: int | None, token_ids: list[int]
    ) -> None: ...


class BlockIndex:
    """One worker group's cached blocks: `num_blocks` slots of `block_bytes` bytes each."""

    __slots__ = (
        "block_bytes",
        "epoch",
        "evicted",
        "free",
        "hash_of",
        "lru",
        "num_blocks",
        "pins",
        "rowless",
        "slot_of",
        "stored",
    )

    def __init__(self, num_blocks: int = 0, block_bytes: int = 0) -> None:
        self.epoch = 0
        self.stored = 0  # blocks ever written (every life of the group): its share of the work
        self.reset(num_blocks, block_bytes)

    def reset(self, num_blocks: int, block_bytes: int) -> None:
        """Forget every block (the worker's slots hold nothing the engine may read)."""
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.epoch += 1
        self.slot_of: dict[int, int] = {}  # block hash -> slot
        self.hash_of: dict[int, int] = {}  # slot -> the block it was last given
        self.pins: dict[int, int] = {}  # pinned slot -> pins (absent: unpinned)
        self.lru: OrderedDict[int, None] = OrderedDict()  # unpinned held slots, oldest first
        self.free = list(range(num_blocks - 1, -1, -1))  # pop() gives slot 0 first
        self.rowless: set[int] = set()  # slots whose block has no hidden rows (`put`)
        self.evicted: list[int] = []  # hashes evicted since the caller last took them

    def __len__(self) -> int:
        """Blocks held."""
        return len(self.slot_of)

    def count(self, hashes: list[int], limit: int, *, rows: bool = False) -> int:
        """How many of the first `limit` hashes are held, from the first on (`rows`: with
        their hidden rows)."""
        return len(self.match(hashes, limit, rows=rows))

    def match(self, hashes: list[int], limit: int, *, rows: bool = False) -> list[int]:
        """The slots of the longest held chain among the first `limit` hashes (`rows`: up to
        the first rowless one)."""
        slots = []
        get, rowless = self.slot_of.get, self.rowless if rows else ()
        for i in range(min(limit, len(hashes))):
            slot = get(hashes[i])
            if slot is None or slot in rowless:
                break
            slots.append(slot)
        return slots

    def pin(self, slot: int) -> None:
        count = self.pins.get(slot)
        if count is None:
            self.lru.pop(slot, None)
            self.pins[slot] = 1
        else:
            self.pins[slot] = count + 1

    def unpin(self, slot: int) -> None:
        """Drop one pin; an unpinned held slot becomes the most recently used."""
        count = self.pins[slot] - 1
        if count:
            self.pins[slot] = count
            return
        del self.pins[slot]
        if self.slot_of.get(self.hash_of[slot]) == slot:
            self.lru[slot] = None
        else:
            self.free.append(slot)

    def take(self, count: int) -> list[int]:
        """Up to `count` slots to write into: free ones first, then the least recently used
        (their blocks forgotten, their hashes queued in `evicted`); fewer when the rest are
        pinned."""
        free = self.free
        if len(free) >= count:
            got = free[len(free) - count :]
            del free[len(free) - count :]
            got.reverse()
            return got
        got = free[::-1]
        free.clear()
        lru, slot_of = self.lru, self.slot_of
        victims = list(islice(lru, count - len(got)))  # the least recently used first
        blocks = list(map(self.hash_of.__getitem__, victims))
        _run(map(lru.__delitem__, victims))  # (loops in C: ~1 per block written)
        _run(map(slot_of.__delitem__, blocks))
        self.evicted.extend(blocks)
        got.extend(victims)
        return got

    def put(self, blocks: list[int], slots: list[int], *, rowless: bool = False) -> None:
        """`slots` (from `take`) now hold `blocks`, each pinned once by the batch writing it;
        `rowless`: without their hidden rows."""
        if rowless:
            self.rowless.update(slots)
        else:
            self.rowless.difference_update(slots)
        self.stored += len(blocks)
        self.slot_of.update(zip(blocks, slots, strict=True))
        self.hash_of.update(zip(slots, blocks, strict=True))
        self.pins.update(dict.fromkeys(slots, 1))

    def discard(self, slot: int) -> bool:
        """Forget the block `slot` holds (its batch failed: it may never have been written).
        A pinned slot (a batch sent since reads it, and the worker refuses that read) goes
        free when its last pin is released. False if the slot held no block."""
        block = self.hash_of.get(slot)
        if block is None or self.slot_of.get(block) != slot:
            return False
        del self.slot_of[block]
        if slot not in self.pins:
            del self.lru[slot]
            self.free.append(slot)
        return True

    def forget(self, slot: int) -> None:
        """Undo `put` for a batch that was never sent (its one pin included)."""
        del self.slot_of[self.hash_of[slot]]
        del self.pins[slot]
        self.free.append(slot)

    def check(self) -> None:
        """Recount: every slot is exactly one of free, pinned, or in the LRU (AssertionError)."""
        held = set(self.slot_of.values())
        pinned = set(self.pins)
        free, lru = set(self.free), set(self.lru)
        problems = []
        if len(held) != len(self.slot_of):
            problems.append("two blocks in one slot")
        if any(self.hash_of[s] != h for h, s in self.slot_of.items()):
            problems.append("hash_of disagrees with slot_of")
        if min(self.pins.values(), default=1) < 1:
            problems.append("a pin count below 1")
        if lru & pinned or free & pinned or free & lru or len(free) != len(self.free):
            problems.append("a slot in two of free / pinned / LRU")
        # (a pinned slot may hold no block: a failed batch's write that a later batch reads)
        if lru != held - pinned or free != set(range(self.num_blocks)) - held - pinned:
            problems.append(
                f"slots unaccounted: {self.num_blocks} slots, {len(free)} free, "
                f"{len(pinned)} pinned, {len(lru)} in the LRU, {len(held)} held"
            )
        if problems:
            raise AssertionError(f"prefix index broken: {'; '.join(problems)}")
