"""`Loader`: for each chain asked, the longest prefix the store holds, fetched into registered
staging memory, checked, and handed to the worker's block store, within a deadline.

The forward's thread calls `load` and waits (at most `load_timeout_s`) while the "kvstore-load"
thread runs one `batch_get_into` for every chain of the batch and checks each value in order
(`ValueCodec.check`); the chain stops at the first block missing (never put, or evicted
since: the store's LRU), failing a check, or not answered. Only then does `load` hand the
good prefixes to `sink(c, i, payload)`, which copies it into the cache slot: a value's bytes
reach a slot only after every check passed. Past the deadline the link is marked down, the
worker computes, and the staging buffer stays the late call's until it returns (loads are
skipped until then), so a late answer never lands in memory that is in use.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from aioprefill.kvstore.backend import store_is_down
from aioprefill.kvstore.identity import StoreIdentity
from aioprefill.kvstore.link import StoreLink, log
from aioprefill.kvstore.puts import staging_slots, staging_stride
from aioprefill.kvstore.stats import StoreStats
from aioprefill.kvstore.value import ValueCodec, ValueRefused

__all__ = ["Chain", "Loader"]

# One block to load: (its hash, its token ids, int32[block_tokens]).
Chain = Sequence[tuple[int, np.ndarray]]


class _Job:
    __slots__ = ("chains", "done", "good", "times")

    def __init__(self, chains: list[Chain]) -> None:
        self.chains = chains
        self.done = threading.Event()
        self.good: list[int] = [0] * len(chains)
        # perf_counter at: posted, taken by the thread, store call returned, checked, done
        self.times = [time.perf_counter(), 0.0, 0.0, 0.0, 0.0]


class Loader:
    """One load at a time, run by one thread, waited for by the forward's thread."""

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
        self.stride = staging_stride(codec.value_bytes)
        self.job: _Job | None = None  # posted, not yet taken by the thread
        self.busy = False  # the thread owns the staging buffer
        self.cond = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="kvstore-load", daemon=True)
        # The last load's parts, seconds (`AIOPREFILL_STORE_DIAG` logs them): the handoff to
        # the thread, the store call, the checks, the handoff back, the copies into slots.
        self.parts: list[float] = []

    @property
    def capacity(self) -> int:
        """The most blocks one load can fetch."""
        return len(self.slots)

    def start(self) -> None:
        self.thread.start()

    def load(
        self, chains: Sequence[Chain], sink: Callable[[int, int, memoryview], None]
    ) -> list[int]:
        """Fetch every chain at once (one `batch_get_into`; chains past `capacity` blocks in
        all are cut); call `sink(c, i, payload)` for block i of each chain c's longest good
        prefix and return those prefixes' lengths. Never raises for a store fault."""
        s = self.stats
        room, cut = self.capacity, []
        for chain in chains:
            cut.append(chain[: max(0, room)])
            room -= len(cut[-1])
        if not any(cut):
            return [0] * len(chains)
        with self.cond:
            if self.busy or not self.link.up.is_set():
                s.loads_skipped += 1
                return [0] * len(chains)
            job = self.job = _Job(cut)
            self.busy = True
            self.cond.notify()
        s.loads += 1
        if not job.done.wait(self.link.options.load_timeout_s):
            s.load_timeouts += 1
            self.link.timed_out("batch_get_into")
            return [0] * len(chains)
        woke = time.perf_counter()
        at, keep = 0, self.codec.payload_bytes
        for c, (chain, good) in enumerate(zip(cut, job.good, strict=True)):
            for i in range(good):
                sink(c, i, self.slots[at + i][-keep:])
            at += len(chain)
        t, end = job.times, time.perf_counter()
        self.parts = [t[1] - t[0], t[2] - t[1], t[3] - t[2], woke - t[4], end - woke]
        total = sum(job.good)
        s.blocks_loaded += total
        s.load_bytes += total * self.codec.value_bytes
        return job.good

    def close(self, timeout: float) -> bool:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout)
        return not self.thread.is_alive()

    def _run(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.job is not None or self.closed)
                if self.closed:
                    return
                job, self.job = self.job, None
            assert job is not None
            job.times[1] = time.perf_counter()
            try:
                job.good = self._fetch(job)
            except Exception:
                log.exception("load from the Mooncake Store failed")
                job.good = [0] * len(job.chains)
            with self.cond:
                self.busy = False
                self.cond.notify_all()
            job.times[4] = time.perf_counter()
            job.done.set()

    def _fetch(self, job: _Job) -> list[int]:
        size = self.codec.value_bytes
        blocks = [block for chain in job.chains for block in chain]
        base = self.buffer.ctypes.data
        codes = self.link.store.batch_get_into(
            [self.identity.key(h) for h, _ in blocks],
            [base + i * self.stride for i in range(len(blocks))],
            [size] * len(blocks),
        )
        job.times[2] = time.perf_counter()
        good, at = [], 0
        for chain in job.chains:
            good.append(self._good_prefix(chain, codes[at : at + len(chain)], at))
            at += len(chain)
        job.times[3] = time.perf_counter()
        return good

    def _good_prefix(self, chain: Chain, codes: list[int], at: int) -> int:
        """How many of `chain`'s first blocks arrived whole and passed every check."""
        size = self.codec.value_bytes
        for i, ((block_hash, tokens), code) in enumerate(zip(chain, codes, strict=True)):
            if code != size:
                if code < 0:
                    self.link.failed(code, "batch_get_into")
                if code >= 0 or not store_is_down(code):
                    self.stats.blocks_missing += 1
                return i
            try:
                self.codec.check(self.slots[at + i], block_hash, tokens)
            except ValueRefused as exc:
                self.stats.blocks_refused += 1
                log.warning("refused block %016x from the store: %s", block_hash & (2**64 - 1), exc)
                return i
        return len(chain)
