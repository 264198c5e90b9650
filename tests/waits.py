"""Waits for tests that need a forward to be running before they act (queue behind it, cancel
during it): a fixed sleep is a race on a loaded 2-core CI machine, whose event loop has stalled
for 0.13 s."""

from __future__ import annotations

import asyncio
import time

from aioprefill import Engine


async def until_sent(engine: Engine, timeout_s: float = 10.0) -> None:
    """Until every request submitted so far has left the queue for a worker (a test-only poll:
    the engine has no event for it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.stats()
        if stats.in_flight and not stats.pending:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not sent within {timeout_s} s: {stats}")
        await asyncio.sleep(0.002)
