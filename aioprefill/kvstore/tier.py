"""`StoreTier`: the Mooncake Store behind one worker's (one rank's) prefix cache, as the worker
sees it: `offer` the blocks it wrote (put in the background), `load` chains into its slots
(checked, within a deadline), `load_pays` (the cost rule, on measured costs), `stats`.

Memory, allocated once here: the put buffer and the load buffer (`KVStoreOptions`), both
registered with the client so puts and gets are zero-copy; plus the segment the client lends
to the store. Threads: "kvstore-put" (connects, reconnects, puts) and "kvstore-load".
Nothing here raises for a store fault: the worker computes instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from aioprefill.kvstore.cost import ForwardClock, HitRate, ReadClock
from aioprefill.kvstore.diag import DIAG
from aioprefill.kvstore.directory import StoreDirectory
from aioprefill.kvstore.identity import StoreIdentity
from aioprefill.kvstore.link import StoreLink
from aioprefill.kvstore.loads import Chain, Loader
from aioprefill.kvstore.options import KVStoreOptions
from aioprefill.kvstore.puts import PutQueue
from aioprefill.kvstore.stats import StoreStats
from aioprefill.kvstore.value import ValueCodec

__all__ = ["StoreTier"]

# When the cost rule keeps refusing, every this-many-th batch loads anyway, so that the
# measured read cost and hit fraction follow the store.
_PROBE_EVERY = 4


class StoreTier:
    """The store tier of one worker. `payload_bytes`: one cache slot's bytes (what a block
    store's `parts` for one block add up to). `seconds_per_token`: the first guess of the
    worker's compute time per token, refined by `record_forward`."""

    def __init__(
        self,
        options: KVStoreOptions,
        identity: StoreIdentity,
        payload_bytes: int,
        seconds_per_token: float = 1e-3,
    ) -> None:
        self.options = options
        self.identity = identity
        self.codec = ValueCodec(
            identity.digest, identity.block_tokens, payload_bytes, options.secret
        )
        self.stats = StoreStats()
        self.clock = ForwardClock(seconds_per_token)
        per_block = self.codec.value_bytes / options.read_bytes_per_s
        self.reads = ReadClock(options.read_latency_s, per_block)
        self.hits = HitRate()
        put_buf = np.zeros(options.put_buffer_bytes, dtype=np.uint8)
        load_buf = np.zeros(options.load_buffer_bytes, dtype=np.uint8)
        self.link = StoreLink(options, [put_buf, load_buf])
        self.puts = PutQueue(self.link, identity, self.codec, put_buf, self.stats)
        self.loader = Loader(self.link, identity, self.codec, load_buf, self.stats)
        self.started = False
        self.refused = 0  # batches in a row whose loads the rule refused
        # What every node announced (`KVStoreOptions.peer_events`): a chain nobody announced
        # is not asked for. Sized at twice the pool, as if every node lent what this one does.
        self.directory: StoreDirectory | None = None
        if options.peer_events:
            pool = len(options.peer_events) * options.segment_bytes // self.value_bytes
            self.directory = StoreDirectory(options.peer_events, 2 * pool)

    @property
    def value_bytes(self) -> int:
        return self.codec.value_bytes

    def start(self) -> None:
        """Start both threads; the put thread connects in the background (`is_up`)."""
        self.puts.start()
        self.loader.start()
        if self.directory is not None:
            self.directory.start()
        self.started = True

    def is_up(self) -> bool:
        return self.link.up.is_set()

    def wait_up(self, timeout: float) -> bool:
        """Block until the link is up (tests and benchmarks; the worker never waits)."""
        return self.link.up.wait(timeout)

    def offer(self, block_hash: int, tokens: np.ndarray, parts: Sequence[Any]) -> bool:
        """Stage a written block for a put (copied now); False when it will not be put."""
        return self.puts.offer(block_hash, tokens, parts)

    def defer(self, blocks: Sequence[tuple[int, int, np.ndarray, Sequence[Any]]]) -> None:
        """List written blocks `(cache slot, hash, tokens, parts)` for puts, copied later by
        the put thread; `settle(slots)` before rewriting any of those cache slots."""
        self.puts.defer(blocks)

    def settle(self, cache_slots: Sequence[int]) -> None:
        self.puts.settle(cache_slots)

    def load_pays(self, sizes: Sequence[int], known: int = 0) -> bool:
        """The cost rule (`kvstore.cost`) for one call asking chains of `sizes` blocks, the
        first `known` of them (in all) known to be in the store, with this worker's own
        measured read cost (`reads`), hit fraction (`hits`, for the others) and compute cost
        per token (`clock`)."""
        gain = self.identity.block_tokens * self.clock.seconds_per_token - self.reads.per_block()
        if gain <= 0 or not any(sizes):
            return False
        expected = known + self.hits.fraction * (sum(sizes) - known)
        return self.reads.latency() < expected * gain

    def load(
        self, chains: Sequence[Chain], sink: Callable[[int, int, memoryview], None]
    ) -> list[int]:
        """When the cost rule says the batch's chains are worth asking for, load the longest
        good prefix of each (all chains in one call, `loader.capacity` blocks at most);
        `sink(c, i, payload)` copies block i of chain c into its slot. Returns, per chain,
        how many blocks were handed over; the caller computes the rest. The call's time
        teaches `reads`, what it found beyond the blocks known to be there `hits`."""
        hashes = _hashes(chains)
        known = [self.puts.known_prefix(hs) for hs in hashes]
        sizes = [len(chain) for chain in chains]
        directory = self.directory
        if directory is not None and not directory.failed:
            # Only what some node announced is worth a call; the rule then weighs exactly that
            # (the rest of a chain is still asked: a block announced since may be there).
            known = sizes = [
                max(k, directory.known_prefix(hs)) for k, hs in zip(known, hashes, strict=True)
            ]
            if not any(known):
                self.stats.loads_unlisted += 1
                if DIAG is not None:
                    DIAG.ask("unlisted", hashes, [0] * len(chains), 0.0, self._state())
                return [0] * len(chains)
        decision = "load"
        if self.load_pays(sizes, sum(known)):
            self.refused = 0
        else:
            self.stats.loads_skipped += 1
            self.refused += 1
            decision = "probe"
            if self.refused % _PROBE_EVERY:
                if DIAG is not None:
                    DIAG.ask("skip", hashes, [0] * len(chains), 0.0, self._state())
                return [0] * len(chains)
            # now and then anyway: a refused load teaches nothing
        calls, timeouts = self.stats.loads, self.stats.load_timeouts
        start = time.perf_counter()
        got = self.loader.load(chains, sink)
        if self.stats.loads > calls and self.stats.load_timeouts == timeouts:
            self.reads.record(time.perf_counter() - start, sum(got))
            asked = min(sum(len(chain) for chain in chains), self.loader.capacity)
            beyond = sum(max(0, g - k) for g, k in zip(got, known, strict=True))
            self.hits.record(beyond, asked - sum(known))
            self.puts.remember([h for c, g in zip(chains, got, strict=True) for h, _ in c[:g]])
        if DIAG is not None:
            if self.stats.load_timeouts > timeouts:
                decision = "timeout"
            elif self.stats.loads == calls:
                decision = "busy"
            took = time.perf_counter() - start
            parts = self.loader.parts if decision in ("load", "probe") else []
            DIAG.ask(decision, hashes, got, took, self._state(), parts)
        return got

    def _state(self) -> list[float]:
        r = self.reads
        return [r.latency(), r.per_block(), self.hits.fraction, self.clock.seconds_per_token]

    def record_forward(self, seconds: float, computed_tokens: int) -> None:
        self.clock.record(seconds, computed_tokens)

    def close(self, timeout: float = 5.0) -> None:
        """Stop both threads; unmount the segment (~2 s) once neither is inside a store call
        and the master answers (unmounting from a dead master retries for many seconds: the
        process's exit ends the client instead, and the master forgets it after its TTL)."""
        if self.directory is not None:
            self.directory.close()
        puts_done = self.puts.close(timeout)
        loads_done = self.loader.close(timeout)
        if puts_done and loads_done and self.link.up.is_set():
            self.link.close()


def _hashes(chains: Sequence[Chain]) -> list[list[int]]:
    return [[h for h, _ in chain] for chain in chains]
