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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from aioprefill.kv_events.wire import MASK64, AllBlocksCleared, BlockRemoved, BlockStored, Event

__all__ = ["NodeBlocks"]


class NodeBlocks:
    """Per-worker block sets and their union's reference counts; each method returns the
    events that keep a subscriber's view of the union exact."""

    def __init__(self, block_tokens: int, medium: str = "GPU") -> None:
        self.block_tokens = block_tokens
        self.medium = medium
        self._held: dict[int, set[int]] = {}  # worker -> hashes it holds
        self._count: dict[int, int] = {}  # hash -> workers holding it
        # hash -> (parent, the token ids it came with, its index there): no copy per block
        self._meta: dict[int, tuple[int | None, Sequence[int], int]] = {}

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

    def removed(self, worker: int, hashes: Iterable[int]) -> list[Event]:
        """`worker` dropped `hashes`; those no other worker holds leave the node."""
        held = self._held.get(worker)
        if not held:
            return []
        gone = [h for h in (raw & MASK64 for raw in hashes) if h in held and self._drop(held, h)]
        return [BlockRemoved(gone, self.medium)] if gone else []

    def cleared(self, worker: int) -> list[Event]:
        """`worker` restarted (or died): its blocks are gone."""
        held = self._held.pop(worker, set())
        gone = [h for h in list(held) if self._drop(held, h)]
        if not self._count:
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
        event per unbranched stretch of a chain. A block whose parent the node no longer
        holds keeps that parent (a subscriber skips it, as it would have)."""
        children: dict[int | None, list[int]] = {}
        roots: list[int] = []
        meta = self._meta
        b = self.block_tokens
        for h, (parent, _, _) in meta.items():
            if parent is None or parent not in meta:
                roots.append(h)
            else:
                children.setdefault(parent, []).append(h)
        events: list[Event] = []
        stack = roots
        while stack:
            h = stack.pop()
            run = [h]
            while len(kids := children.get(run[-1], [])) == 1:
                run.append(kids[0])
            stack.extend(kids)
            tokens: list[int] = []
            for k in run:
                _, ids, i = meta[k]
                tokens.extend(_as_list(ids[i * b : (i + 1) * b]))
            events.append(BlockStored(run, meta[h][0], tokens, b, medium=self.medium))
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
