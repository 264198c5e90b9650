"""How the answers of a group's ranks complete its batches.

Every rank of a group answers every batch sent to the group, in the order it got them, each
through its own ring and eventfd: rank 0 with the results (`BatchResult`, or `BatchFailed`),
the other tensor-parallel ranks with an acknowledgement carrying the batch id (`BatchDone`, or
`BatchFailed`). `WorkerSlot.acked[r]` counts the batches in flight rank r has answered, so
rank r's next answer must name batch `in_flight[acked[r]]`; anything else is refused. A batch
is done when every rank answered it: no word is shared or written by several ranks, so a fast
rank can never stand in for a slow one.
"""

from __future__ import annotations

from aioprefill.errors import ProtocolError
from aioprefill.protocol import BatchDone, BatchFailed, BatchResult
from aioprefill.workers.slot import InFlightBatch, WorkerSlot

__all__ = ["forward_done", "pop_done", "record_answer"]


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
