"""`StoreDirectory`: the blocks the cluster's store is believed to hold, learnt from every
node's KV events (`KVStoreOptions.peer_events`), so that a worker asks the store only for the
chains somebody announced.

Why: a load call that finds nothing still pays the master's RPC (1-3 ms median on the busy
2-vCPU VM, docs/kv-store.md), and a worker's own history never predicts a miss: in the diag
logs every call that found nothing asked for chain heads nobody had put yet, and most calls
that found blocks had heads the asking worker had never seen. Only the cluster knows, and it
already says so: every node publishes the blocks its workers store (computed or loaded, all
of them put to the store), those its caches evicted (still in the store) and those it computed
past its slots and put without caching them ("CPU"), in vLLM's format (docs/kv-events.md).

A hint, never trusted for an answer: a listed block the store lost (its LRU, a put dropped
for the budget, a master restart) makes a load find less, and the worker computes the rest;
a block not yet announced (its event in flight, a frame the PUB dropped) is computed. Removals
are not applied (a node withdraws a block from its caches, not from the store; its "CPU"
withdrawals are its own share estimate): the directory keeps the `capacity` most recently
announced hashes, about what the pool holds.

One thread ("kvstore-directory") subscribes to every endpoint on one SUB socket and applies
each batch; the forward's thread only reads (`known_prefix`: dict lookups, atomic in CPython).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import msgspec

from aioprefill.optional import import_optional

__all__ = ["StoreDirectory"]

log = logging.getLogger("aioprefill.kvstore")


class _Stored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[int]  # (its other fields, token ids included, are skipped unread)


class _Removed(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    pass


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_Stored | _Removed | _Cleared]


_decode = msgspec.msgpack.Decoder(_Batch).decode
_STOP = b"stop"
# Hashes as the events carry them: unsigned 64-bit (`kv_events.wire.MASK64`; that package sits
# above this one, and this reads the wire format with its own structs above anyway).
MASK64 = (1 << 64) - 1


class StoreDirectory:
    """Hashes announced by the endpoints, the most recent `capacity` of them."""

    def __init__(self, endpoints: Sequence[str], capacity: int) -> None:
        self.endpoints = tuple(endpoints)
        self.capacity = max(1, capacity)
        self._held: OrderedDict[int, None] = OrderedDict()
        self.num_batches = 0
        self.num_refused = 0  # frames that were not a KV event batch
        self.failed = False  # the thread died: the worker asks the store without the hint
        self._thread: threading.Thread | None = None
        self._stop: Any = None

    def __len__(self) -> int:
        return len(self._held)

    def known_prefix(self, hashes: Sequence[int]) -> int:
        """How many of `hashes`' first blocks some node announced."""
        held = self._held
        n = 0
        while n < len(hashes) and (hashes[n] & MASK64) in held:
            n += 1
        return n

    def add(self, hashes: Sequence[int]) -> None:
        """`hashes` were announced (the directory's thread; tests)."""
        held = self._held
        for raw in hashes:
            h = raw & MASK64
            if h in held:
                held.move_to_end(h)
            else:
                held[h] = None
        while len(held) > self.capacity:
            held.popitem(last=False)

    def apply(self, payload: bytes) -> bool:
        """One event batch's payload frame; False (and nothing applied) when it is not one."""
        try:
            batch = _decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.num_refused += 1
            return False
        self.num_batches += 1
        for event in batch.events:
            if isinstance(event, _Stored):
                self.add(event.block_hashes)
        return True

    # ---- the subscriber thread ------------------------------------------------------------

    def start(self) -> None:
        """Subscribe to every endpoint (connections are made in the background: a node not up
        yet is reached when it is) and apply what they publish until `close`."""
        zmq = import_optional("zmq", "events")
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        for endpoint in self.endpoints:
            sub.connect(endpoint)
        wake = f"inproc://kvstore-directory-{id(self)}"
        stop_in = ctx.socket(zmq.PAIR)
        stop_in.bind(wake)
        self._stop = ctx.socket(zmq.PAIR)
        self._stop.setsockopt(zmq.LINGER, 0)
        self._stop.connect(wake)
        self._thread = threading.Thread(
            target=self._run, args=(zmq, sub, stop_in), name="kvstore-directory", daemon=True
        )
        self._thread.start()

    def _run(self, zmq: Any, sub: Any, stop_in: Any) -> None:
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(stop_in, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if stop_in in ready:
                    return
                while True:  # everything queued, then back to sleep in poll
                    try:
                        frames = sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(frames) == 3:
                        self.apply(frames[2])
                    else:
                        self.num_refused += 1
        except Exception:  # never the worker's failure: it asks the store without a hint
            self.failed = True
            log.exception("KV store directory stopped; loads go back to the cost rule alone")
        finally:
            sub.close()
            stop_in.close()

    def close(self) -> None:
        if self._thread is None:
            return
        zmq = import_optional("zmq", "events")
        with contextlib.suppress(zmq.ZMQError):  # (a thread that died has no reader left)
            self._stop.send(_STOP, zmq.NOBLOCK)
        self._thread.join(timeout=2.0)
        self._stop.close()
        self._thread = None
