"""`RestartBackoff`: when a dead worker group restarts, and when it is given up.

A group is restarted after a backoff: 50 ms after the first death in `restart_window_s`,
doubling with each further death in the window, at most 5 s. Past `max_restarts` deaths in the
window it is given up; when every group is given up the engine is broken. Plain data: the pool
asks it, `Restarts` acts on the answer.
"""

from __future__ import annotations

from collections import deque

__all__ = ["RestartBackoff"]

_BACKOFF_FIRST_S = 0.05
_BACKOFF_MAX_S = 5.0


class RestartBackoff:
    """One group's recent deaths, and the delay before its next restart."""

    __slots__ = ("deaths", "gave_up", "max_restarts", "window_s")

    def __init__(self, window_s: float, max_restarts: int) -> None:
        self.window_s = window_s
        self.max_restarts = max_restarts
        self.deaths: deque[float] = deque()
        self.gave_up = False  # died too often: no more restarts

    def note_death(self, now: float) -> float | None:
        """Record a death at `now` (seconds); return the backoff, or None: give up."""
        self.deaths.append(now)
        while self.deaths and now - self.deaths[0] > self.window_s:
            self.deaths.popleft()
        if len(self.deaths) > self.max_restarts:
            self.gave_up = True
            return None
        return min(_BACKOFF_MAX_S, _BACKOFF_FIRST_S * 2 ** (len(self.deaths) - 1))
