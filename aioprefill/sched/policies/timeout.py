"""Policy ``timeout``: a batch is sealed when it is full or when its oldest request has waited
`batch_timeout_ms`, then sent to the least-loaded group, queueing behind whatever runs there
(the ``@serve.batch`` knob: size or time, whichever comes first).
"""

from __future__ import annotations

from aioprefill.sched.batching import is_full
from aioprefill.sched.policies.base import DispatchPolicy

__all__ = ["TimeoutPolicy"]


class TimeoutPolicy(DispatchPolicy):
    name = "timeout"
    _armed_for = 0  # the due time the timer was last armed with

    def on_arrival(self) -> None:
        """Seal batches while the queue fills one; otherwise make sure the timer will."""
        sched = self.sched
        while sched.num_pending and is_full(sched.num_pending, sched.pending_tokens, sched.budget):
            if not self._seal():
                return
        self._arm()

    def on_timer(self) -> None:
        due = self._due()
        if due is not None and due > self._armed_for:
            # The requests it was armed for left in full batches since: the oldest now waiting
            # came later, and waits its own batch_timeout_ms (not the rest of theirs).
            self._arm_at(due)
            return
        self._seal()
        self.on_arrival()

    def _seal(self) -> bool:
        target = self.least_loaded()
        if target is None:
            return False
        return self.sched.dispatch(target.index, self.groups, backlogged=bool(target.in_flight))

    def _due(self) -> int | None:
        """When the oldest request waiting (if any) has waited batch_timeout_ms."""
        if not self.sched.num_pending:
            return None
        oldest = self.sched.oldest_waiting_ns()
        # (None: only chunks in flight, whose answers re-arm the timer)
        return None if oldest is None else oldest + self.batch_timeout_ns

    def _arm(self) -> None:
        if self.timer.armed:
            return
        due = self._due()
        if due is not None:
            self._arm_at(due)

    def _arm_at(self, due_ns: int) -> None:
        self._armed_for = due_ns
        self.timer.arm_at(due_ns)
