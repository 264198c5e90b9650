"""`Scheduler`: the pending queue, the staged batch and the request counters. No asyncio.

It is the only code that changes a `Request` and the only writer of the three counters, whose
meaning `check_invariants()` spells out:

- `num_pending`: accepted requests not cancelled whose prompt is not fully dispatched (each is
  in `pending` or in the staged batch); `pending_tokens`: the tokens they still have to send;
- `num_in_flight`: accepted requests whose caller still waits (pending, or in some batch).

A dispatch policy decides *where* and *when* a batch goes; the scheduler forms it (`dispatch`,
`dispatch_alone`), hands its columns to the pool (`BatchSink.send`) and marks its requests
sent only once the pool took it, so a full ring needs no rollback of request fields.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from collections.abc import Iterable
from typing import Any, ClassVar, Protocol

from aioprefill.sched.batching import StagedBatch, split_step, take_batch
from aioprefill.sched.columns import Columns
from aioprefill.sched.invariants import Counts, recount
from aioprefill.sched.prefix.cache import PrefixCache
from aioprefill.sched.prefix.plan import BatchPlan
from aioprefill.sched.units import Budget, Chunk, InFlight, Request
from aioprefill.wire.protocol import BatchFailed

__all__ = ["BatchSink", "InFlight", "Scheduler"]


class BatchSink(Protocol):
    """Where formed batches go: the `WorkerPool`, or a fake one in tests."""

    def send(self, group: int, columns: Columns, *, backlogged: bool) -> InFlight | None:
        """Write one batch to every rank of `group`; None (nothing written) if a ring is full."""


class Scheduler:
    # After every engine event, check the invariants (tests turn this on; off costs one lookup).
    checking: ClassVar[bool] = os.environ.get("AIOPREFILL_CHECK_INVARIANTS", "") == "1"

    def __init__(self, budget: Budget, *, staging: bool, cache: PrefixCache | None = None) -> None:
        self.budget = budget
        self.staging = staging  # policy "forward": keep the next batch's columns ready
        self.cache = cache  # every group's prefix cache index (None: off)
        self.pending: deque[Request] = deque()
        self.staged = StagedBatch(cache if cache and len(cache.slots) == 1 else None)
        self.num_pending = 0
        self.pending_tokens = 0
        self.num_in_flight = 0
        self._ids = itertools.count(1)

    # ---- arrivals and departures ----------------------------------------------------------

    def submit(
        self,
        tokens: bytes,
        submitted_ns: int,
        handle: Any,
        outputs: Any = None,
        tag: str | int | None = None,
        salt: str | None = None,
    ) -> Request:
        """Accept a prompt: it joins the staged batch (head of the queue) or the queue.
        `outputs`: its `aioprefill.wire.outputs.Outputs`, when it asked for more than a token;
        `tag`: the caller's request_id; `salt`: its cache_salt (hashed into its blocks)."""
        req = Request(next(self._ids), tokens, submitted_ns, handle, outputs=outputs, tag=tag)
        if self.cache is not None:  # its blocks hashed when first needed
            self.cache.defer_hashes(req, salt)
        if not (self.staging and not self.pending and self.staged.try_add(req, self.budget)):
            self.pending.append(req)
        self.num_pending += 1
        self.pending_tokens += req.num_tokens
        self.num_in_flight += 1
        return req

    def cancel(self, req: Request) -> int:
        """The caller went away: drop `req` wherever it is (it leaves the queue lazily).
        Returns the group holding its KV cache between two chunks (to be freed), else -1."""
        req.cancelled = True
        self.num_in_flight -= 1
        if req.next_pos < req.num_tokens:
            self.num_pending -= 1
            self.pending_tokens -= req.remaining
            if req.next_pos == 0:
                self.staged.note_cancelled()  # it may be staged: dropped before the next send
        if req.worker >= 0 and 0 < req.next_pos < req.num_tokens and not req.chunk_in_flight:
            return req.worker
        return -1

    def drop(self, req: Request) -> None:
        """`req` failed: forget any part still queued (the engine fails its caller)."""
        if req.next_pos < req.num_tokens and not req.cancelled:
            self.num_pending -= 1
            self.pending_tokens -= req.remaining
            if req.next_pos == 0:
                self.staged.note_cancelled()
        req.cancelled = True

    def finish(self, count: int) -> None:
        """`count` callers got their answer or their error."""
        self.num_in_flight -= count

    # ---- dispatch -------------------------------------------------------------------------

    def dispatch(
        self, group: int, sink: BatchSink, *, backlogged: bool, share: int | None = None
    ) -> bool:
        """Send the next FCFS batch for `group`: the staged one if any (O(1) before the write),
        unless it is over `share`, the tokens `group` should take (`take_batch`)."""
        staged = self.staged
        if staged.requests and share is not None and staged.cost > share:
            self.pending.extendleft(reversed(staged.clear()))
        if staged.requests:
            if staged.has_cancelled:
                staged.drop_cancelled()
            if staged.requests:
                plan, cols, chunks = None, staged.columns, None
                if staged.hashed:  # (the prefix cache of the one group, group 0)
                    plan, cols, chunks = staged.planned()
                batch = sink.send(group, cols, backlogged=backlogged)
                if batch is None:
                    if plan is not None:
                        plan.abort()
                        staged.columns.cache = None
                    return False
                batch.chunks = self._commit_staged(staged, chunks)
                if plan is not None:
                    batch.pins = plan.commit()
                return True
        plan = self._plan(group, sink, route=True)
        chunks = take_batch(self.pending, group, self.budget, plan, share)
        if not chunks:
            return False
        if self._send(group, sink, chunks, plan, backlogged):
            return True
        self._put_back(chunks)
        return False

    def _plan(self, group: int, sink: BatchSink, *, route: bool = False) -> BatchPlan | None:
        if self.cache is None:
            return None
        return self.cache.plan(group, route=route)

    def _send(
        self,
        group: int,
        sink: BatchSink,
        chunks: list[Chunk],
        plan: BatchPlan | None,
        backlogged: bool,
    ) -> bool:
        """Send `chunks` (their cache instructions from `plan`) and mark them sent; False
        (the plan undone) when a ring was full."""
        cols = Columns.of_chunks(chunks)
        if plan is not None:
            cols.cache = plan.columns()
        batch = sink.send(group, cols, backlogged=backlogged)
        if batch is None:
            if plan is not None:
                plan.abort()
            return False
        batch.chunks = chunks
        if plan is not None:
            batch.pins = plan.commit()
        self._mark_sent(chunks, group)
        if self.cache is not None:  # the next batch's prompts hashed while this one runs
            self.cache.hash_ahead(self.pending, self.budget)
        return True

    def dispatch_step(self, sink: BatchSink, num_ranks: int, *, always: bool = False) -> bool:
        """Send one expert-parallel step: the pending work split across the ranks
        (`split_step`), an empty batch to each rank that got none. With no work at all nothing
        is sent, unless `always` (the ep-timer baseline's empty steps)."""
        steps = split_step(self.pending, num_ranks, self.budget)
        if not always and not any(steps):
            return False
        for rank, chunks in enumerate(steps):
            plan = self._plan(rank, sink) if chunks else None  # each rank its own cache
            if plan is not None:
                chunks = [plan.place(c.request, c.start, c.end, _first(plan, c)) for c in chunks]
            if not self._send(rank, sink, chunks, plan, True):
                # A rank's ring had no room: not in lockstep (one step in flight at most), so
                # the ranks are broken; these chunks wait for the group's restart.
                self._put_back([c for later in steps[rank:] for c in later])
                return False
        return True

    def _put_back(self, chunks: list[Chunk]) -> None:
        """Undo what `take_batch` / `split_step` removed from the queue for a batch that was
        not sent: requests whose last chunk it held go back to the head, in order (the others
        never left)."""
        for c in reversed(chunks):
            if c.is_last:
                self.pending.appendleft(c.request)

    def _commit_staged(self, staged: StagedBatch, chunks: list[Chunk] | None) -> list[Chunk]:
        num_tokens = staged.num_tokens  # (whole prompts: cached tokens included)
        requests = staged.clear()
        chunks = [Chunk(r, 0, r.num_tokens) for r in requests] if chunks is None else chunks
        for c in chunks:
            req = c.request
            req.next_pos = req.num_tokens
            req.num_chunks = 1
            req.cached_tokens = c.cached
        self.num_pending -= len(requests)
        self.pending_tokens -= num_tokens
        staged.refill(self.pending, self.budget)
        if self.cache is not None:  # the next batch's prompts hashed while this one runs
            self.cache.hash_ahead(self.pending, self.budget)
        return chunks

    def _mark_sent(self, chunks: list[Chunk], group: int) -> None:
        for c in chunks:
            req = c.request
            if c.start == c.cached:  # its first chunk computed
                req.cached_tokens = c.cached
            req.next_pos = c.end
            req.num_chunks += 1
            self.pending_tokens -= c.end - c.start + c.cached
            if c.end == req.num_tokens:
                self.num_pending -= 1
            else:
                req.worker = group
                req.chunk_in_flight = True

    def head(self) -> Request | None:
        """The first live request in the queue (cancelled ones at the head are dropped)."""
        pending = self.pending
        while pending:
            req = pending[0]
            if not req.cancelled:
                return req
            pending.popleft()
        return None

    def dispatch_alone(
        self, req: Request, group: int, sink: BatchSink, *, backlogged: bool
    ) -> bool:
        """Send the rest of `req` (the queue's head) to `group`, each chunk its own batch; on a
        full ring `req` stays at the head, from its first unsent chunk: False."""
        pending = self.pending
        pending.popleft()
        n = req.num_tokens
        size = self.budget.max_batch_tokens if self.budget.is_long(req) else n
        while req.next_pos < n:
            start = req.next_pos
            plan = self._plan(group, sink)
            cached = plan.lookup(req) if plan is not None and not start else 0
            end = min(start + cached + size, n)
            chunk = Chunk(req, start, end) if plan is None else plan.place(req, start, end, cached)
            if not self._send(group, sink, [chunk], plan, backlogged):
                pending.appendleft(req)  # at the head, from its first unsent chunk
                return False
            backlogged = True  # the next chunk queues behind this one
            if end < n:
                req.worker = group  # the rest must follow on the same group
                req.chunk_in_flight = False  # (eager: its chunks queue at the group in order)
        return True

    def oldest_waiting_ns(self) -> int | None:
        """Submission time of the oldest request that could ride the next batch."""
        if self.staged.requests:
            return self.staged.requests[0].submitted_ns
        for r in self.pending:
            if not r.cancelled and not r.chunk_in_flight:
                return r.submitted_ns
        return None

    # ---- answers and deaths ---------------------------------------------------------------

    def unpin(self, batch: InFlight) -> None:
        """A batch's answer (or failure) came back: the prefix cache slots it used may be
        evicted again (those it was to write forgotten if it failed)."""
        if batch.pins is not None:
            assert self.cache is not None
            self.cache.release(batch.pins, failed=isinstance(batch.answer, BatchFailed))
            batch.pins = None

    def release(self, chunks: list[Chunk]) -> int:
        """A batch's forward ended: a prompt it carried a middle chunk of may send its next.
        O(1): only a batch's last chunk can be a non-final one (`take_batch` appends the long
        prompt's chunk last; eager batches hold one chunk). Returns the id of a cancelled
        prompt whose KV cache the group must now drop, else -1."""
        if chunks:
            c = chunks[-1]
            req = c.request
            if c.end != req.num_tokens and c.end == req.next_pos:  # its latest chunk
                req.chunk_in_flight = False
                if req.cancelled:
                    return req.request_id
        return -1

    def pinned_to(self, group: int) -> list[Request]:
        """Queued requests whose KV cache lives on `group` (between two chunks)."""
        return [r for r in self.pending if r.worker == group and not r.cancelled]

    def lost_group(self, group: int) -> None:  # its prefix cache is gone: never read again
        if self.cache is not None:
            self.cache.drop(group)

    def retry(self, req: Request) -> bool:
        """Send `req` again from its first token; True if the caller must requeue it."""
        req.attempts += 1
        queued = req.next_pos < req.num_tokens  # still in `pending`, at its place
        if not queued:
            self.num_pending += 1
        self.pending_tokens += req.next_pos  # its tokens all go again
        req.next_pos = 0
        req.worker = -1
        req.chunk_in_flight = False
        req.num_chunks = 0
        req.cached_tokens = 0
        return not queued

    def requeue_first(self, requests: list[Request]) -> None:
        """Put retried requests at the head, before the staged ones (they are older)."""
        if requests and self.staged.requests:
            self.pending.extendleft(reversed(self.staged.clear()))
        self.pending.extendleft(reversed(requests))

    def drain(self) -> list[Request]:
        """Empty the queue and the staged batch; return the live requests they held."""
        requests = [r for r in (*self.staged.clear(), *self.pending) if not r.cancelled]
        self.pending.clear()
        return requests

    # ---- invariants -----------------------------------------------------------------------

    def check_invariants(self, in_flight: Iterable[InFlight]) -> None:
        """Recount the counters from the queue, the staged batch and the pool's batches, and
        the prefix cache's slots and pins (`aioprefill.sched.invariants`; AssertionError)."""
        batches = list(in_flight)
        counts = Counts(self.num_pending, self.pending_tokens, self.num_in_flight)
        recount(counts, list(self.pending), self.staged.requests, batches)
        if self.cache is not None:
            self.cache.check(itertools.chain((b.pins for b in batches), [self.staged.pins()]))


def _first(plan: BatchPlan, c: Chunk) -> int:
    """The tokens a chunk formed without the cache reads: its prompt's first chunk only."""
    return plan.lookup(c.request) if c.start == 0 else 0
