"""The scheduler's invariants, recounted from scratch (`Scheduler.check_invariants`).

One quick pass, run after every engine event in the soak and fault tests
(`AIOPREFILL_CHECK_INVARIANTS=1`); the detailed report is built only once something is off.
The counters' meaning is in `aioprefill.sched.scheduler`'s docstring; the prefix cache's (every
slot free, pinned or in the LRU; pins equal to what the batches in flight hold) in
`aioprefill.sched.prefix.index`.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aioprefill.sched.scheduler import InFlight, Scheduler

__all__ = ["recount"]


def recount(sched: Scheduler, in_flight: list[InFlight]) -> None:
    """Raise AssertionError naming the counter (or the cache index) that is off."""
    ids: set[int] = set()
    tokens = 0
    well_formed = True
    for r in itertools.chain(sched.staged.requests, sched.pending):
        if r.cancelled:
            continue
        ids.add(r.request_id)
        tokens += r.num_tokens - r.next_pos
        if not 0 <= r.next_pos < r.num_tokens or (r.chunk_in_flight and r.worker < 0):
            well_formed = False
    queued = len(ids)
    for batch in in_flight:
        chunks = batch.chunks
        if len(chunks) > 1 and any(c.end != c.request.num_tokens for c in chunks[:-1]):
            well_formed = False  # a middle chunk must ride last: `release` relies on it
        for c in chunks:
            r = c.request
            if c.end > r.next_pos or (c.cached and c.start != c.cached):
                well_formed = False
            if r.cancelled or r.request_id in ids:
                continue
            h = r.handle  # live unless the engine resolved it (a cancel is the caller's)
            if h is None or not h.done() or h.cancelled():
                ids.add(r.request_id)
    if (
        not well_formed
        or sched.num_pending != queued
        or sched.pending_tokens != tokens
        or sched.num_in_flight != len(ids)
        or any(r.next_pos or r.worker >= 0 for r in sched.staged.requests)
    ):
        raise AssertionError(
            f"scheduler invariants broken: num_pending {sched.num_pending} (recounted "
            f"{queued}), pending_tokens {sched.pending_tokens} ({tokens}), num_in_flight "
            f"{sched.num_in_flight} ({len(ids)}), well formed: {well_formed}; queue: "
            f"{list(itertools.chain(sched.staged.requests, sched.pending))!r:.2000}"
        )
    if sched.cache is not None:
        sched.cache.check(itertools.chain((b.pins for b in in_flight), [sched.staged.pins()]))
