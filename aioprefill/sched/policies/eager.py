"""Policy ``eager``: every request is sent alone, as soon as it arrives (the behaviour before
forward-aware scheduling), to the least-loaded group, where it queues behind the forwards
already sent. A long prompt's chunks all queue at one group, in order, each its own batch; on a
full ring the request stays at the head of the queue, from its first unsent chunk.
"""

from __future__ import annotations

from aioprefill.sched.policies.base import DispatchPolicy

__all__ = ["EagerPolicy"]


class EagerPolicy(DispatchPolicy):
    name = "eager"

    def on_arrival(self) -> None:
        sched = self.sched
        slots = self.groups.slots
        while (req := sched.head()) is not None:
            if req.worker >= 0:  # partly sent: the rest must follow on the same group
                target = slots[req.worker]
                if not target.usable:
                    return
            else:
                best = self.least_loaded()
                if best is None:
                    return
                target = best
            backlogged = bool(target.in_flight)
            if not sched.dispatch_alone(req, target.index, self.groups, backlogged=backlogged):
                return
