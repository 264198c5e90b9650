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
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Budget", "Chunk", "Request", "chunk_spans", "is_full", "least_loaded", "take_batch"]


@dataclass(slots=True, eq=False)
class Request:
    """One prompt while the engine owns it. `handle` is the engine's own (its future)."""

    request_id: int
    tokens: np.ndarray  # int32[num_tokens]
    submitted_ns: int
    handle: Any = None
    next_pos: int = 0  # tokens already sent in earlier chunks
    worker: int = -1  # pinned once a chunk was sent: its KV cache lives on that worker
    chunk_in_flight: bool = False
    cancelled: bool = False
    num_chunks: int = 0
    attempts: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.next_pos


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
    def is_first(self) -> bool:
        return self.start == 0

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
    reserve = budget.max_batch_tokens // 2  # what a waiting long prompt is sure to get
    while pending and len(chunks) + (long_req is not None) < budget.max_batch_size:
        req = pending.popleft()
        if req.cancelled:
            continue
        if req.chunk_in_flight or (req.worker >= 0 and req.worker != worker):
            kept.append(req)
            continue
        if budget.is_long(req):
            kept.append(req)
            if long_req is None:
                long_req = req  # its chunk takes what the short requests leave
            continue
        limit = budget.max_batch_tokens - (reserve if long_req is not None else 0)
        if tokens + req.num_tokens > limit:
            kept.append(req)
            break
        chunks.append(Chunk(req, 0, req.num_tokens))
        req.next_pos = req.num_tokens
        tokens += req.num_tokens
    if long_req is not None:
        size = min(long_req.remaining, budget.max_batch_tokens - tokens)
        if size > 0:
            start = long_req.next_pos
            chunks.append(Chunk(long_req, start, start + size))
            long_req.next_pos += size
            if long_req.remaining == 0:
                kept.remove(long_req)
            else:
                long_req.worker = worker
                long_req.chunk_in_flight = True
    pending.extendleft(reversed(kept))
    for chunk in chunks:
        chunk.request.num_chunks += 1
    return chunks


def chunk_spans(num_tokens: int, max_chunk: int) -> list[tuple[int, int]]:
    """Split `[0, num_tokens)` into consecutive spans of at most `max_chunk` tokens."""
    return [(s, min(s + max_chunk, num_tokens)) for s in range(0, num_tokens, max_chunk)]


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
