"""Batch forming: pure bookkeeping over plain data, no asyncio, no I/O, no writes to requests.

*What* goes into a batch is the same for every dispatch policy (`take_batch`): first come,
first served within `max_batch_tokens` and `max_batch_size`. A prompt longer than
`max_batch_tokens` is split into chunks that run over consecutive forwards on one worker group
(which keeps its KV cache between them). When short requests wait behind such a prompt, they get
up to half of each forward's token budget, so a 32k-token prompt does not hold everyone behind
it for its whole duration; alone, it takes the full budget.

These functions only *propose*: they never change a `Request`. The `Scheduler` marks a batch's
requests dispatched once the pool has accepted it, so a full ring needs no rollback of fields.
`Columns` is the one place where a request's wire columns are produced.

Expert-parallel ranks run different batches but step together: each MoE layer exchanges tokens
between them, so every rank must run every step, and a rank with no work gets an empty batch
(only when a peer got work: with nothing pending, no step at all). `split_step` decides who
runs what in the next step: late binding (a request goes to whichever rank has room when the
step forms) and balance by tokens (the step lasts as long as its fullest rank), within the
usual batch budgets, first come first served.
"""

from __future__ import annotations

import struct
from collections import deque
from typing import Any

from aioprefill.core import Budget, Chunk, Request
from aioprefill.outputs import option_columns
from aioprefill.protocol import FLAG_FIRST_CHUNK, FLAG_LAST_CHUNK, PrefillBatch

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


class Columns:
    """The per-request wire columns of one batch, appended as requests join it.

    Whole prompts leave `start_pos`/`flags` as None (the packer fills the constant), so the
    common case appends two references per request. A new per-request option is one more
    column here and in `pack`. Output options (`aioprefill.outputs`) are kept sparse, as
    (position, Outputs) for the requests that have any: None while nobody in the batch does.
    """

    __slots__ = ("flags", "ids", "num_tokens", "outputs", "start_pos", "token_parts")

    def __init__(self, *, whole: bool = True) -> None:
        self.ids: list[int] = []
        self.token_parts: list[bytes] = []
        self.start_pos: list[int] | None = None if whole else []
        self.flags: list[int] | None = None if whole else []
        self.outputs: list[tuple[int, Any]] | None = None
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self.ids)

    def add_whole(self, req: Request) -> None:
        self.ids.append(req.request_id)
        self.token_parts.append(req.tokens)
        self.num_tokens += req.num_tokens
        if req.outputs is not None:
            self._add_outputs(req.outputs)

    def _add_outputs(self, outputs: Any) -> None:
        if self.outputs is None:
            self.outputs = []
        self.outputs.append((len(self.ids) - 1, outputs))

    def add_chunk(self, req: Request, start: int, end: int) -> None:
        assert self.start_pos is not None and self.flags is not None
        self.ids.append(req.request_id)
        whole = start == 0 and end == req.num_tokens
        self.token_parts.append(req.tokens if whole else req.tokens[4 * start : 4 * end])
        self.start_pos.append(start)
        self.flags.append(
            (FLAG_FIRST_CHUNK if start == 0 else 0)
            | (FLAG_LAST_CHUNK if end == req.num_tokens else 0)
        )
        self.num_tokens += end - start
        if req.outputs is not None:
            self._add_outputs(req.outputs)

    @classmethod
    def of_chunks(cls, chunks: list[Chunk]) -> Columns:
        cols = cls(whole=False)
        for c in chunks:
            cols.add_chunk(c.request, c.start, c.end)
        return cols

    def pack(self, batch_id: int, free_ids: list[int], sent_ns: int) -> PrefillBatch:
        options = None if self.outputs is None else option_columns(len(self.ids), self.outputs)
        return make_prefill_batch(
            batch_id,
            self.ids,
            self.token_parts,
            self.start_pos,
            self.flags,
            free_ids,
            sent_ns,
            options,
        )


def take_batch(pending: deque[Request], worker: int, budget: Budget) -> list[Chunk]:
    """Remove and return the next batch for group `worker`, first come first served.

    Skips (and drops) cancelled requests; skips requests pinned to another group or whose
    previous chunk is still running, leaving them in place. Stops at the first short request
    that does not fit, so no request is overtaken by a later one of its size class. Requests
    whose last chunk is in the batch leave `pending`; the others stay at their position.
    Changes no request: the caller marks the chunks sent once they are.
    """
    chunks: list[Chunk] = []
    kept: list[Request] = []  # requests looked at but left in the queue, in their order
    tokens = 0
    long_req: Request | None = None
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
        n = req.num_tokens
        if n > long_threshold:
            kept.append(req)
            if long_req is None:
                long_req = req  # its chunk takes what the short requests leave
            continue
        # Short requests behind a long prompt get at most half of the budget.
        if tokens + n > (max_tokens if long_req is None else max_tokens - max_tokens // 2):
            kept.append(req)
            break
        chunks.append(Chunk(req, 0, n))
        tokens += n
    if long_req is not None:
        size = min(long_req.remaining, max_tokens - tokens)
        if size > 0:
            start = long_req.next_pos
            chunks.append(Chunk(long_req, start, start + size))
            if size == long_req.remaining:
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
        """Stage a whole prompt if it is short and fits the budget; False otherwise."""
        if (
            len(self.requests) >= budget.max_batch_size
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


def make_prefill_batch(
    batch_id: int,
    request_ids: list[int],
    token_parts: list[bytes],
    start_pos: list[int] | None,
    flags: list[int] | None,
    free_ids: list[int],
    sent_ns: int,
    options: tuple[bytes, bytes, list[str]] | None = None,
) -> PrefillBatch:
    """Pack per-request columns into a PrefillBatch (`token_parts`: int32 bytes per request).

    `start_pos` / `flags` None mean every request is a whole prompt. `struct.pack` over Python
    ints beats building NumPy arrays for the small batches that dominate the hot path, and
    costs a few microseconds for a 256-request batch. `options`: the (options, top_k,
    kv_names) columns from `aioprefill.outputs.option_columns`, None when nobody asked.
    """
    n = len(request_ids)
    offsets = [0]
    total = 0
    for part in token_parts:
        total += len(part) >> 2
        offsets.append(total)
    msg = PrefillBatch(
        batch_id=batch_id,
        request_ids=struct.pack(f"<{n}q", *request_ids),
        offsets=struct.pack(f"<{n + 1}i", *offsets),
        tokens=b"".join(token_parts),
        start_pos=bytes(4 * n) if start_pos is None else struct.pack(f"<{n}i", *start_pos),
        flags=_WHOLE_PROMPT * n if flags is None else bytes(flags),
        free_ids=struct.pack(f"<{len(free_ids)}q", *free_ids) if free_ids else b"",
        sent_ns=sent_ns,
    )
    if options is not None:
        msg.options, msg.top_k, msg.kv_names = options
    return msg


_WHOLE_PROMPT = bytes([FLAG_FIRST_CHUNK | FLAG_LAST_CHUNK])
