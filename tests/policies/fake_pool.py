"""A worker pool of plain data, and the engine's glue around a policy, for policy unit tests.

`FakePool` records every batch it is sent and holds at most `capacity` batches per group (the
ring): one more send finds it full. `Harness` drives a real `Scheduler` and a real policy the
way `Engine` does (arrival, early answer, forward-done, timer, cancel), checking the
scheduler's invariants after every event. No processes, no rings, no event loop.
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass, field

from aioprefill.sched.batching import Budget, Chunk, Columns, Request
from aioprefill.sched.policies import DispatchPolicy, policy_class
from aioprefill.sched.prefix import PrefixCache
from aioprefill.sched.scheduler import Scheduler


@dataclass(eq=False)
class FakeBatch:
    group: int
    ids: list[int]
    spans: list[tuple[int, int]]  # (start, end) per request: the chunk it carries
    backlogged: bool
    chunks: list[Chunk] = field(default_factory=list)
    cache: tuple[bytes, ...] | None = None  # the prefix cache columns it carried
    pins: object = None
    answer: object = None

    @property
    def num_tokens(self) -> int:
        return sum(e - s for s, e in self.spans)


@dataclass(eq=False)
class FakeGroup:
    index: int
    capacity: int = 1 << 30  # batches its ring holds
    ready: bool = True
    ring_full: bool = False
    in_flight: deque[FakeBatch] = field(default_factory=deque)
    freed: list[int] = field(default_factory=list)
    cache_blocks: int = 0  # prefix cache slots (with Harness(cache_blocks=...))
    block_bytes: int = 64
    generation: int = 1

    @property
    def usable(self) -> bool:
        return self.ready and not self.ring_full


class FakePool:
    def __init__(self, num_groups: int, capacity: int = 1 << 30, cache_blocks: int = 0) -> None:
        self.slots = [FakeGroup(i, capacity, cache_blocks=cache_blocks) for i in range(num_groups)]
        self.sent: list[FakeBatch] = []

    def send(self, group: int, columns: Columns, *, backlogged: bool) -> FakeBatch | None:
        g = self.slots[group]
        if len(g.in_flight) >= g.capacity:
            g.ring_full = True
            return None
        starts = columns.start_pos if columns.start_pos is not None else [0] * len(columns)
        spans = [
            (s, s + (len(part) >> 2)) for s, part in zip(starts, columns.token_parts, strict=True)
        ]
        batch = FakeBatch(group, list(columns.ids), spans, backlogged, cache=columns.cache)
        g.in_flight.append(batch)
        self.sent.append(batch)
        return batch

    def in_flight_batches(self) -> list[FakeBatch]:
        return [b for g in self.slots for b in g.in_flight]


class FakeTimer:
    def __init__(self) -> None:
        self.due_ns: int | None = None

    @property
    def armed(self) -> bool:
        return self.due_ns is not None

    def arm_at(self, due_ns: int) -> None:
        self.due_ns = due_ns


class Harness:
    """The engine's side of the policy contract, on plain data."""

    def __init__(
        self,
        policy: str,
        *,
        groups: int = 1,
        capacity: int = 1 << 30,
        max_batch_tokens: int = 100,
        max_batch_size: int = 8,
        batch_timeout_ms: float = 10.0,
        expert_parallel: bool = False,
        cache_blocks: int = 0,
        block_tokens: int = 4,
    ) -> None:
        cls = policy_class(policy, expert_parallel=expert_parallel)
        self.pool = FakePool(groups, capacity, cache_blocks)
        cache = PrefixCache(self.pool.slots, block_tokens) if cache_blocks else None
        budget = Budget(max_batch_tokens, max_batch_size)
        self.sched = Scheduler(budget, staging=cls.staging, cache=cache)
        self.timer = FakeTimer()
        self.policy: DispatchPolicy = cls(
            self.sched, self.pool, self.timer, batch_timeout_ms=batch_timeout_ms
        )
        self.answered: list[int] = []
        self._now = 0
        share = getattr(self.policy, "share", None)
        if share is not None:  # the fair share times forwards on the harness's clock
            share.clock = lambda: self._now

    def check(self) -> None:
        self.sched.check_invariants(self.pool.in_flight_batches())

    def arrive(
        self, num_tokens: int = 0, *, at_ns: int | None = None, ids: list[int] | None = None
    ) -> Request:
        """A request of `num_tokens` zeros, or of the token `ids` given."""
        self._now = self._now + 1 if at_ns is None else at_ns
        tokens = bytes(4 * num_tokens) if ids is None else struct.pack(f"<{len(ids)}i", *ids)
        req = self.sched.submit(tokens, self._now, None)
        self.policy.on_arrival()
        self.check()
        return req

    def done(self, group: int, *, early: bool = False, at_ns: int | None = None) -> FakeBatch:
        """`group` answers the batch at the head of its ring (first, `early`: the peek), at
        `at_ns` on the harness's clock if given."""
        if at_ns is not None:
            self._now = at_ns
        g = self.pool.slots[group]
        if early and self.policy.early and len(g.in_flight) == 1 and self.sched.num_pending:
            self.sched.release(g.in_flight[0].chunks)
            self.policy.on_answer_waiting(group)
        batch = g.in_flight.popleft()
        g.ring_full = False
        free = self.sched.release(batch.chunks)
        self.sched.unpin(batch)
        if free >= 0:
            g.freed.append(free)
        if self.sched.num_pending:
            self.policy.on_forward_done(group)
        finished = [c.request for c in batch.chunks if c.is_last and not c.request.cancelled]
        self.answered += [r.request_id for r in finished]
        self.sched.finish(len(finished))
        self.check()
        return batch

    def fire_timer(self) -> None:
        assert self.timer.due_ns is not None
        self._now = max(self._now, self.timer.due_ns)
        self.timer.due_ns = None
        self.policy.on_timer()
        self.check()

    def cancel(self, req: Request) -> None:
        group = self.sched.cancel(req)
        if group >= 0:
            self.pool.slots[group].freed.append(req.request_id)
        self.check()

    def sent_ids(self) -> list[list[int]]:
        return [b.ids for b in self.pool.sent]
