"""`KVEventPublisher`: a node's prefix-cache events for vllm-router's `--policy kv_aware`.

The engine's block index calls `stored` / `removed` / `cleared` as it decides (on the loop,
at dispatch time: the index is exact the moment a batch is sent). Those calls only append to
a list; the first one of a loop turn schedules one `flush` (`call_soon`), which encodes the
turn's events as one batch (at most `MAX_EVENTS`: the router refuses a batch of more than
4096), keeps it in the replay ring and hands it to the `Relay` thread over an inproc pipe
(`NOBLOCK`). So the loop pays one encode and one memory-pipe send per turn, not per block,
and never touches a TCP socket (cost: docs/kv-events.md).

When a subscriber joins (a router starts, restarts or reconnects), the relay asks the loop to
publish a snapshot: `AllBlocksCleared`, then every block the node holds, parents first. A
router that restarted knows the node's cache at once instead of only the blocks stored after.

Addresses: events are published on `endpoint` (`tcp://HOST:PORT`, bound); replays are served
on `replay_endpoint`, which defaults to the same host with the next port (PORT + 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from aioprefill.errors import InvalidConfig
from aioprefill.kv_events.node import NodeBlocks
from aioprefill.kv_events.relay import STOP, BatchRing, Relay
from aioprefill.kv_events.wire import AllBlocksCleared, Event, EventBatch, encode_batch, seq_bytes
from aioprefill.optional import import_optional

__all__ = [
    "MAX_EVENTS",
    "KVEventPublisher",
    "NoKVEvents",
    "default_replay_endpoint",
    "kv_events_for",
]

MAX_EVENTS = 1024  # per batch; vllm-router 0.1.17 drops a batch of more than 4096


def default_replay_endpoint(endpoint: str) -> str:
    """`tcp://HOST:PORT` -> `tcp://HOST:PORT+1`."""
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + 1}"


class NoKVEvents:
    """What an engine without `kv_events_endpoint` starts and closes: nothing."""

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass


def kv_events_for(config: Any, cache: Any) -> KVEventPublisher | NoKVEvents:
    """The engine's publisher for `EngineConfig.kv_events_endpoint`, made the observer of its
    prefix cache (`NoKVEvents` without an endpoint or a cache). Bound by `start()`."""
    if config.kv_events_endpoint is None or cache is None:
        return NoKVEvents()
    pub = KVEventPublisher(
        config.kv_events_endpoint,
        replay_endpoint=config.kv_events_replay_endpoint,
        block_tokens=config.prefix_block_tokens,
        store_capacity=_store_capacity(config, cache),
    )
    cache.observer = pub
    return pub


def _store_capacity(config: Any, cache: Any) -> Callable[[], int] | None:
    """With a KV store: the blocks this node's segments hold (segment bytes over cache bytes
    per worker, times the node's cache slots, known once its workers started)."""
    if config.kv_store is None:
        return None
    ratio = config.kv_store_options.segment_bytes / config.prefix_cache_bytes

    def capacity() -> int:
        return int(ratio * sum(index.num_blocks for index in cache.indexes))

    return capacity


class KVEventPublisher:
    """Publishes one node's blocks (the union of its workers', as `data_parallel_rank` 0).

    Use on one event loop: `start()` binds (and, inside a running loop, batches each turn's
    events), `close()` unbinds. Outside a loop every call sends at once (tools, tests) and a
    joining subscriber gets no snapshot.
    """

    _out: Any = None  # class-level defaults: close() is safe after a failed start()
    _relay: Relay | None = None

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        block_tokens: int = 16,
        ring_batches: int = 4096,
        medium: str = "GPU",
        store_capacity: Callable[[], int] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint or default_replay_endpoint(endpoint)
        self.blocks = NodeBlocks(block_tokens, medium, store_capacity)
        self._ring = BatchRing(ring_batches)
        self._pending: list[Event] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False
        self.seq = 0  # the next batch's sequence number
        self.num_events = 0
        self.num_dropped = 0  # batches the relay's inbox refused (the ring still has them)
        self.num_snapshots = 0

    @property
    def num_replays(self) -> int:
        return self._relay.num_replays if self._relay else 0

    @property
    def num_subscribers(self) -> int:
        return self._relay.num_subscribers if self._relay else 0

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Bind both sockets, start the relay and announce an empty node (`AllBlocksCleared`)
        so a router that knew this endpoint's previous life forgets it."""
        zmq = import_optional("zmq", "events")
        self._zmq = zmq
        ctx = self._ctx = zmq.Context()
        made: list[Any] = []

        def socket(kind: int) -> Any:
            made.append(s := ctx.socket(kind))
            s.setsockopt(zmq.LINGER, 0)
            return s

        wake = f"inproc://kv-events-{id(self)}"
        try:
            xpub = socket(zmq.XPUB)
            xpub.setsockopt(zmq.SNDHWM, 100_000)
            xpub.setsockopt(zmq.XPUB_VERBOSE, 1)
            xpub.bind(self.endpoint)
            replay = socket(zmq.ROUTER)
            replay.bind(self.replay_endpoint)
            inbox = socket(zmq.PAIR)
            inbox.setsockopt(zmq.RCVHWM, 100_000)
            inbox.bind(wake)
            out = socket(zmq.PAIR)
            out.setsockopt(zmq.SNDHWM, 100_000)
            out.connect(wake)
        except zmq.ZMQError as exc:
            for s in made:
                s.close()
            ctx.term()
            raise InvalidConfig(
                f"EngineConfig.kv_events_endpoint: cannot bind {self.endpoint} (replay "
                f"{self.replay_endpoint}): {exc}"
            ) from exc
        self._out = out
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._relay = Relay(zmq, xpub, replay, inbox, self._ring, self._on_subscriber)
        self._relay.start()
        self._add([AllBlocksCleared()])

    def close(self) -> None:
        """Send what is pending and a last `AllBlocksCleared` (the workers are gone), stop the
        relay thread (it gives the last batches up to 100 ms to leave), close every socket."""
        if self._out is None:
            return
        self._pending.append(AllBlocksCleared())
        self.flush()
        self._out.send(STOP)
        if self._relay is not None:
            self._relay.join()
        self._out.close()
        self._out = None
        self._ctx.term()

    # ---- the block index's observer ------------------------------------------------------

    def stored(
        self, worker: int, hashes: Sequence[int], parent_hash: int | None, token_ids: Sequence[int]
    ) -> None:
        """`worker` holds the chain `hashes` (its first block's parent: `parent_hash`). The
        publisher keeps `token_ids` (a snapshot reads it later): pass a list nobody mutates."""
        self._add(self.blocks.stored(worker, hashes, parent_hash, token_ids))

    def removed(self, worker: int, hashes: Sequence[int], *, in_store: bool = True) -> None:
        """`worker` evicted `hashes` (`in_store`: False when it never wrote them)."""
        self._add(self.blocks.removed(worker, hashes, in_store=in_store))

    def cleared(self, worker: int) -> None:
        """`worker` restarted or died: its blocks are gone."""
        self._add(self.blocks.cleared(worker))

    def put_past_cache(
        self, worker: int, hashes: Sequence[int], parent_hash: int | None, token_ids: Sequence[int]
    ) -> None:
        """`worker` computes these blocks past its slots and puts them: store-backed only."""
        self._add(self.blocks.backed(hashes, parent_hash, token_ids))

    def snapshot(self) -> None:
        """Publish `AllBlocksCleared` and then every block the node holds, parents first."""
        self.num_snapshots += 1
        self._add([AllBlocksCleared(), *self.blocks.snapshot()])

    # ---- sending -------------------------------------------------------------------------

    def _add(self, events: list[Event]) -> None:
        if not events or self._out is None:
            return
        self._pending.extend(events)
        if self._loop is None:
            self.flush()
        elif not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Send the pending events, `MAX_EVENTS` a batch (never blocks)."""
        self._scheduled = False
        pending, self._pending = self._pending, []
        if self._out is None:
            return
        now = time.time()
        for i in range(0, len(pending), MAX_EVENTS):
            events = pending[i : i + MAX_EVENTS]
            payload = encode_batch(EventBatch(now, events, 0))
            seq = self.seq
            self.seq += 1
            self.num_events += len(events)
            self._ring.append(seq, payload)
            try:
                self._out.send_multipart([seq_bytes(seq), payload], self._zmq.NOBLOCK)
            except self._zmq.Again:
                self.num_dropped += 1

    def _on_subscriber(self) -> None:
        """The relay thread saw a subscriber join: snapshot on the loop (thread-safe)."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody to publish for
                self._loop.call_soon_threadsafe(self.snapshot)
