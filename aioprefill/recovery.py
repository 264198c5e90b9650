"""What happens after a worker group dies: which requests are retried, and when it restarts.

Pure decisions over plain data; the engine applies them (the `Scheduler` requeues, the engine
fails callers, the `WorkerPool` restarts the group after the backoff).

- A request the dead group held (in a batch in its ring, or queued between two chunks whose
  KV cache lived there) is retried from its first token, up to `max_retries` times per
  request, then fails with `WorkerCrashed`. Nothing is retried once the engine is closing.
- A group is restarted after a backoff: 50 ms after the first death in `restart_window_s`,
  doubling with each further death in the window, at most 5 s. Past `max_restarts` deaths in
  the window it is given up; when every group is given up the engine is broken.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from aioprefill.batching import Request
from aioprefill.scheduler import InFlight

__all__ = ["RestartBackoff", "plan_recovery"]

_BACKOFF_FIRST_S = 0.05
_BACKOFF_MAX_S = 5.0


def plan_recovery(
    lost: Iterable[InFlight],
    pinned: Iterable[Request],
    *,
    max_retries: int,
    may_retry: bool,
) -> tuple[list[Request], list[Request]]:
    """Split the live requests a dead group held into (retry, fail), each in ring order.

    `lost`: its batches in flight; `pinned`: queued requests whose KV cache it held.
    """
    seen: set[int] = set()
    retry: list[Request] = []
    fail: list[Request] = []
    for req in (*(c.request for batch in lost for c in batch.chunks), *pinned):
        if req.request_id in seen or req.cancelled:
            continue
        seen.add(req.request_id)
        (retry if may_retry and req.attempts < max_retries else fail).append(req)
    return retry, fail


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
