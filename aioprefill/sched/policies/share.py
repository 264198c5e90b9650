"""`FairShare`: how much of the pending work a data-parallel group takes when it gets a batch.

Policy ``forward`` hands a group its next batch the moment its forward ends. Given everything
pending, the first group to finish would take a whole burst while the others, free a moment
later, idle. The rule, with `n` usable groups (ready, ring with room) and `n > 1`:

    share = ceil((pending tokens + tokens still to run on the other groups) / n)

where a group's tokens still to run are its in-flight batch's tokens less what its forward has
done by now, estimated from a fitted cost model (`fixed + per_token * tokens`, refitted after
every forward over the last few; the fixed cost counts as `fixed / per_token` tokens). Until a
forward was timed, a batch in flight counts whole. The group's batch then takes requests first
come first served while the batch's midpoint stays under the share (`take_batch`: a request joins
when `2 * tokens + its tokens < 2 * share`, so the batch ends as close to the share as whole
prompts allow), at least one, never past `max_batch_tokens`; a staged batch over the share goes
back to the queue first. Idle groups get their share at once (`ForwardPolicy.on_arrival` visits
each), a busy group's at its forward's end; no group idles while work waits, since every group
takes at least one request whenever it is free.

Why this share: the pending work `P` ends at `max(fixed + b*x, t_other + fixed + b*(P - x))`
for the part `x` this group takes (`b` the cost per token, `t_other` when the next other group
is free): both sides pay one fixed cost, so the fair share is the best split for the burst at
hand. But a split also gives the other group a forward it might not have run, and with
requests still arriving that group is then busy when they come; on a GPU-class forward (fixed
cost ~10 ms, ~26 us a token) packing more into one forward is nearly free. So a group splits
only when the part it leaves costs at least one forward's fixed cost to run
(`(P - share) * per_token >= fixed`); otherwise it takes all it can, as before.
Only whole-prompt requests are shared: a prompt's chunks stay on the group holding its KV cache,
and requests the prefix cache homes on another group still wait for it (`BatchPlan.elsewhere`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence

from aioprefill.sched.policies.base import Batch, Group

__all__ = ["FairShare"]

_DECAY = 0.8  # each forward's weight in the fit against the previous one's (~5 forwards)


class FairShare:
    """The cost model of recent forwards, and each group's fair share of the pending work."""

    def __init__(self, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.clock = clock
        self._sent: dict[int, tuple[object, int, int]] = {}  # group: (batch, tokens, sent_ns)
        # Decayed sums for the least-squares fit of duration (ns) against tokens.
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.fixed_ns = 0.0
        self.ns_per_token = 0.0  # 0: no forward timed yet

    def sent(self, group: int, batch: Batch) -> None:
        """`batch` went to `group` now."""
        self._sent[group] = (batch, batch.num_tokens, self.clock())

    def ended(self, group: int, batch: object) -> None:
        """`batch` of `group` ended now: time it if it is the one `sent` recorded."""
        got = self._sent.get(group)
        if got is None or got[0] is not batch:
            return
        del self._sent[group]
        self._fit(got[1], self.clock() - got[2])

    def ended_unless_in(self, group: int, in_flight: Collection[object]) -> None:
        """`group` answered: time the recorded batch if it is no longer in flight."""
        got = self._sent.get(group)
        if got is not None and got[0] not in in_flight:
            self.ended(group, got[0])

    def _fit(self, tokens: int, duration_ns: int) -> None:
        d = _DECAY
        self._w = self._w * d + 1.0
        self._x = self._x * d + tokens
        self._y = self._y * d + duration_ns
        self._xx = self._xx * d + tokens * tokens
        self._xy = self._xy * d + tokens * duration_ns
        w, x, y = self._w, self._x, self._y
        var = w * self._xx - x * x
        slope = (w * self._xy - x * y) / var if var > 1e-9 * w * self._xx else 0.0
        if slope <= 0.0 or y - slope * x < 0.0:  # too few sizes, or noise: through the origin
            slope, fixed = (y / x if x else 0.0), 0.0
        else:
            fixed = (y - slope * x) / w
        self.ns_per_token, self.fixed_ns = slope, fixed

    def to_run(self, group: Group, now: int) -> float:
        """Tokens `group` still has to run (the fixed cost counted as tokens)."""
        got = self._sent.get(group.index)
        left = 0.0
        for b in group.in_flight:
            if got is None or got[0] is not b or not self.ns_per_token:
                left += b.num_tokens
                continue
            total_ns = self.fixed_ns + self.ns_per_token * got[1]
            left += max(0.0, total_ns - (now - got[2])) / self.ns_per_token
        return left

    def share(self, group: int, groups: Sequence[Group], pending_tokens: int) -> int | None:
        """The tokens `group` should take now; None (all it can) when it is the only usable
        group, or when the part it would leave costs less than a forward's fixed cost."""
        usable = [g for g in groups if g.usable]
        if len(usable) < 2:
            return None
        now = self.clock()
        others = sum(self.to_run(g, now) for g in usable if g.index != group)
        share = -int(-(pending_tokens + others) // len(usable))
        if self.ns_per_token and (pending_tokens - share) * self.ns_per_token < self.fixed_ns:
            return None  # what it would leave is not worth another forward's fixed cost
        return share
