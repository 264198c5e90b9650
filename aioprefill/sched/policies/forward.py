"""Policy ``forward`` (the default): a group gets its next batch the moment its forward ends.

Requests that arrive while every group runs a forward gather into one batch (the scheduler
keeps it staged, its columns ready), sent as soon as a forward ends; an idle group gets a
request at once. At most one batch is in flight per group, so each batch is formed as late as
possible and is as full as the traffic allows. With `early`, the engine hands the group its
next batch as soon as the answer is in the ring, before decoding it: the gap between two
forwards is then one wake-up plus one ring write.

With several groups a group takes only its fair share of the pending work (`FairShare`,
`policies/share.py`: the pending tokens plus what the other groups still have to run, over the
usable groups; at least one request, never past the budget), so a burst is spread over the
groups instead of going whole to the first one free. ``forward-greedy`` (`GreedyForwardPolicy`)
is the rule before, kept as a baseline: a group takes everything pending up to the budget.
"""

from __future__ import annotations

from aioprefill.sched.policies.base import DispatchPolicy, Groups, Timer
from aioprefill.sched.policies.share import FairShare
from aioprefill.sched.scheduler import Scheduler

__all__ = ["ForwardPolicy", "GreedyForwardPolicy"]


class ForwardPolicy(DispatchPolicy):
    name = "forward"
    staging = True
    early = True
    sharing = True  # take the fair share of the pending work, not all of it

    def __init__(
        self, sched: Scheduler, groups: Groups, timer: Timer, *, batch_timeout_ms: float
    ) -> None:
        super().__init__(sched, groups, timer, batch_timeout_ms=batch_timeout_ms)
        # (one group: nothing to share, and its path stays as it was)
        self.share = FairShare() if self.sharing and len(groups.slots) > 1 else None

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
                self._dispatch(g.index, backlogged=False)

    def on_forward_done(self, group: int) -> None:
        g = self.groups.slots[group]
        if self.share is not None:
            self.share.ended_unless_in(group, g.in_flight)
        if not g.in_flight and g.ready:  # (not a dead group's last words)
            self._dispatch(group, backlogged=True)

    def on_answer_waiting(self, group: int) -> None:
        # The answered batch is still in flight; `on_forward_done` then sees this new one.
        if self.share is not None:
            self.share.ended(group, self.groups.slots[group].in_flight[0])
        self._dispatch(group, backlogged=True)

    def _dispatch(self, group: int, *, backlogged: bool) -> None:
        fair = self.share
        if fair is None:
            self.sched.dispatch(group, self.groups, backlogged=backlogged)
            return
        share = fair.share(group, self.groups.slots, self.sched.pending_tokens)
        if self.sched.dispatch(group, self.groups, backlogged=backlogged, share=share):
            fair.sent(group, self.groups.slots[group].in_flight[-1])


class GreedyForwardPolicy(ForwardPolicy):
    """The baseline: a group takes everything pending, up to the budget."""

    name = "forward-greedy"
    sharing = False
