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
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aioprefill.outputs import option_columns
from aioprefill.protocol import FLAG_FIRST_CHUNK, FLAG_LAST_CHUNK, PrefillBatch, make_prefill_batch

__all__ = [
    "Budget",
    "Chunk",
    "Columns",
    "Request",
    "StagedBatch",
    "is_full",
    "least_loaded",
    "take_batch",
]


@dataclass(slots=True, eq=False)
class Request:
    """One prompt while the engine owns it. Only the `Scheduler` writes its fields.

    `handle` is the engine's own (its future). Per-request options belong here and in
    `Columns`, the one place that turns a request into wire columns.
    """

    request_id: int
    tokens: bytes  # the prompt as int32 little-endian bytes, ready for the wire
    submitted_ns: int
    handle: Any = None
    next_pos: int = 0  # tokens already sent in earlier chunks
    worker: int = -1  # pinned once a chunk was sent: its KV cache lives on that group
    chunk_in_flight: bool = False
    cancelled: bool = False  # cancelled by its caller, or failed: dropped wherever it is
    num_chunks: int = 0
    attempts: int = 0
    outputs: Any = None  # aioprefill.outputs.Outputs, when the caller asked for more than a token
    num_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_tokens = len(self.tokens) >> 2

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.next_pos


@dataclass(slots=True, frozen=True)
class Chunk:
    """Tokens `[start, end)` of one request, as they ride in one batch."""

    request: Request
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def is_last(self) -> bool:
        return self.end == self.request.num_tokens


@dataclass(slots=True, frozen=True)
class Budget:
    max_batch_tokens: int
    max_batch_size: int
    chunked: bool = True

    def is_long(self, request: Request) -> bool:
        """Long prompts are chunked; every other prompt always travels whole."""
        return self.chunked and request.num_tokens > self.max_batch_tokens


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


def least_loaded(in_flight: list[int], usable: list[bool]) -> int:
    """The usable group with the fewest batches in flight (lowest index on ties), or -1."""
    best = -1
    for i, (n, ok) in enumerate(zip(in_flight, usable, strict=True)):
        if ok and (best < 0 or n < in_flight[best]):
            best = i
    return best
