"""Helpers shared by the reliability tests: waiting on engine state, process liveness, prompts."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

from aioprefill import Engine, SimModel

SHM = Path("/dev/shm")


def sim(fixed_ms: float = 1.0, **kw: int | float) -> SimModel:
    return SimModel(fixed_ms=fixed_ms, per_token_us=0.0, **kw)  # type: ignore[arg-type]


def prompt(rng: random.Random, n: int | None = None) -> list[int]:
    # Token ids stay below 30000: the fault-injection tokens used in these tests are above.
    return [rng.randrange(30000) for _ in range(n or rng.randrange(1, 48))]


def seeded() -> random.Random:
    seed = random.randrange(1 << 30)
    print("seed", seed)
    return random.Random(seed)


async def until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Wait (polling every 2 ms) until `predicate()` holds; fail after `timeout` seconds.

    For engine state that has no event of its own (a worker's in-flight deque, a restarted
    worker's pid); never used where an awaitable exists.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
        await asyncio.sleep(0.002)


async def until_sent(engine: Engine, timeout: float = 10.0) -> None:
    """Until every request submitted so far has left the queue for a worker: for tests that act
    while a forward runs (queue behind it, cancel during it), where a fixed sleep races a loaded
    2-core CI machine's event loop (0.13 s stalls seen)."""

    def sent() -> bool:
        stats = engine.stats()
        return bool(stats.in_flight and not stats.pending)

    await until(sent, timeout, "every submitted request sent")


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie nobody reaped yet counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] != b"Z"


def wait_dead(pids: list[int], timeout: float) -> list[int]:
    """Wait up to `timeout` s for every pid to exit; return those still alive."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if pid_alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.01)


def segments_of(pid: int) -> list[str]:
    return sorted(p.name for p in SHM.glob(f"aioprefill-{pid}-*"))


def all_ready(engine: Engine) -> bool:
    """Every worker is up and serving (a restarting worker has a pid before it is ready)."""
    return engine._pool.all_ready()


def busy_worker(engine: Engine) -> int | None:
    """Index of a ready worker that has a batch in flight (mid-forward), if any."""
    for w in engine._pool.slots:
        if w.ready and w.in_flight:
            return w.index
    return None


def kill_worker(engine: Engine, index: int, sig: int = 9) -> int:
    """Send `sig` to worker `index`; returns its pid."""
    w = engine._pool.slots[index]
    assert w.handle is not None
    pid = w.handle.pid
    os.kill(pid, sig)
    return pid
