"""`Outcomes`: how each accepted request ends for its caller: a result, an error, a cancel.

The mirror image of `batching.Columns`: the one place where a group's answer becomes each
caller's `PrefillResult` (per-request outputs added to the protocol land here), where errors
reach callers, and where a caller's cancellation is booked. The engine owns the futures; this
settles them, on the event loop, and tells the `Scheduler` how many callers stopped waiting.
"""

from __future__ import annotations

import time

import msgspec

from aioprefill.batching import Request
from aioprefill.errors import ForwardFailed, ProtocolError
from aioprefill.kv import KVExports
from aioprefill.outputs import read_outputs
from aioprefill.protocol import BatchFailed, BatchResult
from aioprefill.result import PrefillResult
from aioprefill.scheduler import Scheduler
from aioprefill.stats import StatsRecorder
from aioprefill.workers.pool import WorkerPool
from aioprefill.workers.slot import InFlightBatch

__all__ = ["Outcomes"]


class Outcomes:
    def __init__(
        self, sched: Scheduler, pool: WorkerPool, stats: StatsRecorder, kv: KVExports
    ) -> None:
        self._sched = sched
        self._pool = pool
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
            self._pool.free_later(group, [req.request_id])

    def resolve(self, group: int, batch: InFlightBatch, msg: BatchResult) -> None:
        """Answer every request whose last chunk `batch` carried, checking ids one by one."""
        stats = self._stats
        try:
            ids, tokens, logprobs = msg.arrays()
            extras = read_outputs(msg, batch.chunks, self._kv)  # (no work without options)
        except ProtocolError as exc:
            stats.protocol_errors += 1
            # A chunked prompt that asked for outputs lost this chunk's share: it fails too,
            # and its group drops its KV cache.
            broken = [c for c in batch.chunks if not c.is_last and c.request.outputs is not None]
            if broken:
                self._pool.free_later(group, [c.request.request_id for c in broken])
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
                stats.queue_us.add((msg.forward_start_ns - req.submitted_ns) / 1e3)
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
                    submitted_ns=req.submitted_ns,
                    dispatched_ns=batch.dispatched_ns,
                    forward_start_ns=msg.forward_start_ns,
                    forward_end_ns=msg.forward_end_ns,
                    finished_ns=finished_ns,
                )
                if extra:  # (a `**extra` in the call above would cost plain results ~0.4 us)
                    result = msgspec.structs.replace(result, **extra)
                future.set_result(result)
                answered += 1
            elif future.cancelled():  # its caller left in this very loop iteration
                self.cancelled(req)
            k += 1
        stats.completed += answered
        self._sched.finish(answered)
        if k != len(ids):
            stats.protocol_errors += 1

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
                req.handle.set_exception(error)
                failed += 1
        self._stats.failed += failed
        self._sched.finish(failed)
