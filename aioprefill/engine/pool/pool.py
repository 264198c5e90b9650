"""`WorkerPool`: the worker groups, their processes, fds, rings and forward timers.

It starts each group and waits for it to be ready, writes batches into its rings (`send`, one
encode per batch), reads its ranks' answers and hands back the batches they complete
(`read_answers`), arms the forward timers, stops a group when one of its ranks dies
(`stop_group`) and restarts it after its `RestartBackoff`. It decides nothing about requests
and calls nothing of the engine's while the engine calls it: the engine's handlers are only the
targets of the fds and tasks the pool watches (`PoolEvents`). A pool position is a *group* of
ranks (`WorkerSlot.ranks`: one process, a tensor-parallel replica, or one rank of an
expert-parallel group); docs/architecture.md lists what rank groups add, all of it here.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Iterator
from typing import NamedTuple

from aioprefill.config import EngineConfig
from aioprefill.engine.pool.answers import PeerWatch, drain, forward_done, pop_done, record_answer
from aioprefill.engine.pool.backoff import RestartBackoff
from aioprefill.engine.pool.launch import launch_group
from aioprefill.engine.pool.process import WorkerHandle
from aioprefill.engine.pool.restarts import Restarts
from aioprefill.engine.pool.slot import InFlightBatch, PoolEvents, WorkerSlot
from aioprefill.engine.stats import StatsRecorder
from aioprefill.parallel import ParallelLayout
from aioprefill.sched.batching import Columns
from aioprefill.wire import protocol
from aioprefill.wire.protocol import BatchDone, BatchFailed, BatchResult

__all__ = ["Stopped", "WorkerPool"]

log = logging.getLogger("aioprefill")


class Stopped(NamedTuple):
    """One slot of a stopped group: answered before it stopped, lost with it, and why."""

    slot: WorkerSlot
    done: list[InFlightBatch]
    lost: deque[InFlightBatch]
    why: str


async def _cancel_and_wait(tasks: list[asyncio.Future[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class WorkerPool:
    def __init__(self, config: EngineConfig, stats: StatsRecorder, events: PoolEvents) -> None:
        self.config = config
        self.layout = ParallelLayout(config.num_workers, config.tp_size, config.expert_parallel)
        ep = config.expert_parallel
        shared = RestartBackoff(config.restart_window_s, config.max_restarts)
        self.slots = [
            WorkerSlot(i, shared if ep else RestartBackoff(shared.window_s, shared.max_restarts))
            for i in range(config.num_workers)
        ]
        # Slots whose processes start, die and restart together: each replica alone, or all of
        # them when they are the ranks of one expert-parallel group (one shared backoff).
        self.sets = [self.slots] if ep else [[s] for s in self.slots]
        self.restarts = Restarts(self._start_set, events)
        self._stats = stats
        self._events = events
        self._loop: asyncio.AbstractEventLoop | None = None
        self._batch_ids = itertools.count(1)
        self._peers = PeerWatch()  # a rank failed: are its peers stuck in a collective?
        self._buffer = bytearray(1 << 16)
        self._exiting: set[WorkerHandle] = set()  # killed ranks whose exit fd has not fired

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
        self.restarts.allowed = True
        starts = [asyncio.ensure_future(self._start_set(s)) for s in self.sets]
        try:
            await asyncio.gather(*starts)
        except BaseException:
            # gather() leaves the other starts running: stop them (and any restart of a group
            # that died meanwhile) before their processes and channels are torn down.
            self.restarts.allowed = False
            await _cancel_and_wait([*starts, *self.restarts.tasks])
            for s in self.slots:
                self._discard(s, kill=True)
            raise

    async def _start_set(self, slots: list[WorkerSlot]) -> None:
        """Start every rank of these slots as one group, wait until all are ready, watch them."""
        await launch_group(slots, self.layout, self.config)
        loop = self._loop
        assert loop is not None
        for slot in slots:
            for handle in slot.ranks:
                assert handle.outbox is not None
                loop.add_reader(handle.outbox.fds()[0], self._events.on_forward_done, slot)
                loop.add_reader(handle.exit_fd, self._events.on_exit, slot, handle)
            slot.acked = [0] * len(slot.ranks)
            readies = [h.ready for h in slot.ranks if h.ready is not None]
            slot.cache_blocks = min((r.cache_blocks for r in readies), default=0)
            slot.block_bytes = sum(r.block_bytes for r in readies)
            slot.generation += 1
            slot.ready = True
            slot.ring_full = False
            slot.last_forward_end_ns = 0
            log.debug("worker %d ready (pids %s)", slot.index, [h.pid for h in slot.ranks])

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
                    loop.remove_reader(handle.exit_fd)

    def _discard(self, slot: WorkerSlot, *, kill: bool) -> None:
        """Forget the group's processes and channels (its in-flight work is handled first)."""
        slot.ready = False
        self._cancel_timer(slot)
        self._unwatch(slot)
        ranks, slot.ranks = slot.ranks, []
        for handle in ranks:
            if kill:
                handle.kill()
            if not handle.close():  # still exiting: reaped once its exit fd fires, not waited for
                self._reap_later(handle)

    def _reap_later(self, handle: WorkerHandle) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        self._exiting.add(handle)
        loop.add_reader(handle.exit_fd, self._reaped, handle)

    def _reaped(self, handle: WorkerHandle) -> None:
        assert self._loop is not None
        self._loop.remove_reader(handle.exit_fd)
        handle.reap()
        self._exiting.discard(handle)

    async def close(self, timeout: float = 5.0) -> None:
        """Stop restarts, ask every group to exit, kill what is left after `timeout`."""
        self.restarts.allowed = False
        await _cancel_and_wait(list(self.restarts.tasks))
        self._peers.cancel()
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
        for handle in list(self._exiting):  # killed earlier (a death), not reaped yet
            assert self._loop is not None
            self._loop.remove_reader(handle.exit_fd)
            await handle.wait_exit(5.0)
            self._reaped(handle)

    # ---- sending --------------------------------------------------------------------------

    def send(self, group: int, columns: Columns, *, backlogged: bool) -> InFlightBatch | None:
        """Encode one batch and write it to the group's ring; None (nothing sent) if full."""
        slot = self.slots[group]
        batch_id = next(self._batch_ids)
        now = time.monotonic_ns()
        data = protocol.encode_into(columns.pack(batch_id, slot.free_ids, now), self._buffer)
        ranks = slot.ranks
        if len(ranks) == 1:
            inbox = ranks[0].inbox
            assert inbox is not None
            if not inbox.send_nowait(data):
                slot.ring_full = True
                return None
        else:
            # A tensor-parallel group: the same bytes to every rank, and only once each rank
            # has room (ring space is the minimum over ranks): no rank gets a batch its peers
            # lack, or its collectives would wait for them.
            if not all(h.inbox is not None and h.inbox.has_room(len(data)) for h in ranks):
                slot.ring_full = True
                return None
            for h in ranks:
                assert h.inbox is not None
                h.inbox.send_nowait(data)
        slot.free_ids = []
        num_tokens = columns.num_tokens
        batch = InFlightBatch(batch_id, num_tokens, now, backlogged)
        waiting = len(slot.in_flight) <= 1  # the worker is idle, or just answered (early)
        if not slot.in_flight:
            self._arm_timer(slot)
        slot.in_flight.append(batch)
        stats = self._stats
        stats.batches += 1
        if not len(columns):
            stats.empty_batches += 1  # an expert-parallel rank kept in step
        stats.tokens += num_tokens
        stats.batch_size.add(len(columns))
        stats.batch_tokens.add(num_tokens)
        if waiting:
            # The eventfd write may have woken the worker onto this CPU without preempting
            # the loop, which then runs on (answers, arrivals) while the worker waits for the
            # scheduler's next tick: 2-4 ms gaps at saturation (docs/perf-prefix-cache.md).
            # One yield lets it start its forward now (a syscall, ~1 us, when nobody waits).
            os.sched_yield()
        return batch

    def free_later(self, group: int, request_ids: list[int]) -> None:
        """Have the group drop these requests' KV state with its next batch."""
        self.slots[group].free_ids.extend(request_ids)

    # ---- answers --------------------------------------------------------------------------

    def answer_waiting(self, slot: WorkerSlot) -> bool:
        """Whether the group's one batch in flight is answered in every rank's ring (peeked,
        not consumed; not a stale wake-up): its forward is over."""
        return slot.ready and len(slot.in_flight) == 1 and forward_done(slot)

    def read_answers(self, slot: WorkerSlot) -> list[InFlightBatch]:
        """Read every answer the group's ranks wrote; return the batches they completed, in
        order, each with its `answer` (already removed from the slot, its timer re-armed).
        A rank whose ring is corrupt is killed: its exit fd then reports the death."""
        done: list[InFlightBatch] = []
        for rank, handle in enumerate(slot.ranks):
            for msg in drain(slot, handle, self._stats):
                self._on_answer(slot, rank, msg, done)
        return done

    def _on_answer(
        self,
        slot: WorkerSlot,
        rank: int,
        msg: BatchResult | BatchDone | BatchFailed,
        done: list[InFlightBatch],
    ) -> None:
        refused = record_answer(slot, rank, msg)
        if refused:
            self._stats.protocol_errors += 1
            log.warning("worker %d %s", slot.index, refused)
            return
        if isinstance(msg, BatchFailed) and self._loop is not None:
            self._peers.watch(self._loop, slot, self._set_of(slot), msg)
        while (batch := pop_done(slot)) is not None:
            self._complete(slot, batch)
            done.append(batch)

    def _complete(self, slot: WorkerSlot, batch: InFlightBatch) -> None:
        msg = batch.answer
        assert msg is not None
        self._cancel_timer(slot)
        if slot.in_flight:
            self._arm_timer(slot)
        if batch.backlogged and slot.last_forward_end_ns:
            self._stats.bubble_us.add((msg.forward_start_ns - slot.last_forward_end_ns) / 1e3)
        slot.last_forward_end_ns = msg.forward_end_ns
        self._stats.record_forward(msg.forward_start_ns, msg.forward_end_ns)
        slot.ring_full = False

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

    def _set_of(self, slot: WorkerSlot) -> list[WorkerSlot]:
        return self.sets[0] if self.layout.expert_parallel else [slot]

    def stop_group(self, slot: WorkerSlot, dead: WorkerHandle) -> list[Stopped]:
        """Rank `dead` of `slot` exited (its exit fd fired: its exit code is there). Any rank's
        death is its group's: every rank of the group (of every slot, for an expert-parallel
        group) is stopped, and for each slot the batches its ranks completed before (to
        resolve), the batches lost with it (to retry) and why. The group restarts as a whole
        after its backoff. Nothing here waits for a process: killed ranks are reaped when their
        exit fd fires. [] when the group was stopped already."""
        if dead not in slot.ranks:
            return []
        rank = f" rank {slot.ranks.index(dead)}" if len(slot.ranks) > 1 else ""
        where = f"worker {slot.index}{rank}"
        code = dead.exit_code()  # never waits: the exit fd fires once it can be reaped
        log.error("%s (pid %d) died (exit code %s)", where, dead.pid, code)
        why = f"{where} died (exit code {code})"
        group = self._set_of(slot)
        stopped = []
        for s in group:
            s.ready = False  # its last answers count, but it gets no new batch
            done = self.read_answers(s)
            self._discard(s, kill=True)
            s.ring_full = False
            lost, s.in_flight = s.in_flight, deque()
            s.free_ids = []
            broke = why if s is slot else f"{why}: its expert-parallel group broke"
            stopped.append(Stopped(s, done, lost, broke))
        # A group that dies while the others still start is restarted too (once running).
        if self.restarts.allowed:
            self.restarts.schedule(group)
        return stopped
