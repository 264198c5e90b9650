"""How the answers of a group's ranks complete its batches.

Every rank of a group answers every batch sent to the group, in the order it got them, each
through its own ring and eventfd: rank 0 with the results (`BatchResult`, or `BatchFailed`),
the other tensor-parallel ranks with an acknowledgement carrying the batch id (`BatchDone`, or
`BatchFailed`). `WorkerSlot.acked[r]` counts the batches in flight rank r has answered, so
rank r's next answer must name batch `in_flight[acked[r]]`; anything else is refused. A batch
is done when every rank answered it: no word is shared or written by several ranks, so a fast
rank can never stand in for a slow one.

A rank that fails a batch its peers are still running may leave them waiting in a collective
it will never join (an out-of-step failure: an error on one rank only). `PeerWatch` gives
them a grace period to answer, then stops the group as after a death.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aioprefill.engine.pool.process import WorkerHandle
from aioprefill.engine.pool.slot import InFlightBatch, WorkerSlot
from aioprefill.engine.stats import StatsRecorder
from aioprefill.errors import ProtocolError
from aioprefill.wire import protocol
from aioprefill.wire.outputs import unspill
from aioprefill.wire.protocol import BatchDone, BatchFailed, BatchResult, Spilled

__all__ = [
    "PEER_GRACE_S",
    "PeerWatch",
    "drain",
    "forward_done",
    "pop_done",
    "record_answer",
    "unanswered_peers",
]

log = logging.getLogger("aioprefill")

# After one rank of a group fails a batch, its peers get this long plus twice that rank's
# forward time to answer theirs; past it they are taken to be blocked in a collective the failed
# rank will never join, and the group is stopped as if it died (instead of waiting for gloo's
# fixed 30 s timeout or `collective_timeout_s`).
PEER_GRACE_S = 1.0


def drain(
    slot: WorkerSlot, handle: WorkerHandle, stats: StatsRecorder
) -> list[BatchResult | BatchDone | BatchFailed]:
    """Every answer waiting in one rank's ring, decoded (a spilled result read back). A
    malformed or unexpected message is counted and skipped; a corrupt ring gets the rank
    killed and marked `corrupt`, never read again (its exit fd then reports the death)."""
    outbox = handle.outbox
    if outbox is None or handle.corrupt:
        return []
    outbox.wait_blocking(0)  # consume the eventfd count
    answers: list[BatchResult | BatchDone | BatchFailed] = []
    while True:
        try:
            view = outbox.recv_nowait()
        except ProtocolError as exc:  # the ring itself is corrupt: so is the worker
            stats.protocol_errors += 1
            log.error("worker %d: its result ring is corrupt (%s); killing it", slot.index, exc)
            handle.corrupt = True
            slot.ready = False
            handle.kill()
            return answers
        if view is None:
            return answers
        try:
            msg = protocol.decode_from_worker(view)
        except ProtocolError as exc:
            stats.protocol_errors += 1
            log.warning("worker %d sent a malformed message: %s", slot.index, exc)
            continue
        finally:
            outbox.release()
        if isinstance(msg, Spilled):  # a result too big for the ring
            msg = _unspill(slot, msg, stats)
        if isinstance(msg, (BatchResult, BatchDone, BatchFailed)):
            answers.append(msg)
        else:
            stats.protocol_errors += 1
            log.warning("worker %d sent an unexpected %s", slot.index, type(msg).__name__)


def _unspill(slot: WorkerSlot, msg: Spilled, stats: StatsRecorder) -> BatchResult | BatchFailed:
    try:
        return unspill(msg)
    except ProtocolError as exc:
        stats.protocol_errors += 1
        log.warning("worker %d: %s", slot.index, exc)
        now = time.monotonic_ns()
        return BatchFailed(msg.batch_id, now, now, "ProtocolError", str(exc))


def record_answer(slot: WorkerSlot, rank: int, msg: BatchResult | BatchDone | BatchFailed) -> str:
    """Count rank `rank`'s answer against the batch it must be for; "" when counted, else
    why it was refused (an unknown or out-of-order batch id, or the wrong kind of answer)."""
    in_flight = slot.in_flight
    k = slot.acked[rank]
    if k >= len(in_flight) or in_flight[k].batch_id != msg.batch_id:
        return f"rank {rank} answered unknown batch {msg.batch_id}"
    if isinstance(msg, BatchDone if rank == 0 else BatchResult):
        return f"rank {rank} sent {type(msg).__name__}"
    batch = in_flight[k]
    if (rank == 0 and batch.answer is None) or (
        isinstance(msg, BatchFailed) and not isinstance(batch.answer, BatchFailed)
    ):
        batch.answer = msg  # type: ignore[assignment]  # rank 0's answer; a failure wins
    slot.acked[rank] = k + 1
    batch.answers += 1
    return ""


def pop_done(slot: WorkerSlot) -> InFlightBatch | None:
    """Remove and return the oldest batch in flight if every rank answered it."""
    in_flight = slot.in_flight
    if not in_flight or in_flight[0].answers < len(slot.ranks):
        return None
    slot.acked = [k - 1 for k in slot.acked]
    return in_flight.popleft()


def forward_done(slot: WorkerSlot) -> bool:
    """Whether every rank answered the oldest batch in flight or has an answer waiting in its
    ring (peeked, not consumed): the group's forward is over."""
    for rank, handle in enumerate(slot.ranks):
        if slot.acked[rank]:
            continue
        if handle.outbox is None:
            return False
        try:
            if handle.outbox.recv_nowait() is None:
                return False
        except ProtocolError:
            return False  # the reader deals with a corrupt ring
    return bool(slot.ranks)


def unanswered_peers(
    slot: WorkerSlot, group: list[WorkerSlot], batch_id: int
) -> list[tuple[WorkerSlot, InFlightBatch]]:
    """What a rank's failed answer for `batch_id` may leave waiting in a collective that rank
    will not join: the same batch while other ranks of this tensor-parallel group have not
    answered it, and in an expert-parallel `group` every other rank's oldest unanswered batch
    (the same step: lockstep sends the next one only when all ranks answered)."""
    waiting = [
        (slot, b) for b in slot.in_flight if b.batch_id == batch_id and b.answers < len(slot.ranks)
    ]
    waiting += [(peer, peer.in_flight[0]) for peer in group if peer is not slot and peer.in_flight]
    return waiting


class PeerWatch:
    """After a rank's failed answer: if the peers it leaves waiting (`unanswered_peers`) have
    not answered within the grace period (a failure after the forward's last collective lets
    them finish), stop them: killed, their group is handled as after any death (stopped,
    restarted as a whole, its requests retried). One timer per failed batch."""

    def __init__(self) -> None:
        self._timers: dict[int, asyncio.TimerHandle] = {}  # by failed batch id

    def watch(
        self,
        loop: asyncio.AbstractEventLoop,
        slot: WorkerSlot,
        group: list[WorkerSlot],
        failed: BatchFailed,
    ) -> None:
        key = failed.batch_id
        waiting = unanswered_peers(slot, group, key)
        if not waiting or key in self._timers:
            return
        grace = PEER_GRACE_S + 2 * (failed.forward_end_ns - failed.forward_start_ns) / 1e9
        self._timers[key] = loop.call_later(grace, self._expire, key, slot, waiting, grace)

    def _expire(
        self,
        key: int,
        slot: WorkerSlot,
        waiting: list[tuple[WorkerSlot, InFlightBatch]],
        grace: float,
    ) -> None:
        del self._timers[key]
        stuck = [p for p, b in waiting if p.ranks and any(x is b for x in p.in_flight)]
        if not stuck:
            return
        log.error(
            "worker %d: a rank failed its batch and its peers did not answer within %.1f s "
            "(waiting in a collective it will not join); stopping the group",
            slot.index,
            grace,
        )
        for peer in stuck:
            for handle in peer.ranks:
                handle.kill()  # its sentinel fires next: handled as a death

    def cancel(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
