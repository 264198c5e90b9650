"""`WorkerPool`: the worker groups, their processes, fds, rings and forward timers.

The only writer of `WorkerSlot`. It starts each group and waits for it to be ready, watches its
forward-done eventfd and process sentinel, writes batches into its ring (`send`, one encode per
batch), matches each answer to the batch at the head of the ring, arms the forward timers, and
restarts a dead group after its `RestartBackoff`. It decides nothing about requests: it reports
to the engine through `PoolEvents`. A pool position is a *group* of ranks (`WorkerSlot.ranks`,
one process today); docs/architecture.md lists what tensor-parallel groups add, all of it here.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterator

from aioprefill import protocol
from aioprefill.batching import Columns
from aioprefill.config import EngineConfig
from aioprefill.errors import ProtocolError
from aioprefill.protocol import BatchFailed, BatchResult
from aioprefill.recovery import RestartBackoff
from aioprefill.stats import StatsRecorder
from aioprefill.workers.process import WorkerHandle
from aioprefill.workers.slot import InFlightBatch, PoolEvents, WorkerSlot

__all__ = ["WorkerPool"]

log = logging.getLogger("aioprefill")


async def _cancel_and_wait(tasks: list[asyncio.Future[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class WorkerPool:
    def __init__(self, config: EngineConfig, stats: StatsRecorder, events: PoolEvents) -> None:
        self.config = config
        self.slots = [
            WorkerSlot(i, RestartBackoff(config.restart_window_s, config.max_restarts))
            for i in range(config.num_workers)
        ]
        self.restarts_allowed = False  # the engine opens this while it starts and runs
        self._stats = stats
        self._events = events
        self._loop: asyncio.AbstractEventLoop | None = None
        self._batch_ids = itertools.count(1)
        self._buffer = bytearray(1 << 16)
        self._restart_tasks: set[asyncio.Task[None]] = set()

    # ---- views ----------------------------------------------------------------------------

    def pids(self) -> list[int]:
        """Every live rank's pid, group-major."""
        return [h.pid for s in self.slots for h in s.ranks]

    def all_ready(self) -> bool:
        return all(s.ready for s in self.slots)

    @property
    def all_gave_up(self) -> bool:
        return all(s.backoff.gave_up for s in self.slots)

    def in_flight_batches(self) -> Iterator[InFlightBatch]:
        for s in self.slots:
            yield from s.in_flight

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every group and wait until each is ready; on failure leave nothing running."""
        self._loop = asyncio.get_running_loop()
        self.restarts_allowed = True
        starts = [asyncio.ensure_future(self._start_slot(s)) for s in self.slots]
        try:
            await asyncio.gather(*starts)
        except BaseException:
            # gather() leaves the other starts running: stop them (and any restart of a group
            # that died meanwhile) before their processes and channels are torn down.
            self.restarts_allowed = False
            await _cancel_and_wait([*starts, *self._restart_tasks])
            for s in self.slots:
                self._discard(s, kill=True)
            raise

    async def _start_slot(self, slot: WorkerSlot) -> None:
        handle = WorkerHandle(slot.index, self.config)
        slot.ranks = [handle]
        try:
            handle.start()
            await handle.wait_ready(self.config.worker_start_timeout_s)
        except BaseException:
            self._discard(slot, kill=True)
            raise
        loop = self._loop
        assert loop is not None and handle.outbox is not None
        loop.add_reader(handle.outbox.fds()[0], self._events.on_forward_done, slot)
        loop.add_reader(handle.sentinel, self._on_exit, slot)
        slot.ready = True
        slot.ring_full = False
        slot.last_forward_end_ns = 0
        log.debug("worker %d ready (pid %d)", slot.index, handle.pid)

    def _unwatch(self, slot: WorkerSlot) -> None:
        """Stop reacting to the group's fds (its exit is then no longer a death)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        for handle in slot.ranks:
            if handle.outbox is not None:
                loop.remove_reader(handle.outbox.fds()[0])
            if handle.process is not None and handle.process.pid is not None:
                with contextlib.suppress(ValueError, OSError):
                    loop.remove_reader(handle.sentinel)

    def _discard(self, slot: WorkerSlot, *, kill: bool) -> None:
        """Forget the group's processes and channels (its in-flight work is handled first)."""
        slot.ready = False
        self._cancel_timer(slot)
        self._unwatch(slot)
        ranks, slot.ranks = slot.ranks, []
        for handle in ranks:
            if kill:
                handle.kill()
            if handle.pid > 0:  # never started (a failed launch): nothing to join
                handle.process.join(timeout=5.0)  # type: ignore[union-attr]
            handle.close()

    async def close(self, timeout: float = 5.0) -> None:
        """Stop restarts, ask every group to exit, kill what is left after `timeout`."""
        self.restarts_allowed = False
        await _cancel_and_wait(list(self._restart_tasks))
        for slot in self.slots:
            self._unwatch(slot)  # from here on an exit is the shutdown, not a death
            self._cancel_timer(slot)
            if slot.ready:
                for handle in slot.ranks:
                    if handle.inbox is not None:
                        with contextlib.suppress(Exception):
                            handle.inbox.send_nowait(protocol.encode(protocol.Shutdown()))
        deadline = time.monotonic() + timeout
        for slot in self.slots:
            for handle in slot.ranks:
                await handle.wait_exit(deadline - time.monotonic())
            self._discard(slot, kill=True)

    # ---- sending --------------------------------------------------------------------------

    def send(self, group: int, columns: Columns, *, backlogged: bool) -> InFlightBatch | None:
        """Encode one batch and write it to the group's ring; None (nothing sent) if full."""
        slot = self.slots[group]
        batch_id = next(self._batch_ids)
        now = time.monotonic_ns()
        data = protocol.encode_into(columns.pack(batch_id, slot.free_ids, now), self._buffer)
        # One rank per group today. A tensor-parallel group writes `data` to every rank's ring
        # after checking that each has room, so that no rank gets a batch its peers lack.
        ranks = slot.ranks
        assert len(ranks) == 1, "multi-rank groups write every ring: see docs/architecture.md"
        inbox = ranks[0].inbox
        assert inbox is not None
        if not inbox.send_nowait(data):
            slot.ring_full = True
            return None
        slot.free_ids = []
        num_tokens = columns.num_tokens
        batch = InFlightBatch(batch_id, num_tokens, now, backlogged)
        if not slot.in_flight:
            self._arm_timer(slot)
        slot.in_flight.append(batch)
        stats = self._stats
        stats.batches += 1
        stats.tokens += num_tokens
        stats.batch_size.add(len(columns))
        stats.batch_tokens.add(num_tokens)
        return batch

    def free_later(self, group: int, request_ids: list[int]) -> None:
        """Have the group drop these requests' KV state with its next batch."""
        self.slots[group].free_ids.extend(request_ids)

    # ---- answers --------------------------------------------------------------------------

    def answer_waiting(self, slot: WorkerSlot) -> bool:
        """Whether the group's answer is already in its ring (not a stale wake-up)."""
        handle = slot.handle
        if handle is None or handle.outbox is None:
            return False
        try:
            return handle.outbox.recv_nowait() is not None
        except ProtocolError:
            return False  # read_answers deals with a corrupt ring

    def read_answers(self, slot: WorkerSlot) -> None:
        """Read every message the group wrote, then act on each."""
        ranks = slot.ranks
        if not ranks or ranks[0].outbox is None:
            return
        handle, outbox = ranks[0], ranks[0].outbox
        outbox.wait_blocking(0)  # consume the eventfd count
        while slot.ranks is ranks:
            try:
                view = outbox.recv_nowait()
            except ProtocolError as exc:  # the ring itself is corrupt: so is the worker
                self._stats.protocol_errors += 1
                log.error("worker %d: its result ring is corrupt (%s); killing it", slot.index, exc)
                handle.kill()
                self._on_death(slot)
                return
            if view is None:
                return
            try:
                msg = protocol.decode_from_worker(view)
            except ProtocolError as exc:
                self._stats.protocol_errors += 1
                log.warning("worker %d sent a malformed message: %s", slot.index, exc)
                continue
            finally:
                outbox.release()
            if isinstance(msg, (BatchResult, BatchFailed)):
                self._on_answer(slot, msg)
            else:
                self._stats.protocol_errors += 1
                log.warning("worker %d sent an unexpected %s", slot.index, type(msg).__name__)

    def _on_answer(self, slot: WorkerSlot, msg: BatchResult | BatchFailed) -> None:
        in_flight = slot.in_flight
        if not in_flight or in_flight[0].batch_id != msg.batch_id:
            self._stats.protocol_errors += 1
            log.warning("worker %d answered unknown batch %d", slot.index, msg.batch_id)
            return
        batch = in_flight.popleft()
        self._cancel_timer(slot)
        if in_flight:
            self._arm_timer(slot)
        if batch.backlogged and slot.last_forward_end_ns:
            self._stats.bubble_us.add((msg.forward_start_ns - slot.last_forward_end_ns) / 1e3)
        slot.last_forward_end_ns = msg.forward_end_ns
        slot.ring_full = False
        self._events.on_batch_done(slot, batch, msg)

    # ---- timers, deaths, restarts ---------------------------------------------------------

    def _arm_timer(self, slot: WorkerSlot) -> None:
        timeout = self.config.forward_timeout_s
        if timeout is not None and self._loop is not None:
            slot.timer = self._loop.call_later(timeout, self._on_forward_timeout, slot)

    def _cancel_timer(self, slot: WorkerSlot) -> None:
        if slot.timer is not None:
            slot.timer.cancel()
            slot.timer = None

    def _on_forward_timeout(self, slot: WorkerSlot) -> None:
        slot.timer = None
        if slot.ranks:
            timeout = self.config.forward_timeout_s
            log.error("worker %d: forward exceeded %.1f s; killing it", slot.index, timeout)
            for handle in slot.ranks:
                handle.kill()  # its sentinel fires next: handled as a death

    def _on_exit(self, slot: WorkerSlot) -> None:
        ranks = slot.ranks
        if not ranks:
            return
        slot.ready = False  # its last answers are read below, but it gets no new batch
        self.read_answers(slot)  # answers it wrote before dying still count
        if slot.ranks is ranks:  # (unless reading them found its ring corrupt: handled there)
            self._on_death(slot)

    def _on_death(self, slot: WorkerSlot) -> None:
        handle = slot.ranks[0]
        assert handle.process is not None
        handle.process.join(timeout=5.0)  # reaps it: immediate once its sentinel fired
        code = handle.process.exitcode
        log.error("worker %d (pid %d) died with exit code %s", slot.index, handle.pid, code)
        self._discard(slot, kill=True)  # any rank's death is the whole group's
        slot.ring_full = False
        lost, slot.in_flight = slot.in_flight, deque()
        slot.free_ids = []
        self._events.on_death(slot, lost, f"worker {slot.index} died (exit code {code})")
        # A group that dies while the others still start is restarted too (once running).
        if self.restarts_allowed:
            self._restart_later(slot)

    def _restart_later(self, slot: WorkerSlot) -> None:
        delay = slot.backoff.note_death(time.monotonic())
        if delay is None:
            deaths, window = len(slot.backoff.deaths), self.config.restart_window_s
            log.error(
                "worker %d died %d times in %.0f s: not restarting", slot.index, deaths, window
            )
            self._events.on_gave_up(slot)
            return
        task = asyncio.get_running_loop().create_task(self._restart(slot, delay))
        self._restart_tasks.add(task)
        task.add_done_callback(self._restart_tasks.discard)

    async def _restart(self, slot: WorkerSlot, delay: float) -> None:
        await asyncio.sleep(delay)  # backoff between restarts, off the hot path
        if not self.restarts_allowed:
            return
        try:
            await self._start_slot(slot)
        except Exception as exc:  # any failure (no fork, no shm, bad Ready) counts as a death
            log.error("worker %d could not be restarted: %r", slot.index, exc)
            self._restart_later(slot)
            return
        self._events.on_restarted(slot)
