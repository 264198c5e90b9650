"""Batching policy: pure bookkeeping over plain data, no asyncio, no I/O.

The engine calls these functions from its event loop; tests call them with plain lists.

When each policy dispatches (the engine decides *when*, from these rules):

- ``forward`` (default): a worker gets a batch the moment its forward ends, holding everything
  that arrived meanwhile (up to the budgets); an idle worker gets a request at once. At most one
  batch is in flight per worker, so the batch is formed as late as possible and is as full as
  the traffic allows.
- ``eager``: every request is sent alone, as soon as it arrives, to the least-loaded worker,
  and queues there behind the forwards already sent (how batching worked before forward-aware
  scheduling).
- ``timeout``: a batch is sealed when it is full or when its oldest request has waited
  ``batch_timeout_ms``, and is then sent to the least-loaded worker, queueing behind whatever
  runs there (the ``@serve.batch`` knob: size or time, whichever comes first).

*What* goes into a batch is the same for all three (`take_batch`): first come, first served
within `max_batch_tokens` and `max_batch_size`. A prompt longer than `max_batch_tokens` is
split into chunks that run over consecutive forwards on one worker (which keeps its KV cache
between them). When short requests wait behind such a prompt, they get up to half of each
forward's token budget, so a 32k-token prompt does not hold everyone behind it for its whole
duration; alone, it takes the full budget.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Budget",
    "Chunk",
    "Request",
    "StagedBatch",
    "is_full",
    "least_loaded",
    "take_batch",
]


@dataclass(slots=True, eq=False)
class Request:
    """One prompt while the engine owns it. `handle` is the engine's own (its future)."""

    request_id: int
    tokens: bytes  # the prompt as int32 little-endian bytes, ready for the wire
    submitted_ns: int
    handle: Any = None
    next_pos: int = 0  # tokens already sent in earlier chunks
    worker: int = -1  # pinned once a chunk was sent: its KV cache lives on that worker
    chunk_in_flight: bool = False
    cancelled: bool = False
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


def take_batch(pending: deque[Request], worker: int, budget: Budget) -> list[Chunk]:
    """Remove and return the next batch for `worker`, first come first served.

    Skips (and drops) cancelled requests; skips requests pinned to another worker or whose
    previous chunk is still running, leaving them in place. Stops at the first short request
    that does not fit, so no request is overtaken by a later one of its size class. Requests
    that are only partly sent stay in `pending`, at their position.
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
        req.next_pos = n
        req.num_chunks = 1
        tokens += n
    if long_req is not None:
        size = min(long_req.remaining, max_tokens - tokens)
        if size > 0:
            start = long_req.next_pos
            chunks.append(Chunk(long_req, start, start + size))
            long_req.next_pos += size
            long_req.num_chunks += 1
            if long_req.remaining == 0:
                kept.remove(long_req)
            else:
                long_req.worker = worker
                long_req.chunk_in_flight = True
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

    __slots__ = ("_has_cancelled", "ids", "num_tokens", "requests", "token_parts")

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.ids: list[int] = []
        self.token_parts: list[bytes] = []
        self.num_tokens = 0
        self._has_cancelled = False

    def __len__(self) -> int:
        return len(self.requests)

    def try_add(self, req: Request, budget: Budget) -> bool:
        """Stage a whole prompt if it is short and fits the budget; False otherwise."""
        n = req.num_tokens
        if (
            len(self.requests) >= budget.max_batch_size
            or self.num_tokens + n > budget.max_batch_tokens
            or budget.is_long(req)
        ):
            return False
        self.requests.append(req)
        self.ids.append(req.request_id)
        self.token_parts.append(req.tokens)
        self.num_tokens += n
        return True

    def note_cancelled(self) -> None:
        self._has_cancelled = True

    def drop_cancelled(self) -> None:
        """Forget cancelled requests (rare, so done lazily, just before the batch is sent)."""
        if self._has_cancelled:
            live = [r for r in self.requests if not r.cancelled]
            self.clear()
            self.requests = live
            self.ids = [r.request_id for r in live]
            self.token_parts = [r.tokens for r in live]
            self.num_tokens = sum(r.num_tokens for r in live)

    def clear(self) -> None:
        self.requests, self.ids, self.token_parts = [], [], []
        self.num_tokens = 0
        self._has_cancelled = False

    def commit(self) -> list[Chunk]:
        """The batch was sent: mark its requests dispatched and return them as chunks."""
        chunks = []
        for req in self.requests:
            req.next_pos = req.num_tokens
            req.num_chunks = 1
            chunks.append(Chunk(req, 0, req.num_tokens))
        self.clear()
        return chunks

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
    """The usable worker with the fewest batches in flight (lowest index on ties), or -1."""
    best = -1
    for i, (n, ok) in enumerate(zip(in_flight, usable, strict=True)):
        if ok and (best < 0 or n < in_flight[best]):
            best = i
    return best
