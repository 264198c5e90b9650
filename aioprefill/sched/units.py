"""The engine's units of work, plain records shared by every part that handles them: a
`Request` (one prompt while the engine owns it), a `Chunk` of it riding one batch, the `Budget`
a batch fits in, and an `InFlightBatch` (a batch a worker group is running). No behaviour beyond
derived numbers; who may write which field is said on each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from aioprefill.wire.protocol import BatchFailed, BatchResult

__all__ = ["Budget", "Chunk", "InFlight", "InFlightBatch", "Request"]


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
    outputs: Any = None  # wire.outputs.Outputs, when the caller asked for more than a token
    tag: str | int | None = None  # the caller's request_id: in its errors and the logs
    # Prefix cache: the chained hash of each full block (`hashes`, None: cache off or no full
    # block), computed by `hasher` when first read (a request queued behind others is hashed
    # when a batch is about to need it, not in its caller's burst of arrivals); and the tokens
    # its first chunk computed this attempt read from the cache.
    hasher: Callable[[], list[int] | None] | None = None
    known_hashes: list[int] | None = None
    cached_tokens: int = 0
    num_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_tokens = len(self.tokens) >> 2

    @property
    def hashes(self) -> list[int] | None:
        hasher = self.hasher
        if hasher is not None:
            self.known_hashes = hasher()
            self.hasher = None
        return self.known_hashes

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.next_pos


@dataclass(slots=True, frozen=True)
class Chunk:
    """Tokens `[start, end)` of one request, as they ride in one batch. `cached`: the tokens
    before `start` the worker reads from its prefix cache instead (only on the first chunk
    computed of a prompt, where `start == cached`; its outputs cover the prompt from 0)."""

    request: Request
    start: int
    end: int
    cached: int = 0

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


@dataclass(slots=True, eq=False)
class InFlightBatch:
    """A batch a group is running. The pool makes it when the batch is written to the group's
    rings and records its ranks' answers; the `Scheduler` fills `chunks` once it was sent."""

    batch_id: int
    num_tokens: int
    dispatched_ns: int
    backlogged: bool  # work was waiting when it was sent: the gap before it is a bubble
    chunks: list[Chunk] = field(default_factory=list)
    answers: int = 0  # ranks of the group that answered it so far
    answer: BatchResult | BatchFailed | None = None  # rank 0's, or the first rank's failure
    pins: Any = None  # aioprefill.sched.prefix.Pins: cache slots it uses, released with its answer


class InFlight(Protocol):
    """A batch the pool accepted; the scheduler fills in its chunks (and its cache pins)."""

    chunks: list[Chunk]
    pins: Any
    answer: Any
