"""Policy ``timeout``: a batch is sealed when it is full or when its oldest request has waited
`batch_timeout_ms`, then sent to the least-loaded group, queueing behind whatever runs there
(the ``@serve.batch`` knob: size or time, whichever comes first).
"""

from __future__ import annotations

from aioprefill.batching import is_full
from aioprefill.policies.base import DispatchPolicy

__all__ = ["TimeoutPolicy"]


class TimeoutPolicy(DispatchPolicy):
    name = "timeout"

    def on_arrival(self) -> None:
        """Seal batches while the queue fills one; otherwise make sure the timer will."""
        sched = self.sched
        while sched.num_pending and is_full(sched.num_pending, sched.pending_tokens, sched.budget):
            if not self._seal():
                return
        self._arm()

    def on_timer(self) -> None:
        self._seal()
        self.on_arrival()

    def _seal(self) -> bool:
        target = self.least_loaded()
        if target is None:
            return False
        return self.sched.dispatch(target.index, self.groups, backlogged=bool(target.in_flight))

    def _arm(self) -> None:
        if self.timer.armed or not self.sched.num_pending:
            return
        oldest = self.sched.oldest_waiting_ns()
        if oldest is not None:  # (only chunks in flight: their answers re-arm the timer)
            self.timer.arm_at(oldest + self.batch_timeout_ns)
