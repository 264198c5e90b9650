"""Policy ``forward`` (the default): a group gets its next batch the moment its forward ends.

Requests that arrive while every group runs a forward gather into one batch (the scheduler
keeps it staged, its columns ready), sent as soon as a forward ends; an idle group gets a
request at once. At most one batch is in flight per group, so each batch is formed as late as
possible and is as full as the traffic allows. With `early`, the engine hands the group its
next batch as soon as the answer is in the ring, before decoding it: the gap between two
forwards is then one wake-up plus one ring write.
"""

from __future__ import annotations

from aioprefill.policies.base import DispatchPolicy

__all__ = ["ForwardPolicy"]


class ForwardPolicy(DispatchPolicy):
    name = "forward"
    staging = True
    early = True

    def on_arrival(self) -> None:
        sched = self.sched
        slots = self.groups.slots
        cache = sched.cache
        if cache is not None and len(slots) > 1:  # a new prefix goes where least was stored
            slots = sorted(slots, key=lambda g: cache.indexes[g.index].stored)
        for g in slots:
            if not sched.num_pending:
                return
            if g.usable and not g.in_flight:
                sched.dispatch(g.index, self.groups, backlogged=False)

    def on_forward_done(self, group: int) -> None:
        g = self.groups.slots[group]
        if not g.in_flight and g.ready:  # (not a dead group's last words)
            self.sched.dispatch(group, self.groups, backlogged=True)

    def on_answer_waiting(self, group: int) -> None:
        # The answered batch is still in flight; `on_forward_done` then sees this new one.
        self.sched.dispatch(group, self.groups, backlogged=True)
