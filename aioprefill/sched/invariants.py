"""The scheduler's invariants, recounted from scratch (`Scheduler.check_invariants`), from plain
data: the counters, the queue, the staged batch and the batches in flight (never the Scheduler
itself, which calls this).

One quick pass, run after every engine event in the soak and fault tests
(`AIOPREFILL_CHECK_INVARIANTS=1`); the detailed report is built only once something is off.
The counters' meaning is in `aioprefill.sched.scheduler`'s docstring; the prefix cache's (every
slot free, pinned or in the LRU; pins equal to what the batches in flight hold) in
`aioprefill.sched.prefix.index`.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

from aioprefill.sched.units import InFlight, Request

__all__ = ["Counts", "recount"]


class Counts(NamedTuple):
    """The scheduler's three counters, as it holds them."""

    num_pending: int
    pending_tokens: int
    num_in_flight: int


def recount(
    counts: Counts, pending: list[Request], staged: list[Request], in_flight: list[InFlight]
) -> None:
    """Raise AssertionError naming the counter that is off (the prefix cache's index checks
    itself: `PrefixCache.check`)."""
    ids: set[int] = set()
    tokens = 0
    well_formed = True
    for r in itertools.chain(staged, pending):
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
        or counts.num_pending != queued
        or counts.pending_tokens != tokens
        or counts.num_in_flight != len(ids)
        or any(r.next_pos or r.worker >= 0 for r in staged)
    ):
        raise AssertionError(
            f"scheduler invariants broken: num_pending {counts.num_pending} (recounted "
            f"{queued}), pending_tokens {counts.pending_tokens} ({tokens}), num_in_flight "
            f"{counts.num_in_flight} ({len(ids)}), well formed: {well_formed}; queue: "
            f"{list(itertools.chain(staged, pending))!r:.2000}"
        )
