"""`KVEventPublisher`: a node's prefix-cache events on a ZMQ PUB socket for vllm-router's
`--policy kv_aware`, with a replay ROUTER socket for a subscriber that missed some.

The engine's block index calls `stored` / `removed` / `cleared` as it decides (on the loop,
at dispatch time: the index is exact the moment a batch is sent). Those calls only append to
a list; the first one of a loop turn schedules one `flush` (`call_soon`), which encodes every
event of the turn as one batch and sends it without blocking (`NOBLOCK`: a PUB socket drops
for a slow subscriber rather than wait, and a dropped batch is what the replay is for). So
the loop pays one encode and one send per turn, not per block (cost measured in
docs/kv-events.md).

Replay: a thread owns the ROUTER socket and sleeps in `zmq.Poller.poll` until a request or
the close signal (an inproc PAIR) arrives. It answers from a bounded ring of the last
`ring_batches` payloads, shared with the loop under a lock held only to append or copy.

Addresses: events are published on `endpoint` (`tcp://HOST:PORT`, bound); replay is served on
`replay_endpoint`, which defaults to the same host with the next port (PORT + 1).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from aioprefill.errors import InvalidConfig
from aioprefill.kv_events.node import NodeBlocks
from aioprefill.kv_events.wire import (
    END_SEQ,
    TOPIC,
    AllBlocksCleared,
    Event,
    EventBatch,
    encode_batch,
    seq_bytes,
)
from aioprefill.optional import import_optional

__all__ = ["KVEventPublisher", "default_replay_endpoint"]


def default_replay_endpoint(endpoint: str) -> str:
    """`tcp://HOST:PORT` -> `tcp://HOST:PORT+1`."""
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + 1}"


class KVEventPublisher:
    """Publishes one node's blocks (the union of its workers', as `data_parallel_rank` 0).

    Use on one event loop: `start()` binds (and, inside a running loop, batches each turn's
    events), `close()` unbinds. Outside a loop every call sends at once (tools, tests).
    """

    _pub: Any = None  # class-level defaults: close() is safe after a failed start()
    _ctrl: Any = None
    _thread: threading.Thread | None = None

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        block_tokens: int = 16,
        ring_batches: int = 4096,
        medium: str = "GPU",
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint or default_replay_endpoint(endpoint)
        self.blocks = NodeBlocks(block_tokens, medium)
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=ring_batches)
        self._lock = threading.Lock()
        self._pending: list[Event] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False
        self.seq = 0  # the next batch's sequence number
        self.num_events = 0
        self.num_dropped = 0  # batches the PUB socket refused (none expected: it drops itself)
        self.num_replays = 0

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Bind both sockets and announce an empty node (`AllBlocksCleared`), so a router
        that knew this endpoint's previous life forgets it."""
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
            pub = socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, 100_000)
            pub.bind(self.endpoint)
            replay = socket(zmq.ROUTER)
            replay.bind(self.replay_endpoint)
            inbox = socket(zmq.PAIR)
            inbox.bind(wake)
            ctrl = socket(zmq.PAIR)
            ctrl.connect(wake)
        except zmq.ZMQError as exc:
            for s in made:
                s.close()
            ctx.term()
            raise InvalidConfig(
                f"EngineConfig.kv_events_endpoint: cannot bind {self.endpoint} (replay "
                f"{self.replay_endpoint}): {exc}"
            ) from exc
        self._pub, self._ctrl = pub, ctrl
        self._thread = threading.Thread(
            target=self._serve_replay, args=(replay, inbox), name="kv-events-replay", daemon=True
        )
        self._thread.start()
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._add([AllBlocksCleared()])

    def close(self) -> None:
        """Flush what is pending, stop the replay thread, close every socket."""
        if self._pub is not None and self._pending:
            self.flush()
        if self._ctrl is not None:
            self._ctrl.send(b"")
            if self._thread is not None:
                self._thread.join()
            self._ctrl.close()
            self._ctrl = None
        if self._pub is not None:
            self._pub.close()
            self._pub = None
            self._ctx.term()

    # ---- the block index's observer ------------------------------------------------------

    def stored(
        self, worker: int, hashes: Sequence[int], parent_hash: int | None, token_ids: Sequence[int]
    ) -> None:
        """`worker` holds the chain `hashes` (its first block's parent: `parent_hash`)."""
        self._add(self.blocks.stored(worker, hashes, parent_hash, token_ids))

    def removed(self, worker: int, hashes: Sequence[int]) -> None:
        """`worker` evicted `hashes`."""
        self._add(self.blocks.removed(worker, hashes))

    def cleared(self, worker: int) -> None:
        """`worker` restarted or died: its blocks are gone."""
        self._add(self.blocks.cleared(worker))

    # ---- sending -------------------------------------------------------------------------

    def _add(self, events: list[Event]) -> None:
        if not events or self._pub is None:
            return
        self._pending.extend(events)
        if self._loop is None:
            self.flush()
        elif not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Send the pending events as one batch (never blocks)."""
        self._scheduled = False
        if not self._pending or self._pub is None:
            return
        events, self._pending = self._pending, []
        payload = encode_batch(EventBatch(time.time(), events, 0))
        seq = self.seq
        self.seq += 1
        self.num_events += len(events)
        with self._lock:
            self._ring.append((seq, payload))
        try:
            self._pub.send_multipart([TOPIC, seq_bytes(seq), payload], self._zmq.NOBLOCK)
        except self._zmq.Again:
            self.num_dropped += 1

    # ---- replay (its own thread) ---------------------------------------------------------

    def _serve_replay(self, replay: Any, inbox: Any) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(replay, zmq.POLLIN)
        poller.register(inbox, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if inbox in ready:
                    return
                while True:
                    try:
                        frames = replay.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._answer(replay, frames)
        finally:
            replay.close()
            inbox.close()

    def _answer(self, replay: Any, frames: list[bytes]) -> None:
        """`[identity, b"", start_seq]`: every kept batch from `start_seq` on, then -1."""
        identity = frames[0]
        start = int.from_bytes(frames[-1], "big", signed=True) if len(frames) >= 2 else 0
        with self._lock:
            kept = [item for item in self._ring if item[0] >= start]
        self.num_replays += 1
        send = replay.send_multipart
        for seq, payload in kept:
            send([identity, b"", TOPIC, seq_bytes(seq), payload])
        send([identity, b"", TOPIC, seq_bytes(END_SEQ), b""])
