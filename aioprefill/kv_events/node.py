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
node is left with none). Pure bookkeeping: it returns events, the publisher sends them.
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
        return True

    def _stored(
        self, run: list[int], parent: int | None, token_ids: Sequence[int], start: int
    ) -> BlockStored:
        b = self.block_tokens
        tokens = token_ids[start * b : (start + len(run)) * b]
        ids = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
        return BlockStored(run, parent, ids, b, medium=self.medium)
