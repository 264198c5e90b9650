"""`Outcomes`: how each accepted request ends for its caller: a result, an error, a cancel.

The mirror image of `batching.Columns`: the one place where a group's answer becomes each
caller's `PrefillResult` (per-request outputs added to the protocol land here), where errors
reach callers, and where a caller's cancellation is booked. The engine owns the futures; this
settles them, on the event loop, and tells the `Scheduler` how many callers stopped waiting.
A request that carries its caller's `request_id` (`Request.tag`) gets it in its error message
(and as the error's `request_id` attribute) and in a log line; one not dispatched by its
`deadline_s` is withdrawn here and fails with `DeadlineExceeded`.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable

import msgspec
import numpy as np

from aioprefill.engine.stats import StatsRecorder
from aioprefill.errors import DeadlineExceeded, ForwardFailed, ProtocolError
from aioprefill.result import PrefillResult
from aioprefill.sched.scheduler import Scheduler
from aioprefill.sched.units import Chunk, InFlightBatch, Request
from aioprefill.wire.kv import KVExports
from aioprefill.wire.outputs import read_outputs
from aioprefill.wire.protocol import BatchFailed, BatchResult

__all__ = ["Outcomes", "tagged"]

log = logging.getLogger("aioprefill")


def tagged(error: BaseException, tag: str | int | None) -> BaseException:
    """`error` for the request the caller calls `tag`: its message names it (a copy, since
    one error may fail a whole batch)."""
    if tag is None:
        return error
    own = copy.copy(error)
    own.args = (f"request {tag!r}: {error.args[0] if error.args else error}", *error.args[1:])
    own.request_id = tag  # type: ignore[attr-defined]
    return own


class Outcomes:
    def __init__(
        self,
        sched: Scheduler,
        free_later: Callable[[int, list[int]], None],
        stats: StatsRecorder,
        kv: KVExports,
    ) -> None:
        """`free_later(group, ids)`: have that group drop these requests' KV state with its
        next batch (`WorkerPool.free_later`)."""
        self._sched = sched
        self._free_later = free_later
        self._stats = stats
        self._kv = kv

    def cancelled(self, req: Request) -> None:
        """The caller went away: drop the request wherever it is."""
        if req.cancelled or (req.handle.done() and not req.handle.cancelled()):
            # Dropped already, or answered (or failed) and counted already: the caller's task
            # was cancelled between that and its wake-up (e.g. a wait_for timeout).
            return
        self._stats.cancelled += 1
        group = self._sched.cancel(req)
        if group >= 0:  # its KV cache waits there between two chunks: drop it
            self._free_later(group, [req.request_id])

    def resolve(self, group: int, batch: InFlightBatch, msg: BatchResult) -> None:
        """Answer every request whose last chunk `batch` carried, checking ids one by one."""
        stats = self._stats
        try:
            ids, tokens, logprobs = msg.arrays()
            extras = read_outputs(msg, batch.chunks, self._kv)  # (no work without options)
            if msg.loaded_tokens:
                self._count_loaded(batch.chunks, msg.loaded_tokens)
        except ProtocolError as exc:
            stats.protocol_errors += 1
            # A chunked prompt that asked for outputs lost this chunk's share: it fails too,
            # and its group drops its KV cache.
            broken = [c for c in batch.chunks if not c.is_last and c.request.outputs is not None]
            if broken:
                self._free_later(group, [c.request.request_id for c in broken])
            self.fail([c.request for c in batch.chunks if c.is_last or c in broken], exc)
            return
        finished_ns = time.monotonic_ns()
        k = answered = 0
        size = len(batch.chunks)
        for c, extra in zip(batch.chunks, extras, strict=True):
            req = c.request
            if c.end != req.num_tokens:  # not its last chunk: no answer yet
                continue
            if k >= len(ids) or int(ids[k]) != req.request_id:
                # The worker's answer does not line up with what we sent: never guess.
                stats.protocol_errors += 1
                self.fail([req], ProtocolError("worker result does not match its batch"))
                k += 1
                continue
            future = req.handle
            if not future.done():
                result = PrefillResult(
                    request_id=req.request_id,
                    token=int(tokens[k]),
                    logprob=float(logprobs[k]),
                    worker=group,
                    batch_id=batch.batch_id,
                    batch_size=size,
                    batch_tokens=batch.num_tokens,
                    num_tokens=req.num_tokens,
                    num_chunks=req.num_chunks,
                    cached_tokens=req.cached_tokens,
                    submitted_ns=req.submitted_ns,
                    dispatched_ns=batch.dispatched_ns,
                    forward_start_ns=msg.forward_start_ns,
                    forward_end_ns=msg.forward_end_ns,
                    finished_ns=finished_ns,
                )
                if extra:  # (a `**extra` in the call above would cost plain results ~0.4 us)
                    result = msgspec.structs.replace(result, **extra)
                future.set_result(result)
                stats.record_result(req.submitted_ns, msg.forward_start_ns, finished_ns)
                answered += 1
            elif future.cancelled():  # its caller left in this very loop iteration
                self.cancelled(req)
            k += 1
        stats.completed += answered
        self._sched.finish(answered)
        if k != len(ids):
            stats.protocol_errors += 1

    def _count_loaded(self, chunks: list[Chunk], column: bytes) -> None:
        """The tokens each chunk's worker loaded from the KV store instead of computing them:
        its request's `cached_tokens`, and the prefix cache's `store_hit_tokens`."""
        loaded = np.frombuffer(column, dtype="<i4")
        if len(loaded) != len(chunks) or (len(loaded) and loaded.min() < 0):
            raise ProtocolError("BatchResult.loaded_tokens does not match its batch")
        for c, k in zip(chunks, loaded.tolist(), strict=True):
            c.request.cached_tokens += k
        if self._sched.cache is not None:
            self._sched.cache.store_hit_tokens += int(loaded.sum())

    def fail_batch(self, group: int, batch: InFlightBatch, msg: BatchFailed) -> None:
        error = ForwardFailed(
            f"worker {group} failed batch {batch.batch_id}: {msg.message}",
            worker=group,
            error_type=msg.error_type,
        )
        # The worker already dropped the state of every request in the batch.
        self.fail([c.request for c in batch.chunks], error)

    def fail(self, requests: list[Request], error: BaseException) -> None:
        """Fail these requests' callers (a request listed twice fails once)."""
        failed = 0
        for req in requests:
            if req.handle.cancelled():  # its caller left in this very loop iteration
                self.cancelled(req)
                continue
            self._sched.drop(req)
            if not req.handle.done():
                if req.tag is not None:
                    log.warning("request %r failed: %s: %s", req.tag, type(error).__name__, error)
                req.handle.set_exception(tagged(error, req.tag))
                failed += 1
        self._stats.failed += failed
        self._sched.finish(failed)

    def arm_deadline(
        self,
        loop: asyncio.AbstractEventLoop,
        req: Request,
        deadline_s: float,
        then: Callable[[], None],
    ) -> asyncio.TimerHandle:
        """Fail `req` with `DeadlineExceeded` if no worker got it within `deadline_s` of its
        submission, then call `then` (the engine's after-event bookkeeping)."""

        def expire() -> None:  # a closure: debug-mode asyncio reprs a cancelled timer's args
            if req.next_pos or req.cancelled or req.handle.done():
                return  # (its first chunk was) dispatched: it runs; or it already ended
            self._sched.cancel(req)  # leaves the queue (or the staged batch) before any send
            error = DeadlineExceeded(
                f"not dispatched within deadline_s={deadline_s:g}: it never ran"
            )
            log.info("request %r: %s", req.tag if req.tag is not None else req.request_id, error)
            req.handle.set_exception(tagged(error, req.tag))
            self._stats.failed += 1
            then()

        # The deadline counts from the prefill() call, like TTFT (any wait for room included).
        return loop.call_later(deadline_s - (time.monotonic_ns() - req.submitted_ns) / 1e9, expire)
