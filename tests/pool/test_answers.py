"""How ranks' answers complete a group's batches, on plain data: every rank must answer each
batch, in order, with the kind of answer its rank gives; nothing else completes a batch."""

from __future__ import annotations

from collections import deque

from aioprefill.engine.pool.answers import pop_done, record_answer
from aioprefill.engine.pool.backoff import RestartBackoff
from aioprefill.engine.pool.slot import InFlightBatch, WorkerSlot
from aioprefill.wire.protocol import BatchDone, BatchFailed, BatchResult


def group(num_ranks: int, batch_ids: list[int]) -> WorkerSlot:
    slot = WorkerSlot(0, RestartBackoff(60.0, 5))
    slot.ranks = [object()] * num_ranks  # type: ignore[list-item]  # only counted here
    slot.acked = [0] * num_ranks
    slot.in_flight = deque(InFlightBatch(b, 1, 0, False) for b in batch_ids)
    return slot


def result(batch_id: int) -> BatchResult:
    return BatchResult(batch_id, 1, 2, b"", b"", b"")


def failed(batch_id: int) -> BatchFailed:
    return BatchFailed(batch_id, 1, 2, "RuntimeError", "boom")


def test_a_batch_is_done_only_once_every_rank_answered_it():
    slot = group(2, [7, 8])
    assert record_answer(slot, 0, result(7)) == ""
    assert pop_done(slot) is None  # rank 1 still runs it
    assert record_answer(slot, 0, result(8)) == ""  # rank 0 runs ahead
    assert pop_done(slot) is None
    assert record_answer(slot, 1, BatchDone(7, 1, 2)) == ""
    done = pop_done(slot)
    assert done is not None and done.batch_id == 7 and isinstance(done.answer, BatchResult)
    assert pop_done(slot) is None and slot.acked == [1, 0]
    assert record_answer(slot, 1, BatchDone(8, 1, 2)) == ""
    assert pop_done(slot) is not None and not slot.in_flight and slot.acked == [0, 0]


def test_answers_for_another_batch_or_of_the_wrong_kind_are_refused():
    slot = group(2, [7, 8])
    assert "unknown batch 8" in record_answer(slot, 1, BatchDone(8, 1, 2))  # out of order
    assert "unknown batch 9" in record_answer(slot, 1, BatchDone(9, 1, 2))
    assert "sent BatchResult" in record_answer(slot, 1, result(7))  # rank 1 only acknowledges
    assert "sent BatchDone" in record_answer(slot, 0, BatchDone(7, 1, 2))  # rank 0 has results
    assert slot.acked == [0, 0] and all(b.answers == 0 for b in slot.in_flight)
    assert pop_done(slot) is None


def test_a_failure_on_any_rank_fails_the_batch():
    slot = group(2, [7])
    record_answer(slot, 1, failed(7))
    record_answer(slot, 0, result(7))
    done = pop_done(slot)
    assert done is not None and isinstance(done.answer, BatchFailed)


def test_a_lone_rank_completes_its_batch_with_its_answer():
    slot = group(1, [3])
    assert record_answer(slot, 0, result(3)) == ""
    done = pop_done(slot)
    assert done is not None and done.answer is not None and done.answer.batch_id == 3
