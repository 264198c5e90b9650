"""Batch forming: pure bookkeeping over plain data, no asyncio, no I/O, no writes to requests.

*What* goes into a batch is the same for every dispatch policy (`take_batch`): first come,
first served within `max_batch_tokens` and `max_batch_size`. A prompt longer than
`max_batch_tokens` is split into chunks that run over consecutive forwards on one worker group
(which keeps its KV cache between them). When short requests wait behind such a prompt, they get
up to half of each forward's token budget, so a 32k-token prompt does not hold everyone behind
it for its whole duration; alone, it takes the full budget.

These functions only *propose*: they never change a `Request`. The `Scheduler` marks a batch's
requests dispatched once the pool has accepted it, so a full ring needs no rollback of fields.
`Columns` (`aioprefill.columns`) is the one place where a request's wire columns are produced.

With the prefix cache, `take_batch` gets the group's `BatchPlan`: a request's first chunk costs
only its uncached tokens in the budget (blocks the group holds, or that a request ahead of it in
the same batch writes), and with several groups the plan may leave a request to a group that
holds more of its prompt (`aioprefill.prefix.cache` states the rule). The staged batch is formed
before its group is known, so it only takes prompts the cache cannot touch (no full block).

Expert-parallel ranks run different batches but step together: each MoE layer exchanges tokens
between them, so every rank must run every step, and a rank with no work gets an empty batch
(only when a peer got work: with nothing pending, no step at all). `split_step` decides who
runs what in the next step: late binding (a request goes to whichever rank has room when the
step forms) and balance by tokens (the step lasts as long as its fullest rank), within the
usual batch budgets, first come first served.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from aioprefill.columns import Columns, make_prefill_batch
from aioprefill.core import Budget, Chunk, Request

if TYPE_CHECKING:
    from aioprefill.prefix.plan import BatchPlan

__all__ = [
    "Budget",
    "Chunk",
    "Columns",
    "Request",
    "StagedBatch",
    "is_full",
    "make_prefill_batch",
    "split_step",
    "take_batch",
]


def take_batch(
    pending: deque[Request], worker: int, budget: Budget, plan: BatchPlan | None = None
) -> list[Chunk]:
    """Remove and return the next batch for group `worker`, first come first served.

    Skips (and drops) cancelled requests; skips requests pinned to another group or whose
    previous chunk is still running, leaving them in place. Stops at the first short request
    that does not fit, so no request is overtaken by a later one of its size class. Requests
    whose last chunk is in the batch leave `pending`; the others stay at their position.
    Changes no request: the caller marks the chunks sent once they are. With a `plan` (the
    group's prefix cache), a first chunk costs its uncached tokens and its reads and writes are
    placed; requests the plan leaves to another group stay queued, unless nothing else would
    keep this group busy.
    """
    chunks: list[Chunk] = []
    kept: list[Request] = []  # requests looked at but left in the queue, in their order
    tokens = 0
    long_req: Request | None = None
    long_cached = 0
    max_tokens = budget.max_batch_tokens
    max_size = budget.max_batch_size
    long_threshold = max_tokens if budget.chunked else 1 << 62
    popleft = pending.popleft
    while pending and len(chunks) < max_size - (long_req is not None):
        req = popleft()
        if req.cancelled:
            continue
        if req.chunk_in_flight or (req.worker >= 0 and req.worker != worker):
            kept.append(req)
            continue
        cached = 0
        if plan is not None and req.hashes and not req.next_pos:
            cached = plan.lookup(req)
            if plan.elsewhere(req, cached):
                kept.append(req)
                continue
        n = req.num_tokens - cached
        if n > long_threshold or req.next_pos:
            kept.append(req)
            if long_req is None:
                long_req, long_cached = req, cached  # its chunk takes what the others leave
            continue
        # Short requests behind a long prompt get at most half of the budget.
        if tokens + n > (max_tokens if long_req is None else max_tokens - max_tokens // 2):
            kept.append(req)
            break
        end = req.num_tokens
        chunks.append(Chunk(req, 0, end) if plan is None else plan.place(req, 0, end, cached))
        tokens += n
    if long_req is not None:
        start = long_req.next_pos
        if plan is not None and not start:  # again: the batch's writes may have changed it
            long_cached = plan.lookup(long_req)
        size = min(long_req.remaining - long_cached, max_tokens - tokens)
        if size > 0:
            end = start + long_cached + size
            chunks.append(
                Chunk(long_req, start, end)
                if plan is None
                else plan.place(long_req, start, end, long_cached)
            )
            if end == long_req.num_tokens:
                kept.remove(long_req)
    if kept:
        pending.extendleft(reversed(kept))
    if not chunks and plan is not None and plan.deferred and plan.patient:
        plan.patient = False  # nobody else keeps this group busy: it takes them after all
        return take_batch(pending, worker, budget, plan)
    return chunks


class StagedBatch:
    """The next batch of the ``forward`` policy, assembled while the workers are busy.

    Whole short prompts join it as they arrive (only while nothing else waits, so it is always
    the head of the queue in arrival order, exactly what `take_batch` would pick), with their
    wire columns ready. When a forward ends, handing it over costs O(1) Python work however
    many requests it holds: the per-request bookkeeping happens at arrival, not in the bubble.
    """

    __slots__ = ("columns", "has_cancelled", "requests")

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.columns = Columns()
        self.has_cancelled = False

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return self.columns.num_tokens

    @property
    def ids(self) -> list[int]:
        return self.columns.ids

    @property
    def token_parts(self) -> list[bytes]:
        return self.columns.token_parts

    def try_add(self, req: Request, budget: Budget) -> bool:
        """Stage a whole prompt if it is short, fits the budget and has no block the prefix
        cache could hold; False otherwise."""
        if (
            req.hashes  # its cost and its reads depend on the group: `take_batch` forms it
            or len(self.requests) >= budget.max_batch_size
            or self.columns.num_tokens + req.num_tokens > budget.max_batch_tokens
            or budget.is_long(req)
        ):
            return False
        self.requests.append(req)
        self.columns.add_whole(req)
        return True

    def note_cancelled(self) -> None:
        self.has_cancelled = True

    def drop_cancelled(self) -> None:
        """Forget cancelled requests (rare, so done lazily, just before the batch is sent)."""
        if self.has_cancelled:
            live = [r for r in self.requests if not r.cancelled]
            self.clear()
            self.requests = live
            for r in live:
                self.columns.add_whole(r)

    def clear(self) -> list[Request]:
        """Empty the batch; return the requests it held."""
        requests = self.requests
        self.requests = []
        self.columns = Columns()
        self.has_cancelled = False
        return requests

    def refill(self, pending: deque[Request], budget: Budget) -> None:
        """Move whole prompts from the head of `pending` into the batch while they fit."""
        while pending:
            req = pending[0]
            if req.cancelled:
                pending.popleft()
                continue
            if req.worker >= 0 or not self.try_add(req, budget):
                return
            pending.popleft()


def is_full(num_requests: int, num_tokens: int, budget: Budget) -> bool:
    """Whether a pending batch already fills the budget (the `timeout` policy seals it)."""
    return num_requests >= budget.max_batch_size or num_tokens >= budget.max_batch_tokens


def split_step(pending: deque[Request], num_ranks: int, budget: Budget) -> list[list[Chunk]]:
    """Remove and return each rank's chunks for the next step.

    Each request goes to the rank it is pinned to (a chunked prompt's KV cache lives there),
    else to the rank with the fewest tokens so far that has room for it. A long prompt (over
    `max_batch_tokens`, chunking on) sends one chunk per step, as large as its rank has room
    for, at most one long prompt per rank. The first short unpinned request that no rank has
    room for ends the step, so no request overtakes an earlier one of its size class. Skips
    (and drops) cancelled requests and skips those whose previous chunk still runs. Requests
    whose last chunk is taken leave `pending`; the others keep their place. Changes no
    request: the caller marks the chunks sent once they are.
    """
    max_tokens, max_size = budget.max_batch_tokens, budget.max_batch_size
    long_threshold = max_tokens if budget.chunked else 1 << 62
    loads = [0] * num_ranks
    has_long = [False] * num_ranks
    steps: list[list[Chunk]] = [[] for _ in range(num_ranks)]
    kept: list[Request] = []
    everyone = range(num_ranks)
    popleft = pending.popleft
    while pending:
        req = popleft()
        if req.cancelled:
            continue
        if req.chunk_in_flight:
            kept.append(req)
            continue
        is_long = req.num_tokens > long_threshold
        remaining = req.num_tokens - req.next_pos
        ranks = (req.worker,) if 0 <= req.worker < num_ranks else everyone
        placed = False
        for r in sorted(ranks, key=loads.__getitem__):
            if len(steps[r]) >= max_size:
                continue
            room = max_tokens - loads[r]
            if is_long:
                if has_long[r] or room <= 0:
                    continue
                size = min(remaining, room)
                has_long[r] = True
            elif remaining <= room:
                size = remaining
            else:
                continue
            steps[r].append(Chunk(req, req.next_pos, req.next_pos + size))
            loads[r] += size
            if size < remaining:
                kept.append(req)  # more chunks to come: it keeps its place
            placed = True
            break
        if not placed:
            kept.append(req)
            if not is_long and ranks is everyone:
                break  # FCFS: nothing behind it may take its place
    if kept:
        pending.extendleft(reversed(kept))
    return steps
