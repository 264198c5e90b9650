"""`LoopTimer`: the one-shot timer a dispatch policy may arm, run on the engine's event loop.

Policies stay free of asyncio: they see this through the `policies.Timer` protocol (`armed`,
`arm_at`), and tests use a plain-data fake.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["LoopTimer"]


class LoopTimer:
    """The one-shot timer a policy may arm (`policies.Timer`), on the engine's event loop."""

    def __init__(self, callback: Callable[[], None]) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._callback = callback
        self._handle: asyncio.TimerHandle | None = None

    @property
    def armed(self) -> bool:
        return self._handle is not None

    def arm_at(self, due_ns: int) -> None:
        assert self.loop is not None
        delay = max(0.0, (due_ns - time.monotonic_ns()) / 1e9)
        self._handle = self.loop.call_later(delay, self._fire)

    def _fire(self) -> None:
        self._handle = None
        self._callback()

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
