"""`NodeBlocks`: a node's workers' prefix-cache blocks seen as one cache, the way vllm-router
routes to them.

vllm-router 0.1.17 in its regular mode routes to a node (its HTTP URL) and credits only
`data_parallel_rank` 0 of that node's event source: a batch tagged with another rank is kept
under a target the router never picks (measured: docs/kv-events.md). Its DP mode (one endpoint
per rank, `--intra-node-data-parallel-size`) picks the rank itself and tells the node with an
`X-data-parallel-rank` header, which the engine does not honour: it chooses the worker. So a
node publishes the union of its workers' blocks as rank 0. A block is announced when the first
worker stores it and withdrawn when the last one holding it drops it; a worker's restart
withdraws only the blocks no other worker holds (all of them, as `AllBlocksCleared`, when the
node is left with none). It keeps each block's parent and tokens too, so that a subscriber
that joins late can be sent the whole node (`snapshot`, parents first). Pure bookkeeping: it
returns events, the publisher sends them.

With a KV store behind the workers (`store_capacity`), a block the node held is also in the
store (its workers put every block they compute; a loaded block came from there), so the node
can load it back for a read's cost instead of computing it. When such a block leaves the
node's caches it is not gone for routing: `BlockRemoved` "GPU" is followed by `BlockStored`
"CPU" (the tier vllm-router credits at `--kv-penalty-host`, 0.8 by default), and the block
keeps that second residency when it is cached again (it is still in the store). The router
keeps one residency per tier (measured: docs/kv-events.md). How many store-backed blocks a node
claims is bounded by `store_capacity()` (the node's share of the pool in blocks: its
segments' bytes over a block's); past it the oldest are withdrawn (`BlockRemoved` "CPU").
That share is an estimate: a put dropped for the budget, the store's own LRU or a master's
restart are not reported back, and cost a routed request a miss, not a wrong answer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from aioprefill.kv_events.wire import MASK64, AllBlocksCleared, BlockRemoved, BlockStored, Event

__all__ = ["STORE_MEDIUM", "NodeBlocks"]

STORE_MEDIUM = "CPU"  # vllm-router's host tier: credited at --kv-penalty-host

# A block's metadata: (its parent, the token ids it came with, its index there).
_Meta = tuple[int | None, Sequence[int], int]


class NodeBlocks:
    """Per-worker block sets and their union's reference counts; each method returns the
    events that keep a subscriber's view of the union exact."""

    def __init__(
        self,
        block_tokens: int,
        medium: str = "GPU",
        store_capacity: Callable[[], int] | None = None,
    ) -> None:
        self.block_tokens = block_tokens
        self.medium = medium
        self.store_capacity = store_capacity  # None: no store behind the node
        self._held: dict[int, set[int]] = {}  # worker -> hashes it holds
        self._count: dict[int, int] = {}  # hash -> workers holding it
        self._meta: dict[int, _Meta] = {}  # hash -> its metadata: no copy per block
        self._backed: OrderedDict[int, _Meta] = OrderedDict()  # store-backed, oldest first

    @property
    def num_store_backed(self) -> int:
        """Blocks announced as store-backed (`STORE_MEDIUM`)."""
        return len(self._backed)

    def __len__(self) -> int:
        """Distinct blocks the node holds."""
        return len(self._count)

    def holds(self, block_hash: int) -> bool:
        return (block_hash & MASK64) in self._count

    def stored(
        self,
        worker: int,
        hashes: Sequence[int],
        parent_hash: int | None,
        token_ids: Sequence[int],
    ) -> list[Event]:
        """`worker` now holds the chain `hashes` (parent first), whose tokens are `token_ids`
        (`block_tokens` per block). Returns one `BlockStored` per run of blocks new to the
        node, each linked to the block before it."""
        held = self._held.setdefault(worker, set())
        b = self.block_tokens
        if len(token_ids) != b * len(hashes):
            raise ValueError(
                f"{len(hashes)} blocks of {b} tokens need {b * len(hashes)} token ids, "
                f"got {len(token_ids)}"
            )
        events: list[Event] = []
        run: list[int] = []
        run_start = 0
        prev = None if parent_hash is None else parent_hash & MASK64
        run_parent = prev
        for i, raw in enumerate(hashes):
            h = raw & MASK64
            if h not in held:
                held.add(h)
                n = self._count.get(h, 0)
                self._count[h] = n + 1
                if n == 0:  # new to the node
                    self._meta[h] = (prev, token_ids, i)
                    if h in self._backed:  # cached again: still in the store, recently used
                        self._backed.move_to_end(h)
                    if not run:
                        run_start, run_parent = i, prev
                    run.append(h)
                    prev = h
                    continue
            if run:  # already on the node: the run of new blocks before it ends here
                events.append(self._stored(run, run_parent, token_ids, run_start))
                run = []
            prev = h
        if run:
            events.append(self._stored(run, run_parent, token_ids, run_start))
        return events

    def removed(self, worker: int, hashes: Iterable[int], *, in_store: bool = True) -> list[Event]:
        """`worker` dropped `hashes`; those no other worker holds leave the node, and, with a
        store behind it, stay announced as store-backed (`in_store`: False for blocks a
        failed forward never wrote)."""
        held = self._held.get(worker)
        if not held:
            return []
        meta = self._meta
        gone: dict[int, _Meta] = {}
        for h in (raw & MASK64 for raw in hashes):
            if h in held:
                m = meta[h]
                if self._drop(held, h):
                    gone[h] = m
        if not gone:
            return []
        events: list[Event] = [BlockRemoved(list(gone), self.medium)]
        if self.store_capacity is not None and in_store:
            events += self._demoted(gone)
        return events

    def _demoted(self, gone: dict[int, _Meta]) -> list[Event]:
        """`gone` left the caches but not the store: announce those not yet store-backed,
        then withdraw the oldest past the store's capacity."""
        assert self.store_capacity is not None
        stored = self._backed
        new: dict[int, _Meta] = {}
        for h, m in gone.items():
            if h in stored:
                stored.move_to_end(h)
            else:
                stored[h] = new[h] = m
        events: list[Event] = list(self._chains(new, STORE_MEDIUM))
        over = len(stored) - max(0, self.store_capacity())
        if over > 0:
            old = [stored.popitem(last=False)[0] for _ in range(over)]
            events.append(BlockRemoved(old, STORE_MEDIUM))
        return events

    def backed(
        self, hashes: Sequence[int], parent_hash: int | None, token_ids: Sequence[int]
    ) -> list[Event]:
        """Blocks a worker computed past its cache slots (a chunk's tail) and put: in the store
        only. Announced store-backed like an evicted block (nothing without a store)."""
        if self.store_capacity is None:
            return []
        prev = None if parent_hash is None else parent_hash & MASK64
        gone: dict[int, _Meta] = {}
        for i, raw in enumerate(hashes):
            h = raw & MASK64
            if h not in self._count:  # (a block cached too is announced there already)
                gone[h] = (prev, token_ids, i)
            prev = h
        return self._demoted(gone) if gone else []

    def cleared(self, worker: int) -> list[Event]:
        """`worker` restarted (or died): its blocks are gone."""
        held = self._held.pop(worker, set())
        gone = [h for h in list(held) if self._drop(held, h)]
        if not self._count:  # (a restarted worker's segment left the store with it)
            self._backed.clear()
            return [AllBlocksCleared()]
        return [BlockRemoved(gone, self.medium)] if gone else []

    def _drop(self, held: set[int], h: int) -> bool:
        """Forget `h` on one worker; True when no worker holds it any more."""
        held.discard(h)
        n = self._count[h] - 1
        if n:
            self._count[h] = n
            return False
        del self._count[h]
        del self._meta[h]
        return True

    def snapshot(self) -> list[Event]:
        """Every block the node holds as `BlockStored` events, each after its parent: one
        event per unbranched stretch of a chain; then the store-backed ones. A block whose
        parent the node no longer holds keeps that parent (a subscriber skips it, as it
        would have)."""
        return [*self._chains(self._meta, self.medium), *self._chains(self._backed, STORE_MEDIUM)]

    def _chains(self, meta: dict[int, _Meta], medium: str) -> list[BlockStored]:
        """The blocks of `meta` as `BlockStored` events of `medium`, parents first."""
        children: dict[int | None, list[int]] = {}
        roots: list[int] = []
        b = self.block_tokens
        for h, (parent, _, _) in meta.items():
            if parent is None or parent not in meta:
                roots.append(h)
            else:
                children.setdefault(parent, []).append(h)
        events: list[BlockStored] = []
        seen: set[int] = set()
        # Chain hashes cannot form a cycle (a block's hash covers its parent's), but hashes
        # that came from outside might: what no root reaches starts a stretch of its own.
        for start in [*roots, *meta]:
            stack = [start]
            while stack:
                h = stack.pop()
                if h in seen:
                    continue
                seen.add(h)
                run = [h]
                while len(kids := children.get(run[-1], [])) == 1 and kids[0] not in seen:
                    run.append(kids[0])
                    seen.add(kids[0])
                stack.extend(kids)
                tokens: list[int] = []
                for k in run:
                    _, ids, i = meta[k]
                    tokens.extend(_as_list(ids[i * b : (i + 1) * b]))
                events.append(BlockStored(run, meta[h][0], tokens, b, medium=medium))
        return events

    def _stored(
        self, run: list[int], parent: int | None, token_ids: Sequence[int], start: int
    ) -> BlockStored:
        b = self.block_tokens
        whole = start == 0 and len(run) * b == len(token_ids)
        tokens = token_ids if whole else token_ids[start * b : (start + len(run)) * b]
        return BlockStored(run, parent, _as_list(tokens), b, medium=self.medium)


def _as_list(ids: Sequence[int]) -> list[int]:
    """Token ids as the list msgpack encodes (the engine passes a list: no copy)."""
    if isinstance(ids, list):
        return ids
    tolist = getattr(ids, "tolist", None)  # a NumPy array
    return tolist() if tolist is not None else list(ids)
