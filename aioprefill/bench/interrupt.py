"""Ctrl-C handling for a benchmark run: stop cleanly, keep what was measured."""

from __future__ import annotations

import asyncio
import signal

from aioprefill.bench.progress import Progress

__all__ = ["Interrupt"]


class Interrupt:
    """Ctrl-C: the first press stops submitting and lets in-flight requests finish; the second
    abandons them (cancels their tasks). The engine then closes and the report is written."""

    def __init__(self, progress: Progress) -> None:
        self.stop = asyncio.Event()
        self.abort = asyncio.Event()
        self._progress = progress
        self._loop: asyncio.AbstractEventLoop | None = None

    def install(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_signal_handler(signal.SIGINT, self._on_sigint)

    def uninstall(self) -> None:
        if self._loop is not None:
            self._loop.remove_signal_handler(signal.SIGINT)

    def _on_sigint(self) -> None:
        if not self.stop.is_set():
            self.stop.set()
            self._progress.note(
                "interrupted: finishing in-flight requests (Ctrl-C again to abandon them)"
            )
        else:
            self.abort.set()
            self.uninstall()
