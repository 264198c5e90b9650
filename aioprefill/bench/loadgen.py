"""Load generators over one `Engine`: open loop at scheduled times, and closed loop.

The open loop sleeps until the next arrival and submits every request that is due, each in its
own task, whether or not earlier ones have finished (sleeping here is fine: this is the client,
not the engine's hot path). The closed loop keeps `concurrency` requests outstanding. Both stop
submitting on the first Ctrl-C and cancel what is left on the second or past a deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from aioprefill import AioprefillError, Engine, PrefillResult
from aioprefill.bench.interrupt import Interrupt
from aioprefill.bench.metrics import Records
from aioprefill.bench.progress import Progress

__all__ = ["Load", "LoadGen"]

_sent = itertools.count()  # closed-loop prompts sent by this process (`closed_loop`)


@dataclass(slots=True)
class Load:
    """What one run collected: completed results with their schedule rows, and failures."""

    results: list[PrefillResult] = field(default_factory=list)
    scheduled_ns: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    submitted: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    partial: bool = False
    window_ns: tuple[int, int] | None = None  # closed loop: steady-state window

    def records(self) -> Records:
        return Records.from_results(
            self.results,
            self.scheduled_ns,
            self.lengths,
            n_submitted=self.submitted,
            errors=self.errors,
        )


class LoadGen:
    def __init__(self, engine: Engine, interrupt: Interrupt, progress: Progress) -> None:
        self.engine = engine
        self.interrupt = interrupt
        self.progress = progress

    async def open_loop(self, arrivals_s: np.ndarray, prompts: list[np.ndarray]) -> Load:
        """Submit `prompts[i]` at `arrivals_s[i]` seconds from now (plus 20 ms to settle)."""
        n = len(prompts)
        slots: list[PrefillResult | None] = [None] * n
        load = Load()
        finished = 0

        async def one(i: int) -> None:
            nonlocal finished
            try:
                slots[i] = await self.engine.prefill(prompts[i])
            except AioprefillError as exc:
                load.errors[type(exc).__name__] += 1
            finally:
                finished += 1

        loop = asyncio.get_running_loop()
        due = time.monotonic_ns() + 20_000_000 + np.rint(arrivals_s * 1e9).astype(np.int64)
        tasks: list[asyncio.Task[None]] = []
        i = 0
        while i < n and not self.interrupt.stop.is_set():
            now = time.monotonic_ns()
            if due[i] > now:
                await asyncio.sleep((due[i] - now) / 1e9)
                continue
            while i < n and due[i] <= now:
                tasks.append(loop.create_task(one(i)))
                i += 1
            self.progress.draw(finished, i)
        load.submitted = i
        span_s = float(arrivals_s[-1]) if n else 0.0
        cancelled = await self._drain(tasks, lambda: (finished, i), max(120.0, 4 * span_s))
        load.partial = i < n or cancelled
        for k in range(i):
            r = slots[k]
            if r is not None:
                load.results.append(r)
                load.scheduled_ns.append(int(due[k]))
                load.lengths.append(len(prompts[k]))
        return load

    async def closed_loop(
        self, pool: list[np.ndarray], concurrency: int, *, min_s: float, min_forwards: int
    ) -> Load:
        """`concurrency` clients, each sending the next prompt of `pool` as soon as its last
        one returns, for `min_s` seconds and on until `min_forwards` forwards ended after the
        first fifth (at most ten times `min_s`). `window_ns` is (end of that fifth, stop).

        The pool is only a supply of prompts, not a reuse pattern: each prompt sent is a pool
        prompt rotated by one more position for every pass over the pool any closed loop of
        this process made (`_sent`), so the prefix cache never finds a prompt it saw in a
        warm-up or an earlier run (until a prompt's length in passes: 131,072 requests for
        the default bench's pool of 2,048 prompts of ~64 tokens)."""
        load = Load()
        forwards: set[tuple[int, int]] = set()
        t0 = time.monotonic_ns()
        warm_ns = t0 + int(0.2 * min_s * 1e9)
        min_end, max_end = t0 + int(min_s * 1e9), t0 + int(10 * min_s * 1e9)
        stop_ns = max_end

        def enough() -> bool:
            nonlocal stop_ns
            now = time.monotonic_ns()
            if now >= max_end or (now >= min_end and len(forwards) >= min_forwards):
                stop_ns = min(stop_ns, now)
                return True
            if self.interrupt.stop.is_set():
                stop_ns = min(stop_ns, now)
                return True
            return False

        async def client() -> None:
            while not enough():
                k = next(_sent)
                tokens = np.roll(pool[k % len(pool)], k // len(pool) + 1)
                load.submitted += 1
                stamp = time.monotonic_ns()
                try:
                    r = await self.engine.prefill(tokens)
                except AioprefillError as exc:
                    load.errors[type(exc).__name__] += 1
                    return
                load.results.append(r)
                load.scheduled_ns.append(stamp)
                load.lengths.append(len(tokens))
                if r.forward_end_ns >= warm_ns:
                    forwards.add((r.worker, r.batch_id))

        tasks = [asyncio.create_task(client()) for _ in range(concurrency)]
        counts = lambda: (len(load.results), load.submitted)  # noqa: E731
        load.partial = await self._drain(tasks, counts, 10 * min_s + 120)
        load.window_ns = (warm_ns, stop_ns)
        return load

    async def _drain(
        self,
        tasks: list[asyncio.Task[None]],
        counts: Callable[[], tuple[int, int]],
        deadline_s: float,
    ) -> bool:
        """Wait for the tasks; cancel the rest on a second Ctrl-C or past the deadline.
        Returns True when some were cancelled."""
        pending: set[asyncio.Task[None]] = set(tasks)
        end = time.monotonic() + deadline_s
        while pending:
            _, pending = await asyncio.wait(pending, timeout=0.2)
            done_n, sub_n = counts()
            self.progress.draw(done_n, sub_n, draining=self.interrupt.stop.is_set())
            if pending and (self.interrupt.abort.is_set() or time.monotonic() > end):
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                return True
        return False
