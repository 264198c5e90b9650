"""What happens after a worker group dies: which requests are retried, and when it restarts.

`plan_recovery` and `RestartBackoff` decide on plain data; `Recovery.after_death` applies the
plan through the `Scheduler` (requeue) and `Outcomes` (fail callers); the `WorkerPool` restarts
the group after the backoff.

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
from typing import TYPE_CHECKING

from aioprefill.batching import Request
from aioprefill.errors import WorkerCrashed
from aioprefill.scheduler import InFlight, Scheduler

if TYPE_CHECKING:
    from aioprefill.outcomes import Outcomes

__all__ = ["Recovery", "RestartBackoff", "plan_recovery"]

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


class Recovery:
    """Applies `plan_recovery` after a group's death."""

    def __init__(self, sched: Scheduler, outcomes: Outcomes, max_retries: int) -> None:
        self._sched = sched
        self._outcomes = outcomes
        self.max_retries = max_retries

    def after_death(
        self, group: int, lost: Iterable[InFlight], why: str, *, may_retry: bool
    ) -> int:
        """Requeue what may be retried (oldest first), fail the rest; return how many retry."""
        sched = self._sched
        retry, fail = plan_recovery(
            lost,
            sched.pinned_to(group),  # queued between chunks: their KV cache died too
            max_retries=self.max_retries,
            may_retry=may_retry,
        )
        for req in fail:
            error = WorkerCrashed(
                f"{why} while running this request; {req.attempts} retries used "
                f"(max_retries={self.max_retries})"
            )
            self._outcomes.fail([req], error)
        sched.requeue_first([req for req in retry if sched.retry(req)])
        return len(retry)


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
