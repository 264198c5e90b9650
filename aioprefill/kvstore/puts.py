"""`PutQueue`: blocks a worker wrote, put into the store off the forward's path.

Budget and back-pressure: `offer` (the forward's thread, after the forward) copies the block
into a free staging slot of the registered put buffer (`KVStoreOptions.put_buffer_bytes`
split into value-sized slots) and returns at once. No free slot (the put thread is behind),
the link down, or the block put recently: the block is not put (counted), and the forward
never waits. The copy is what makes this safe: the engine may give the cache slot to another
block in the very next batch, and the put thread must not read a slot being rewritten.

`defer` is the cheaper form the worker uses after each forward: it only lists the blocks (their
cache slots and views of them), and the put thread does the copies while the worker goes on.
Before the worker writes any cache slot again (its next batch's loads and forward), `settle`
with that batch's write slots copies, on the worker's thread, the listed blocks in those slots
the put thread has not reached yet, and waits for one it is copying: no slot is rewritten
while, or before, its block is copied, and the checksum (computed by the put thread after the
copy) covers exactly what the forward wrote.

One thread ("kvstore-put") first connects the link (`StoreLink.connect`, which may block for
a long time), then seals (checksums) and puts whatever is staged, a batch at a time, with
`batch_put_from` straight from the registered buffer; while the link is down it waits the
backoff on its condition and tries to reconnect.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from aioprefill.kvstore.backend import NO_SPACE
from aioprefill.kvstore.diag import DIAG
from aioprefill.kvstore.identity import StoreIdentity
from aioprefill.kvstore.link import StoreLink, log
from aioprefill.kvstore.stats import StoreStats
from aioprefill.kvstore.value import ValueCodec

__all__ = ["PutQueue", "staging_slots", "staging_stride"]

_RECENT = 1 << 16  # hashes remembered as put: a block recomputed after a local eviction
# is not put again
_BATCH = 64  # values per batch_put_from


def staging_stride(value_bytes: int) -> int:
    """Bytes from one staging slot to the next: `value_bytes` rounded up to 64."""
    return -(-value_bytes // 64) * 64


def staging_slots(buffer: np.ndarray, value_bytes: int) -> list[memoryview]:
    """`buffer` cut into 64-byte-aligned slots of `value_bytes` each."""
    stride = staging_stride(value_bytes)
    view = memoryview(buffer.data).cast("B")
    return [view[i * stride : i * stride + value_bytes] for i in range(len(view) // stride)]


class PutQueue:
    """Staging slots, the blocks waiting in them, and the thread that puts them."""

    def __init__(
        self,
        link: StoreLink,
        identity: StoreIdentity,
        codec: ValueCodec,
        buffer: np.ndarray,
        stats: StoreStats,
    ) -> None:
        self.link = link
        self.identity = identity
        self.codec = codec
        self.stats = stats
        self.buffer = buffer
        self.slots = staging_slots(buffer, codec.value_bytes)
        self.free: deque[int] = deque(range(len(self.slots)))
        self.pending: deque[tuple[int, int]] = deque()  # (block hash, slot)
        # cache slot -> (block hash, tokens, parts): listed by `defer`, not yet copied
        self.deferred: OrderedDict[int, tuple[int, np.ndarray, Sequence[Any]]] = OrderedDict()
        self.copying = -1  # the cache slot the put thread is copying now (-1: none)
        self.recent: OrderedDict[int, None] = OrderedDict()
        self.cond = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="kvstore-put", daemon=True)
        link.on_down.append(self._wake)

    def _wake(self) -> None:
        with self.cond:
            self.cond.notify()

    def start(self) -> None:
        self.thread.start()

    def offer(self, block_hash: int, tokens: np.ndarray, parts: Sequence[Any]) -> bool:
        """Stage one block for a put (copied now); False (counted) when it is not put. Never
        blocks."""
        if not self.link.up.is_set():
            self.stats.puts_skipped_down += 1
            return False
        with self.cond:
            slot = self._take_slot(block_hash)
        return slot >= 0 and self._stage(slot, block_hash, tokens, parts)

    def defer(self, blocks: Sequence[tuple[int, int, np.ndarray, Sequence[Any]]]) -> None:
        """List `(cache slot, block hash, tokens, parts)` blocks for a put, the views read
        later by the put thread: the caller calls `settle` before it rewrites a cache slot."""
        if not self.link.up.is_set():
            self.stats.puts_skipped_down += len(blocks)
            return
        with self.cond:
            for cache_slot, block_hash, tokens, parts in blocks:
                self.deferred[cache_slot] = (block_hash, tokens, parts)
            self.cond.notify()

    def settle(self, cache_slots: Sequence[int]) -> None:
        """Before `cache_slots` are rewritten: copy their listed blocks now (this thread),
        and wait for the one the put thread may be copying."""
        mine = []
        with self.cond:
            if not self.deferred and self.copying < 0:
                return
            for cache_slot in cache_slots:
                item = self.deferred.pop(cache_slot, None)
                if item is not None:
                    mine.append(item)
            if self.copying >= 0:
                rewritten = set(cache_slots)
                self.cond.wait_for(lambda: self.copying not in rewritten)
        for block_hash, tokens, parts in mine:
            with self.cond:
                slot = self._take_slot(block_hash)
            if slot >= 0:
                self._stage(slot, block_hash, tokens, parts)

    def known_prefix(self, hashes: Sequence[int]) -> int:
        """How many of `hashes`' first blocks this worker put (or loaded) recently: the store
        very likely holds them (unless it evicted them since), no call needed to know."""
        with self.cond:
            n = 0
            while n < len(hashes) and hashes[n] in self.recent:
                n += 1
        return n

    def remember(self, hashes: Sequence[int]) -> None:
        """Blocks just loaded from the store: known to be there, and not to be put again."""
        if hashes:
            with self.cond:
                for block_hash in hashes:
                    self._note(block_hash)

    def _note(self, block_hash: int) -> None:
        self.recent[block_hash] = None
        self.recent.move_to_end(block_hash)
        if len(self.recent) > _RECENT:
            self.recent.popitem(last=False)

    def _take_slot(self, block_hash: int) -> int:
        """A free staging slot for `block_hash` (under `cond`), or -1 (counted) when the
        block was put recently or the budget is full."""
        s = self.stats
        if block_hash in self.recent:
            self.recent.move_to_end(block_hash)
            s.puts_skipped_recent += 1
            return -1
        if not self.free:
            s.puts_dropped_full += 1
            if DIAG is not None:
                DIAG.dropped(block_hash)
            return -1
        return self.free.popleft()

    def _stage(self, slot: int, block_hash: int, tokens: np.ndarray, parts: Sequence[Any]) -> bool:
        """Copy the block into staging `slot` and queue its put."""
        payload = self.codec.write_header(self.slots[slot], block_hash, tokens)
        at = 0
        for part in parts:  # arrays, contiguous or not (a slot's views): one copy each
            part = np.asarray(part)
            if at + part.nbytes <= len(payload):
                dst = np.frombuffer(payload, dtype=part.dtype, count=part.size, offset=at)
                dst.reshape(part.shape)[...] = part
            at += part.nbytes
        if at != len(payload):
            with self.cond:
                self.free.append(slot)
            raise ValueError(f"block parts hold {at} bytes, a block payload is {len(payload)}")
        with self.cond:
            self._note(block_hash)
            self.pending.append((block_hash, slot))
            self.cond.notify()
        return True

    def close(self, timeout: float) -> bool:
        """Stop the thread; True when it ended (then no thread is inside a store call)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout)
        return not self.thread.is_alive()

    def _run(self) -> None:
        link = self.link
        while True:
            if not link.up.is_set():
                if link.connect():
                    with self.cond:  # a master that restarted holds nothing we put before
                        self.recent.clear()
                    continue
                with self.cond:
                    self._drop_pending()
                    if self.cond.wait_for(lambda: self.closed, link.next_retry_s()):
                        return
                continue
            with self.cond:
                self.cond.wait_for(
                    lambda: self.pending or self.deferred or self.closed or not link.up.is_set()
                )
                if self.closed:
                    return
                if not link.up.is_set():
                    continue
                if self.deferred and len(self.pending) < _BATCH:
                    self._copy_deferred()
                    continue
                batch = [self.pending.popleft() for _ in range(min(_BATCH, len(self.pending)))]
            self._put(batch)

    def _copy_deferred(self) -> None:
        """(Under `cond`.) Copy listed blocks into staging, one at a time, each with the
        lock released (`copying` says which cache slot is being read), until a batch is full
        or none is left."""
        while self.deferred and len(self.pending) < _BATCH and not self.closed:
            cache_slot, (block_hash, tokens, parts) = self.deferred.popitem(last=False)
            slot = self._take_slot(block_hash)
            if slot < 0:
                continue
            self.copying = cache_slot
            self.cond.release()
            try:
                self._stage(slot, block_hash, tokens, parts)
            except Exception:
                log.exception("copying a block for the Mooncake Store failed")
            finally:
                self.cond.acquire()
                self.copying = -1
                self.cond.notify_all()

    def _drop_pending(self) -> None:
        while self.pending:
            self.free.append(self.pending.popleft()[1])
            self.stats.puts_skipped_down += 1
        self.stats.puts_skipped_down += len(self.deferred)
        self.deferred.clear()

    def _put(self, batch: list[tuple[int, int]]) -> None:
        size = self.codec.value_bytes
        base = self.buffer.ctypes.data
        stride = staging_stride(size)
        for _, slot in batch:
            self.codec.seal(self.slots[slot])
        keys = [self.identity.key(h) for h, _ in batch]
        codes = self.link.store.batch_put_from(
            keys, [base + slot * stride for _, slot in batch], [size] * len(batch)
        )
        s = self.stats
        unput = []
        if DIAG is not None:
            DIAG.put([h for (h, _), code in zip(batch, codes, strict=True) if code == 0])
        for (block_hash, _), code in zip(batch, codes, strict=True):
            if code == 0:
                s.puts += 1
                s.put_bytes += size
                continue
            unput.append(block_hash)  # may be offered again
            if code == NO_SPACE:
                s.puts_no_space += 1
            else:
                s.puts_failed += 1
                self.link.failed(code, "batch_put_from")
        with self.cond:
            self.free.extend(slot for _, slot in batch)
            for block_hash in unput:
                self.recent.pop(block_hash, None)
            self.cond.notify_all()  # whoever waits for the queue to drain (tests, close)
        if unput:
            log.debug("%d of %d puts refused (codes %s)", len(unput), len(batch), set(codes))
