"""A one-line progress bar on stderr, redrawn in place; silent unless enabled."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]

_WIDTH = 24


class Progress:
    """`start()` a step, `draw()` as often as you like (it redraws at most 5 times a second),
    `done()` to replace the bar with a summary line. `note()` prints a line in any case."""

    def __init__(self, enabled: bool, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self._label = ""
        self._total_s = 0.0
        self._t0 = 0.0
        self._last = 0.0
        self._drawn = False

    def start(self, label: str, total_s: float) -> None:
        self._label, self._total_s = label, total_s
        self._t0 = time.monotonic()
        self._last = 0.0

    def draw(
        self, completed: int, submitted: int, *, draining: bool = False, force: bool = False
    ) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.2:
            return
        self._last = now
        elapsed = now - self._t0
        frac = min(1.0, elapsed / self._total_s) if self._total_s > 0 else 1.0
        bar = "#" * int(frac * _WIDTH) + "-" * (_WIDTH - int(frac * _WIDTH))
        state = "draining" if draining else f"{elapsed:5.1f}/{self._total_s:.0f}s"
        line = f"\r{self._label:<28} [{bar}] {state}  done {completed}/{submitted}"
        self.stream.write(line + "\x1b[K")
        self.stream.flush()
        self._drawn = True

    def done(self, summary: str) -> None:
        if not self.enabled:
            return
        self._clear()
        self.stream.write(f"{self._label:<28} {summary}\n")
        self.stream.flush()

    def note(self, message: str) -> None:
        self._clear()
        self.stream.write(message + "\n")
        self.stream.flush()

    def _clear(self) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self._drawn = False
