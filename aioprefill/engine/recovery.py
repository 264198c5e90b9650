"""What happens to a dead worker group's requests: which are retried, which fail.

`plan_recovery` decides on plain data; `Recovery.after_death` applies the plan through the
`Scheduler` (requeue) and `Outcomes` (fail callers); the `WorkerPool` restarts the group after
its `RestartBackoff` (`pool/backoff.py`).

- A request the dead group held (in a batch in its ring, or queued between two chunks whose
  KV cache lived there) is retried from its first token, up to `max_retries` times per
  request, then fails with `WorkerCrashed`. Nothing is retried once the engine is closing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from aioprefill.errors import WorkerCrashed
from aioprefill.sched.scheduler import Scheduler
from aioprefill.sched.units import InFlight, Request

if TYPE_CHECKING:
    from aioprefill.engine.outcomes import Outcomes

__all__ = ["Recovery", "plan_recovery"]


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
        sched.lost_group(group)  # its prefix cache died with it
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
