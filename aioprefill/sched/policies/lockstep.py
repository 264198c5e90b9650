"""Expert-parallel lockstep: every rank runs every step, so a step goes to *all* groups at once.

Under `expert_parallel=True` each group is one rank of a single expert-parallel group; their
MoE layers exchange tokens, so a rank that skipped a step would leave its peers blocked inside
a collective. A step splits the pending work across the ranks (`lockstep.split_step`: late
binding, balanced by tokens) and sends a batch to every rank, an empty one to a rank that got
nothing. The next step waits until every rank answered.

- ``forward`` (`LockstepPolicy`): a step as soon as the previous one ended *and* work is
  pending, or at once when the ranks are idle. Nothing pending: no step, no empty batch.
- ``ep-timer`` (`TimerLockstepPolicy`): the original design, kept as a baseline: a step every
  5 ms whether or not anything is pending, so idle ranks get empty batches at ~200 Hz, and a
  request waits for the next tick.
"""

from __future__ import annotations

import time

from aioprefill.sched.policies.base import DispatchPolicy

__all__ = ["TICK_NS", "LockstepPolicy", "TimerLockstepPolicy"]

TICK_NS = 5_000_000  # ep-timer: one step every 5 ms (~200 Hz)


class LockstepPolicy(DispatchPolicy):
    name = "forward"

    def step_done(self) -> bool:
        """Every rank is up and has answered the last step."""
        return all(g.ready and not g.in_flight for g in self.groups.slots)

    def on_arrival(self) -> None:
        if self.sched.num_pending and self.step_done():
            self.sched.dispatch_step(self.groups, len(self.groups.slots))

    def on_forward_done(self, group: int) -> None:
        self.on_arrival()


class TimerLockstepPolicy(LockstepPolicy):
    name = "ep-timer"

    def on_arrival(self) -> None:
        if not self.timer.armed:
            self.timer.arm_at(time.monotonic_ns() + TICK_NS)

    def on_forward_done(self, group: int) -> None:
        """Steps start on the timer only."""

    def on_timer(self) -> None:
        if self.step_done():
            self.sched.dispatch_step(self.groups, len(self.groups.slots), always=True)
        self.timer.arm_at(time.monotonic_ns() + TICK_NS)
