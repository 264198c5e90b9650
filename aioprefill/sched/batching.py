"""Batch forming: pure bookkeeping over plain data, no asyncio, no I/O, no writes to requests.

*What* goes into a batch is the same for every dispatch policy (`take_batch`): first come,
first served within `max_batch_tokens` and `max_batch_size` (and, with several groups under
policy ``forward``, the group's fair share of the pending work: `policies/share.py`). A prompt
longer than `max_batch_tokens` is split into chunks that run over consecutive forwards on one
worker group (which keeps its KV cache between them); short requests behind it get up to half
of each forward's budget, so it does not hold everyone for its whole duration.

These functions only *propose*: they never change a `Request`. The `Scheduler` marks a batch's
requests dispatched once the pool has accepted it, so a full ring needs no rollback of fields.
`Columns` (`aioprefill.sched.columns`) is the one place where a request's wire columns are produced.

With the prefix cache, `take_batch` gets the group's `BatchPlan`: a request's first chunk costs
only its uncached tokens (blocks the group holds, or that a request ahead of it in the batch
writes), and with several groups the plan may leave a request to its home, the group holding
more of its prompt (`aioprefill.sched.prefix.cache`). The staged batch is formed before its group is
known: with several groups it takes only prompts without a full block; with one group also
those whose first block it does not hold, their reads and writes planned as they join.

Expert-parallel ranks step together (each MoE layer exchanges tokens): every rank runs every
step, an empty batch if it got no work (nothing pending: no step). `split_step` decides who
runs what: late binding (a request goes to whichever rank has room when the step forms),
balanced by tokens, within the batch budgets, first come first served.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from aioprefill.sched.columns import Columns, make_prefill_batch
from aioprefill.sched.prefix.plan import Pins
from aioprefill.sched.units import Budget, Chunk, Request

if TYPE_CHECKING:
    from aioprefill.sched.prefix.cache import PrefixCache
    from aioprefill.sched.prefix.plan import BatchPlan

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
    pending: deque[Request],
    worker: int,
    budget: Budget,
    plan: BatchPlan | None = None,
    share: int | None = None,
) -> list[Chunk]:
    """Remove and return the next batch for group `worker`, first come first served.

    Skips (and drops) cancelled requests, and leaves in place those pinned to another group or
    whose previous chunk still runs. Stops at the first short request that does not fit (no
    later one of its size class overtakes it), or, with a `share` (tokens:
    `policies/share.py`), at the first that would put the batch's midpoint past it (one joins
    at least). Requests whose last chunk is in the batch leave `pending`, the others keep their
    place; no request is changed. With a `plan` (the group's prefix cache), a first chunk costs
    its uncached tokens, its reads and writes are placed, and requests homed elsewhere wait.
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
        if tokens + n > (max_tokens if long_req is None else max_tokens - max_tokens // 2) or (
            share is not None and chunks and 2 * tokens + n >= 2 * share
        ):
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
    return chunks


class StagedBatch:
    """The next batch of the ``forward`` policy, assembled while the workers are busy.

    Whole short prompts join it as they arrive (only while nothing else waits, so it is always
    the head of the queue in arrival order, exactly what `take_batch` would pick), with their
    wire columns ready. When a forward ends, handing it over costs O(1) Python work however
    many requests it holds: the per-request bookkeeping happens at arrival, not in the bubble.
    With `cache` (the prefix cache of a single group: no routing to do), a prompt with full
    blocks joins it too when that group holds none of them (`hashed`), and from the first such
    prompt on every request's reads and writes are planned as it joins, so traffic that reuses
    nothing keeps this O(1) hand-off (`planned`). A prompt the group holds the first block of
    goes to `take_batch`, which counts only its uncached tokens in the budget.
    """

    __slots__ = (
        "cache",
        "chunks",
        "columns",
        "cost",
        "epoch",
        "firsts",
        "generation",
        "has_cancelled",
        "hashed",
        "plan",
        "requests",
    )

    def __init__(self, cache: PrefixCache | None = None) -> None:
        self.requests: list[Request] = []
        self.columns = Columns()
        self.has_cancelled = False
        self.cache = cache  # the one group's prefix cache (None: no prompt with a block joins)
        self.hashed = False  # some prompt in it has blocks
        # Planned as they join (one group: its plan cannot be another's): the plan, the index
        # epoch it was made in (a group restart makes it void) and each request's chunk.
        self.plan: BatchPlan | None = None
        self.epoch = self.generation = 0  # (and of the group's start it was made for)
        self.chunks: list[Chunk] = []
        self.firsts: set[int] = set()  # first blocks of its prompts (written by its plan)
        self.cost = 0  # tokens it computes (what the budget counts)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return self.columns.num_tokens

    @property
    def ids(self) -> list[int]:
        return self.columns.ids

    def try_add(self, req: Request, budget: Budget) -> bool:
        """Stage a whole prompt if it is short, fits the budget and has no block the prefix
        cache holds (or, without `cache`, none it could hold); False otherwise."""
        if len(self.requests) >= budget.max_batch_size or budget.is_long(req):
            return False  # (before its blocks are hashed: they may wait)
        hashes = req.hashes
        if hashes and (
            self.cache is None
            or (hashes[0] in self.cache.indexes[0].slot_of and hashes[0] not in self.firsts)
        ):
            return False  # its cost and its reads depend on the group: `take_batch` forms it
        n = req.num_tokens  # its cost: what it computes (a staged request's writes read)
        if hashes and self.plan is not None:
            n -= self.plan.lookup(req)
        if self.cost + n > budget.max_batch_tokens:
            return False
        self._append(req)
        return True

    def _append(self, req: Request) -> None:
        self.requests.append(req)
        self.columns.add_whole(req)
        if req.hashes:
            self.hashed = True
            self.firsts.add(req.hashes[0])
            if self.plan is None and self.cache is not None:  # plan from here on
                plan = self.cache.plan(0)
                if plan is not None:
                    self.plan, self.epoch = plan, plan.index.epoch
                    self.generation = self.cache.slots[0].generation
                    self.chunks = [_place(plan, r) for r in self.requests[:-1]]
        if self.plan is None:
            self.cost += req.num_tokens
            return
        c = _place(self.plan, req)
        self.chunks.append(c)
        self.cost += c.end - c.start

    def planned(self) -> tuple[BatchPlan | None, Columns, list[Chunk] | None]:
        """The plan, columns and chunks to send the batch with: the plan made as requests joined
        if still valid and nothing is read (O(1): its columns were built as they joined), else
        the group's plan remade with every request placed (None: the group keeps no cache now).
        The caller commits the plan, or aborts it (and resets `columns.cache`) if the batch is
        not sent. Only with `cache` (one group: group 0)."""
        plan, chunks, cache = self.plan, self.chunks, self.cache
        assert cache is not None
        gen = cache.slots[0].generation  # (the common case skips the block: nothing read)
        if plan is None or plan.hit or self.epoch != plan.index.epoch or self.generation != gen:
            if cache.index_of(0) is None:  # the group keeps no cache now
                self.clear_plan()
                return None, self.columns, None
            if plan is None or self.epoch != plan.index.epoch:  # (the group restarted)
                plan = cache.plan(0)
                assert plan is not None
                chunks = [_place(plan, r) for r in self.requests]
        self.plan, self.chunks = None, []
        cols = Columns.of_chunks(chunks) if plan.hit else self.columns
        cols.cache = plan.columns()  # (O(1): the plan's own wire buffers)
        return plan, cols, chunks

    def pins(self) -> Pins | None:
        """The slots the plan made as requests joined holds (for the invariant check)."""
        plan = self.plan
        return None if plan is None else Pins(0, self.epoch, plan.pins, plan.new)

    def note_cancelled(self) -> None:
        self.has_cancelled = True

    def drop_cancelled(self) -> None:
        """Forget cancelled requests (rare, so done lazily, just before the batch is sent)."""
        if self.has_cancelled:
            live = [r for r in self.requests if not r.cancelled]
            self.clear()
            for r in live:
                self._append(r)

    def clear_plan(self) -> None:
        """Give back the plan made as requests joined (the batch was not sent with it)."""
        plan = self.plan
        if plan is not None and self.epoch == plan.index.epoch:
            plan.abort()
        self.plan, self.chunks = None, []

    def clear(self) -> list[Request]:
        """Empty the batch (its plan, if not sent, given back); return the requests it held."""
        self.clear_plan()
        requests = self.requests
        self.requests = []
        self.columns = Columns()
        self.has_cancelled = False
        self.hashed = False
        self.firsts = set()
        self.cost = 0
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


def _place(plan: BatchPlan, req: Request) -> Chunk:
    return plan.place(req, 0, req.num_tokens, plan.lookup(req))


def is_full(num_requests: int, num_tokens: int, budget: Budget) -> bool:
    """Whether a pending batch already fills the budget (the `timeout` policy seals it)."""
    return num_requests >= budget.max_batch_size or num_tokens >= budget.max_batch_tokens


def split_step(pending: deque[Request], num_ranks: int, budget: Budget) -> list[list[Chunk]]:
    """Remove and return each rank's chunks for the next step.

    Each request goes to the rank it is pinned to (a chunked prompt's KV cache lives there),
    else to the rank with the fewest tokens so far that has room for it. A long prompt (over
    `max_batch_tokens`, chunking on) sends one chunk per step, as large as its rank has room
    for, at most one long prompt per rank. The first short unpinned request that no rank has
    room for ends the step (first come first served). Skips (and drops) cancelled requests and
    those whose previous chunk still runs. Requests whose last chunk is taken leave `pending`.
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
