"""`Engine`: forward-aware prefill batching on one asyncio event loop.

Every piece of scheduling state (the pending queue, each worker's in-flight batches, the
callers' futures) belongs to the event loop that entered the engine, and is touched only from
its callbacks: no threads, no locks. The engine never polls: it reacts to three kinds of
event, each an fd or a timer on the loop:

- a caller's `prefill()` (a request joins the pending queue; an idle worker gets it at once),
- a worker's forward-done eventfd (its results are read; with policy ``forward`` the worker is
  handed the whole pending batch *before* any future is resolved, so the gap between its
  forwards is one wake-up),
- a worker's process sentinel (it died: its in-flight requests are retried or failed, and it is
  restarted), plus the one-shot timers of the ``timeout`` policy and of `forward_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import itertools
import logging
import time
from collections import deque
from typing import Any

import msgspec

from aioprefill import protocol
from aioprefill.config import EngineConfig
from aioprefill.errors import (
    AioprefillError,
    EngineClosed,
    EngineOverloaded,
    ForwardFailed,
    ProtocolError,
    WorkerCrashed,
    WorkerStartFailed,
)
from aioprefill.kv import KVExports
from aioprefill.outputs import option_columns, parse_outputs, read_outputs, unspill
from aioprefill.policy import (
    Budget,
    Chunk,
    Request,
    StagedBatch,
    is_full,
    least_loaded,
    take_batch,
)
from aioprefill.protocol import (
    FLAG_FIRST_CHUNK,
    FLAG_LAST_CHUNK,
    BatchFailed,
    BatchResult,
    Spilled,
)
from aioprefill.result import PrefillResult
from aioprefill.shm.segments import cleanup_stale_segments
from aioprefill.stats import EngineStats, StatsRecorder
from aioprefill.validate import validate_prompt
from aioprefill.workers.process import WorkerHandle, set_once
from aioprefill.workers.slot import InFlightBatch, WorkerSlot

__all__ = ["Engine"]

log = logging.getLogger("aioprefill")


_NO_OUTPUTS: dict[str, Any] = {}


class _State(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


class Engine:
    """A prefill node: `async with Engine(config) as engine: await engine.prefill(tokens)`."""

    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            raise TypeError("pass either an EngineConfig or keyword fields, not both")
        self.config = config
        self._budget = Budget(
            max_batch_tokens=config.max_batch_tokens,
            max_batch_size=config.max_batch_size,
            chunked=config.enable_chunked_prefill,
        )
        self._vocab_size = config.model.vocab_size
        self._state = _State.NEW
        self._loop: asyncio.AbstractEventLoop | None = None
        self._workers = [WorkerSlot(i) for i in range(config.num_workers)]
        self._pending: deque[Request] = deque()
        # Policy "forward": the next batch, kept ready while every worker is busy.
        self._staged = StagedBatch()
        self._use_staging = config.policy == "forward"
        self._num_pending = 0  # requests not yet fully dispatched and not cancelled
        self._pending_tokens = 0
        self._num_in_flight = 0  # accepted requests whose future is not yet resolved
        self._room_waiters: deque[asyncio.Future[None]] = deque()
        self._idle_waiter: asyncio.Future[None] | None = None
        self._ids = itertools.count(1)
        self._batch_ids = itertools.count(1)
        self._encode_buffer = bytearray(1 << 16)
        self._timeout_timer: asyncio.TimerHandle | None = None
        self._restart_tasks: set[asyncio.Task[None]] = set()
        self._broken: AioprefillError | None = None
        self._stats = StatsRecorder()
        self._kv = KVExports(config.model, config.max_kv_export_bytes)
        # Accepted requests with output options whose future is not done: while 0, dispatch
        # skips the option columns without looking at a single request.
        self._num_with_outputs = 0

    # ---- lifecycle ---------------------------------------------------------------------

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        await self.close(drain=exc_type is None)

    async def start(self) -> None:
        """Start every worker and wait until each reports ready."""
        if self._state is not _State.NEW:
            raise EngineClosed(f"engine cannot start: it is {self._state.value}")
        self._state = _State.STARTING
        self._loop = asyncio.get_running_loop()
        cleanup_stale_segments()
        starts = [asyncio.ensure_future(self._start_worker(w)) for w in self._workers]
        try:
            await asyncio.gather(*starts)
        except BaseException:
            # gather() leaves the other starts running: stop them (and any restart of a worker
            # that died meanwhile) before their processes and channels are torn down.
            self._state = _State.CLOSED
            await self._cancel_and_wait([*starts, *self._restart_tasks])
            for w in self._workers:
                w.discard(self._loop, kill=True)
            raise
        self._state = _State.RUNNING

    @staticmethod
    async def _cancel_and_wait(tasks: list[asyncio.Future[None]]) -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _start_worker(self, w: WorkerSlot) -> None:
        handle = WorkerHandle(w.index, self.config)
        w.handle = handle
        try:
            handle.start()
            await handle.wait_ready(self.config.worker_start_timeout_s)
        except BaseException:
            w.discard(self._loop, kill=True)
            raise
        assert self._loop is not None
        w.watch(self._loop, self._on_forward_done, self._on_worker_exit)
        log.debug("worker %d ready (pid %d)", w.index, handle.pid)

    async def close(self, *, drain: bool = True) -> None:
        """Stop accepting work, finish (or fail) what was accepted, stop the workers.

        With `drain`, accepted requests get up to `shutdown_timeout_s` to finish; whatever is
        left then fails with `EngineClosed`. Leaves no worker process and no shared memory.
        """
        if self._state in (_State.CLOSING, _State.CLOSED):
            return
        self._state = _State.CLOSING
        if drain and self._num_in_flight and self._broken is None:
            self._idle_waiter = asyncio.get_running_loop().create_future()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle_waiter, self.config.shutdown_timeout_s)
        self._fail_everything(EngineClosed("engine closed before this request finished"))
        await self._cancel_and_wait(list(self._restart_tasks))
        for w in self._workers:
            w.unwatch(self._loop)  # from here on a worker's exit is the shutdown, not a death
            w.cancel_timer()
            if w.ready and w.handle is not None and w.handle.inbox is not None:
                with contextlib.suppress(Exception):
                    w.handle.inbox.send_nowait(protocol.encode(protocol.Shutdown()))
        await self._reap_workers(timeout=5.0)
        self._kv.close_all()
        if self._timeout_timer is not None:
            self._timeout_timer.cancel()
        self._state = _State.CLOSED

    async def _reap_workers(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for w in self._workers:
            handle = w.handle
            if handle is None or handle.process is None:
                continue
            w.unwatch(self._loop)
            if handle.is_alive():
                exited: asyncio.Future[None] = loop.create_future()
                loop.add_reader(handle.sentinel, set_once, exited)
                try:
                    await asyncio.wait_for(exited, max(0.0, deadline - loop.time()))
                except TimeoutError:
                    handle.kill()
                finally:
                    loop.remove_reader(handle.sentinel)
            w.discard(self._loop, kill=True)

    # ---- public API ----------------------------------------------------------------------

    async def prefill(
        self,
        tokens: Any,
        *,
        wait: bool = False,
        prompt_logprobs: bool = False,
        top_k: int = 0,
        embed: str | None = None,
        normalize: bool = False,
        return_kv: bool = False,
    ) -> PrefillResult:
        """Run the prefill of one prompt; return its greedy next token and timings.

        Output options (each computed only for the requests that ask): `prompt_logprobs`
        (float32[n-1]), `top_k` alternatives at the last position, `embed="last"|"mean"`
        (final-norm hidden state; `normalize=True` for unit L2 norm), `return_kv` (a
        `KVExport` handle on `result.kv`: close it when done; see docs/kv-export.md).

        Raises `InvalidRequest` for a bad prompt or option and, past `max_pending` waiting
        requests, `EngineOverloaded` — or, with `wait=True`, waits for room instead;
        `KVBudgetExceeded` when open KV exports fill `max_kv_export_bytes`.
        """
        submitted_ns = time.monotonic_ns()  # TTFT counts any wait for room below
        self._check_open()
        prompt = validate_prompt(tokens, self._vocab_size, self.config.max_prompt_tokens or 0)
        outputs = parse_outputs(
            prompt_logprobs=prompt_logprobs,
            top_k=top_k,
            embed=embed,
            normalize=normalize,
            return_kv=return_kv,
            vocab_size=self._vocab_size,
        )
        if self._num_pending >= self.config.max_pending:
            if not wait:
                self._stats.rejected += 1
                raise EngineOverloaded(
                    f"{self._num_pending} requests already pending (max_pending="
                    f"{self.config.max_pending}); retry later or pass wait=True"
                )
            await self._wait_for_room()
        assert self._loop is not None
        future: asyncio.Future[PrefillResult] = self._loop.create_future()
        if outputs is not None:
            if return_kv:  # KVBudgetExceeded: nothing queued
                outputs.kv = self._kv.reserve(len(prompt) >> 2)
                future.add_done_callback(functools.partial(self._kv.settle, outputs.kv))
            self._num_with_outputs += 1
            future.add_done_callback(self._outputs_done)
        req = Request(
            request_id=next(self._ids),
            tokens=prompt,
            submitted_ns=submitted_ns,
            handle=future,
            outputs=outputs,
        )
        if not (
            self._use_staging and not self._pending and self._staged.try_add(req, self._budget)
        ):
            self._pending.append(req)
        self._num_pending += 1
        self._pending_tokens += req.num_tokens
        self._num_in_flight += 1
        self._stats.submitted += 1
        self._schedule()
        try:
            return await future
        except asyncio.CancelledError:
            self._cancel(req)
            raise

    def _outputs_done(self, future: asyncio.Future[PrefillResult]) -> None:
        self._num_with_outputs -= 1

    def worker_pids(self) -> list[int]:
        """PIDs of the live worker processes, by worker index."""
        return [w.handle.pid for w in self._workers if w.handle is not None]

    def stats(self) -> EngineStats:
        """Counters and recent distributions (batch size/tokens, queue time, bubble)."""
        return self._stats.snapshot(pending=self._num_pending, in_flight=self._num_in_flight)

    @property
    def is_running(self) -> bool:
        return self._state is _State.RUNNING

    # ---- admission -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._state is not _State.RUNNING:
            hint = (
                " (use `async with Engine(config) as engine`)" if self._state is _State.NEW else ""
            )
            raise EngineClosed(f"engine is {self._state.value}{hint}")
        if self._broken is not None:
            raise self._broken

    async def _wait_for_room(self) -> None:
        assert self._loop is not None
        while self._num_pending >= self.config.max_pending:
            waiter: asyncio.Future[None] = self._loop.create_future()
            self._room_waiters.append(waiter)
            await waiter
            self._check_open()

    def _wake_room_waiters(self) -> None:
        room = self.config.max_pending - self._num_pending
        while room > 0 and self._room_waiters:
            waiter = self._room_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                room -= 1

    def _cancel(self, req: Request) -> None:
        """The caller went away: drop the request wherever it is."""
        if req.cancelled:
            return
        if req.handle.done() and not req.handle.cancelled():
            # Answered (or failed) and counted already; the caller's task was cancelled
            # between that and its wake-up (e.g. a wait_for timeout in the same iteration).
            return
        req.cancelled = True
        self._stats.cancelled += 1
        self._num_in_flight -= 1
        if req.next_pos < req.num_tokens:  # still (partly) pending: leaves the queue lazily
            self._num_pending -= 1
            self._pending_tokens -= req.remaining
            if req.next_pos == 0:
                self._staged.note_cancelled()  # it may be staged: dropped before the next send
            self._wake_room_waiters()
        between_chunks = req.worker >= 0 and 0 < req.next_pos < req.num_tokens
        if between_chunks and not req.chunk_in_flight:  # its KV cache waits there: drop it
            self._workers[req.worker].free_ids.append(req.request_id)
        self._maybe_idle()

    # ---- dispatch ----------------------------------------------------------------------

    def _schedule(self) -> None:
        """Hand pending work to workers as the policy allows. Cheap when nothing can move."""
        if not self._num_pending:
            return
        policy = self.config.policy
        if policy == "forward":
            for w in self._workers:
                if not self._num_pending:
                    break
                if w.usable and not w.in_flight:
                    self._dispatch(w, backlogged=False)
        elif policy == "eager":
            self._dispatch_eager()
        else:
            self._schedule_timeout()

    def _dispatch(self, w: WorkerSlot, *, backlogged: bool) -> bool:
        staged = self._staged
        if staged:
            staged.drop_cancelled()
            if staged:
                return self._send_staged(w, backlogged=backlogged)
        chunks = take_batch(self._pending, w.index, self._budget)
        if not chunks:
            return False
        if self._send(w, chunks, backlogged=backlogged):
            return True
        self._undo(chunks)
        return False

    def _send_staged(self, w: WorkerSlot, *, backlogged: bool) -> bool:
        """Send the staged batch: its columns are ready, so this is O(1) Python work."""
        staged = self._staged
        options = None
        if self._num_with_outputs:
            options = option_columns([r.outputs for r in staged.requests])
        sent = self._write_batch(w, staged.ids, staged.token_parts, None, None, options)
        if sent is None:
            return False
        batch_id, now = sent
        num_tokens = staged.num_tokens
        chunks = staged.commit()
        staged.refill(self._pending, self._budget)
        self._record_sent(
            w, InFlightBatch(batch_id, chunks, num_tokens, now, backlogged), len(chunks)
        )
        return True

    def _unstage(self) -> None:
        """Put the staged batch back at the head of the queue (before requeueing retries)."""
        if self._staged:
            self._pending.extendleft(reversed(self._staged.requests))
            self._staged.clear()

    def _dispatch_eager(self) -> None:
        """Send each pending request on its own, at once, to the least-loaded worker.

        A long prompt's chunks all queue at one worker, in order, each its own batch. On a
        full ring the request goes back to the head of the queue, from the first unsent chunk.
        """
        max_chunk = self._budget.max_batch_tokens
        while self._pending:
            req = self._pending[0]
            if req.cancelled:
                self._pending.popleft()
                continue
            if req.worker >= 0:  # partly sent: the rest must follow on the same worker
                pinned = self._workers[req.worker]
                target = pinned if pinned.usable else None
            else:
                target = self._least_loaded()
            if target is None:
                return
            self._pending.popleft()
            long = self._budget.is_long(req)
            if long:
                req.worker = target.index
            while req.next_pos < req.num_tokens:
                start = req.next_pos
                end = min(start + max_chunk, req.num_tokens) if long else req.num_tokens
                req.next_pos = end
                req.num_chunks += 1
                if not self._send(
                    target, [Chunk(req, start, end)], backlogged=bool(target.in_flight)
                ):
                    req.next_pos = start
                    req.num_chunks -= 1
                    if start == 0:
                        req.worker = -1
                    self._pending.appendleft(req)
                    return

    def _schedule_timeout(self) -> None:
        """Seal a batch when it is full; otherwise make sure a timer will seal it."""
        while self._num_pending and is_full(self._num_pending, self._pending_tokens, self._budget):
            if not self._seal_timeout_batch():
                return
        self._arm_timeout_timer()

    def _seal_timeout_batch(self) -> bool:
        target = self._least_loaded()
        if target is None:
            return False
        return self._dispatch(target, backlogged=bool(target.in_flight))

    def _arm_timeout_timer(self) -> None:
        if self._timeout_timer is not None or not self._num_pending:
            return
        oldest = next((r for r in self._pending if not r.cancelled and not r.chunk_in_flight), None)
        if oldest is None:
            return  # only chunks in flight: their results re-arm the timer
        assert self._loop is not None
        due_ns = oldest.submitted_ns + int(self.config.batch_timeout_ms * 1e6)
        delay = max(0.0, (due_ns - time.monotonic_ns()) / 1e9)
        self._timeout_timer = self._loop.call_later(delay, self._on_timeout_timer)

    def _on_timeout_timer(self) -> None:
        self._timeout_timer = None
        if self._state not in (_State.RUNNING, _State.CLOSING):
            return
        self._seal_timeout_batch()
        self._schedule_timeout()

    def _least_loaded(self) -> WorkerSlot | None:
        idx = least_loaded(
            [len(w.in_flight) for w in self._workers], [w.usable for w in self._workers]
        )
        return self._workers[idx] if idx >= 0 else None

    def _send(self, w: WorkerSlot, chunks: list[Chunk], *, backlogged: bool) -> bool:
        """Encode `chunks` as one PrefillBatch into `w`'s ring; False (nothing sent) if full.

        On a full ring the caller puts the chunks back: it knows where they were.
        """
        sent = self._write_batch(
            w,
            [c.request.request_id for c in chunks],
            [
                c.request.tokens
                if c.start == 0 and c.end == c.request.num_tokens
                else c.request.tokens[4 * c.start : 4 * c.end]
                for c in chunks
            ],
            [c.start for c in chunks],
            [
                (FLAG_FIRST_CHUNK if c.start == 0 else 0) | (FLAG_LAST_CHUNK if c.is_last else 0)
                for c in chunks
            ],
            option_columns([c.request.outputs for c in chunks]) if self._num_with_outputs else None,
        )
        if sent is None:
            return False
        batch_id, now = sent
        num_tokens = sum(c.num_tokens for c in chunks)
        finished = sum(1 for c in chunks if c.is_last)
        self._record_sent(w, InFlightBatch(batch_id, chunks, num_tokens, now, backlogged), finished)
        return True

    def _write_batch(
        self,
        w: WorkerSlot,
        request_ids: list[int],
        token_parts: list[bytes],
        start_pos: list[int] | None,
        flags: list[int] | None,
        options: tuple[bytes, bytes, list[str]] | None = None,
    ) -> tuple[int, int] | None:
        """Pack one PrefillBatch into `w`'s ring: (batch id, sent ns), or None if it is full."""
        assert w.handle is not None and w.handle.inbox is not None
        batch_id = next(self._batch_ids)
        now = time.monotonic_ns()
        msg = protocol.make_prefill_batch(
            batch_id, request_ids, token_parts, start_pos, flags, w.free_ids, now, options
        )
        if not w.handle.inbox.send_nowait(protocol.encode_into(msg, self._encode_buffer)):
            w.ring_full = True
            return None
        return batch_id, now

    def _record_sent(self, w: WorkerSlot, batch: InFlightBatch, finished: int) -> None:
        """Bookkeeping once a batch is in `w`'s ring; `finished` prompts left the queue."""
        w.free_ids = []
        num_tokens = batch.num_tokens
        chunks = batch.chunks
        if not w.in_flight:
            w.arm_timer(self._loop, self.config.forward_timeout_s, self._on_forward_timeout)
        w.in_flight.append(batch)
        self._num_pending -= finished
        self._pending_tokens -= num_tokens
        self._stats.batches += 1
        self._stats.tokens += num_tokens
        self._stats.batch_size.add(len(chunks))
        self._stats.batch_tokens.add(num_tokens)
        self._wake_room_waiters()

    def _undo(self, chunks: list[Chunk]) -> None:
        """Put a batch that could not be sent back where `take_batch` found it."""
        for c in reversed(chunks):
            req = c.request
            req.next_pos = c.start
            req.num_chunks -= 1
            req.chunk_in_flight = False
            if c.start == 0:
                req.worker = -1
            if c.is_last:  # take_batch removed it from the queue
                self._pending.appendleft(req)

    # ---- results ----------------------------------------------------------------------------

    def _on_forward_done(self, w: WorkerSlot) -> None:
        """The worker's eventfd fired: a forward ended and its answer waits in the ring.

        With policy ``forward`` the worker gets its next batch *before* the answer is even
        decoded: the answer is safe in the ring, and every microsecond spent before the ring
        write is bubble. `_on_batch_done` then sees the new batch in flight and sends no other.
        """
        handle = w.handle
        if (
            len(w.in_flight) == 1
            and self._num_pending
            and self.config.policy == "forward"
            and w.ready
            and self._state in (_State.RUNNING, _State.CLOSING)
            and handle is not None
            and handle.outbox is not None
        ):
            try:
                answered = handle.outbox.recv_nowait() is not None  # not a stale wake-up
            except ProtocolError:
                answered = False  # _on_worker_readable deals with a corrupt ring
            if answered:
                for c in w.in_flight[0].chunks:  # continuations may ride the next batch
                    if not c.is_last:
                        c.request.chunk_in_flight = False
                self._dispatch(w, backlogged=True)
        self._on_worker_readable(w)

    def _on_worker_readable(self, w: WorkerSlot) -> None:
        """Read every message the worker wrote, then act on each."""
        handle = w.handle
        if handle is None or handle.outbox is None:
            return
        outbox = handle.outbox
        outbox.wait_blocking(0)  # consume the eventfd count
        while w.handle is handle:
            try:
                view = outbox.recv_nowait()
            except ProtocolError as exc:  # the ring itself is corrupt: so is the worker
                self._stats.protocol_errors += 1
                log.error("worker %d: its result ring is corrupt (%s); killing it", w.index, exc)
                handle.kill()
                self._on_worker_death(w)
                return
            if view is None:
                return
            try:
                msg = protocol.decode_from_worker(view)
            except ProtocolError as exc:
                self._stats.protocol_errors += 1
                log.warning("worker %d sent a malformed message: %s", w.index, exc)
                continue
            finally:
                outbox.release()
            if isinstance(msg, Spilled):  # a result too big for the ring
                try:
                    msg = unspill(msg)
                except ProtocolError as exc:
                    self._stats.protocol_errors += 1
                    log.warning("worker %d: %s", w.index, exc)
                    now = time.monotonic_ns()
                    msg = BatchFailed(msg.batch_id, now, now, "ProtocolError", str(exc))
            if isinstance(msg, (BatchResult, BatchFailed)):
                self._on_batch_done(w, msg)
            else:
                self._stats.protocol_errors += 1
                log.warning("worker %d sent an unexpected %s", w.index, type(msg).__name__)

    def _on_batch_done(self, w: WorkerSlot, msg: BatchResult | BatchFailed) -> None:
        if not w.in_flight or w.in_flight[0].batch_id != msg.batch_id:
            self._stats.protocol_errors += 1
            log.warning("worker %d answered unknown batch %d", w.index, msg.batch_id)
            return
        batch = w.in_flight.popleft()
        w.cancel_timer()
        if w.in_flight:
            w.arm_timer(self._loop, self.config.forward_timeout_s, self._on_forward_timeout)
        if batch.backlogged and w.last_forward_end_ns:
            self._stats.bubble_us.add((msg.forward_start_ns - w.last_forward_end_ns) / 1e3)
        w.last_forward_end_ns = msg.forward_end_ns
        w.ring_full = False
        for c in batch.chunks:  # continuation chunks become eligible for the next batch
            if not c.is_last:
                c.request.chunk_in_flight = False
                if c.request.cancelled:
                    w.free_ids.append(c.request.request_id)
        # Next batch first: every microsecond spent here before the ring write is bubble.
        if self._state in (_State.RUNNING, _State.CLOSING) and self._num_pending:
            if self.config.policy == "forward":
                if not w.in_flight and w.ready:  # not a dead worker's last words
                    self._dispatch(w, backlogged=True)
            else:
                self._schedule()
        if isinstance(msg, BatchFailed):
            self._fail_batch(w, batch, msg)
        else:
            self._resolve_batch(w, batch, msg)
        self._maybe_idle()

    def _resolve_batch(self, w: WorkerSlot, batch: InFlightBatch, msg: BatchResult) -> None:
        try:
            ids, tokens, logprobs = msg.arrays()
            extras = (
                read_outputs(msg, batch.chunks, self._kv)
                if self._num_with_outputs
                else [_NO_OUTPUTS] * len(batch.chunks)
            )
        except ProtocolError as exc:
            self._stats.protocol_errors += 1
            # A chunked prompt that asked for outputs lost this chunk's share: it fails too,
            # and the worker drops its KV cache.
            broken = [c for c in batch.chunks if not c.is_last and c.request.outputs is not None]
            w.free_ids.extend(c.request.request_id for c in broken)
            self._fail_requests([c.request for c in batch.chunks if c.is_last or c in broken], exc)
            return
        finished_ns = time.monotonic_ns()
        k = 0
        size = len(batch.chunks)
        for c, extra in zip(batch.chunks, extras, strict=True):
            if not c.is_last:
                continue
            req = c.request
            if k >= len(ids) or int(ids[k]) != req.request_id:
                # The worker's answer does not line up with what we sent: never guess.
                self._stats.protocol_errors += 1
                self._fail_requests([req], ProtocolError("worker result does not match its batch"))
                k += 1
                continue
            future = req.handle
            if not future.done():
                self._stats.queue_us.add((msg.forward_start_ns - req.submitted_ns) / 1e3)
                result = PrefillResult(
                    request_id=req.request_id,
                    token=int(tokens[k]),
                    logprob=float(logprobs[k]),
                    worker=w.index,
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
                self._stats.completed += 1
                self._num_in_flight -= 1
            k += 1
        if k != len(ids):
            self._stats.protocol_errors += 1

    def _fail_batch(self, w: WorkerSlot, batch: InFlightBatch, msg: BatchFailed) -> None:
        error = ForwardFailed(
            f"worker {w.index} failed batch {batch.batch_id}: {msg.message}",
            worker=w.index,
            error_type=msg.error_type,
        )
        # The worker already dropped the state of every request in the batch.
        self._fail_requests([c.request for c in batch.chunks], error)

    def _fail_requests(self, requests: list[Request], error: BaseException) -> None:
        for req in requests:
            if req.next_pos < req.num_tokens and not req.cancelled:
                self._num_pending -= 1  # a chunked prompt still queued: drop its remainder
                self._pending_tokens -= req.remaining
            req.cancelled = True
            future = req.handle
            if not future.done():
                future.set_exception(error)
                self._stats.failed += 1
                self._num_in_flight -= 1

    # ---- worker failures --------------------------------------------------------------------

    def _on_forward_timeout(self, w: WorkerSlot) -> None:
        w.timer = None
        if w.handle is not None:
            log.error(
                "worker %d: forward exceeded %.1f s; killing it",
                w.index,
                self.config.forward_timeout_s,
            )
            w.handle.kill()  # its sentinel fires next: handled as a death

    def _on_worker_exit(self, w: WorkerSlot) -> None:
        handle = w.handle
        if handle is None:
            return
        w.ready = False  # its last results are read below, but it gets no new batch
        self._on_worker_readable(w)  # results it wrote before dying still count
        if w.handle is handle:  # (unless reading them found its ring corrupt: handled there)
            self._on_worker_death(w)

    def _on_worker_death(self, w: WorkerSlot) -> None:
        """A worker exited or was killed: retry or fail its requests, restart it with backoff."""
        handle = w.handle
        assert handle is not None and handle.process is not None
        handle.process.join(timeout=5.0)  # reaps it: immediate once its sentinel fired
        code = handle.process.exitcode
        log.error("worker %d (pid %d) died with exit code %s", w.index, handle.pid, code)
        w.discard(self._loop, kill=False)
        w.ring_full = False
        lost, w.in_flight = w.in_flight, deque()
        w.free_ids = []
        self._recover_requests(w, lost, f"worker {w.index} died (exit code {code})")
        # A worker that dies while the others still start is restarted too (once running).
        if self._state in (_State.STARTING, _State.RUNNING):
            self._restart_later(w)
        self._schedule()
        self._maybe_idle()

    def _recover_requests(self, w: WorkerSlot, lost: deque[InFlightBatch], why: str) -> None:
        """Retry (up to max_retries) or fail the requests a dead worker held."""
        seen: set[int] = set()
        requeue: list[Request] = []
        for batch in lost:
            for c in batch.chunks:
                req = c.request
                if req.request_id in seen:
                    continue
                seen.add(req.request_id)
                self._restart_request(req, requeue, why)
        # Chunked prompts queued between chunks lost their KV cache with the worker.
        for req in self._pending:
            if req.worker == w.index and req.request_id not in seen and not req.cancelled:
                seen.add(req.request_id)
                self._restart_request(req, requeue, why, queued=True)
        if requeue:
            self._unstage()  # retried requests are older than the staged ones: they go first
        for req in reversed(requeue):
            self._pending.appendleft(req)

    def _restart_request(
        self, req: Request, requeue: list[Request], why: str, *, queued: bool = False
    ) -> None:
        if req.cancelled or req.handle.done():
            return
        if req.attempts >= self.config.max_retries or self._state is not _State.RUNNING:
            self._fail_requests(
                [req],
                WorkerCrashed(
                    f"{why} while running this request; {req.attempts} retries used "
                    f"(max_retries={self.config.max_retries})"
                ),
            )
            return
        req.attempts += 1
        self._stats.retried += 1
        in_queue = queued or req.next_pos < req.num_tokens
        if req.next_pos == req.num_tokens or not in_queue:
            self._num_pending += 1
        self._pending_tokens += req.next_pos  # its tokens all go again
        req.next_pos = 0
        req.worker = -1
        req.chunk_in_flight = False
        req.num_chunks = 0
        if not in_queue:
            requeue.append(req)

    def _restart_later(self, w: WorkerSlot) -> None:
        cfg = self.config
        delay = w.note_death(time.monotonic(), cfg.restart_window_s, cfg.max_restarts)
        if delay is None:
            log.error(
                "worker %d died %d times in %.0f s: not restarting it",
                w.index,
                len(w.deaths),
                self.config.restart_window_s,
            )
            if all(x.gave_up for x in self._workers):
                self._broken = WorkerStartFailed(
                    f"every worker died more than max_restarts={self.config.max_restarts} times "
                    f"within {self.config.restart_window_s:.0f} s"
                )
                self._fail_everything(self._broken)
            return
        task = asyncio.get_running_loop().create_task(self._restart(w, delay))
        self._restart_tasks.add(task)
        task.add_done_callback(self._restart_tasks.discard)

    async def _restart(self, w: WorkerSlot, delay: float) -> None:
        await asyncio.sleep(delay)  # backoff between restarts, off the hot path
        if self._state not in (_State.STARTING, _State.RUNNING):
            return
        try:
            await self._start_worker(w)
        except Exception as exc:  # any failure (no fork, no shm, bad Ready) counts as a death
            log.error("worker %d could not be restarted: %s: %s", w.index, type(exc).__name__, exc)
            self._restart_later(w)
            return
        self._stats.worker_restarts += 1
        self._schedule()

    def _fail_everything(self, error: AioprefillError) -> None:
        """Fail every accepted request that has not finished (on close or when broken)."""
        self._unstage()
        requests = [r for r in self._pending if not r.cancelled]
        for w in self._workers:
            for batch in w.in_flight:
                requests.extend(c.request for c in batch.chunks)
        self._pending.clear()
        self._fail_requests(requests, error)
        self._num_pending = 0
        self._pending_tokens = 0
        for waiter in self._room_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._room_waiters.clear()

    def _maybe_idle(self) -> None:
        if (
            self._idle_waiter is not None
            and self._num_in_flight == 0
            and not self._idle_waiter.done()
        ):
            self._idle_waiter.set_result(None)
