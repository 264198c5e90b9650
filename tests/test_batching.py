"""Batch forming is pure: plain requests in, a proposed batch out, no request changed."""

from collections import deque

from aioprefill.sched.batching import (
    Budget,
    Request,
    StagedBatch,
    is_full,
    take_batch,
)


def req(rid: int, n: int) -> Request:
    return Request(request_id=rid, tokens=bytes(4 * n), submitted_ns=rid)


def ids(chunks):
    return [c.request.request_id for c in chunks]


def test_fcfs_within_budgets():
    pending = deque(req(i, 10) for i in range(10))
    batch = take_batch(pending, 0, Budget(max_batch_tokens=35, max_batch_size=100))
    assert ids(batch) == [0, 1, 2]
    assert [r.request_id for r in pending] == list(range(3, 10))
    batch = take_batch(pending, 0, Budget(max_batch_tokens=1000, max_batch_size=4))
    assert ids(batch) == [3, 4, 5, 6]


def test_no_overtaking_by_later_short_requests():
    pending = deque([req(0, 10), req(1, 30), req(2, 1)])
    batch = take_batch(pending, 0, Budget(max_batch_tokens=32, max_batch_size=100))
    assert ids(batch) == [0]  # 1 does not fit, 2 must not jump ahead of it
    assert [r.request_id for r in pending] == [1, 2]


def test_cancelled_requests_are_dropped():
    pending = deque(req(i, 5) for i in range(4))
    pending[1].cancelled = True
    batch = take_batch(pending, 0, Budget(max_batch_tokens=100, max_batch_size=100))
    assert ids(batch) == [0, 2, 3]
    assert not pending


def test_long_prompt_is_chunked_and_left_in_place():
    budget = Budget(max_batch_tokens=100, max_batch_size=10)
    long = req(0, 250)
    pending = deque([long])
    first = take_batch(pending, worker=1, budget=budget)
    assert [(c.start, c.end, c.is_last) for c in first] == [(0, 100, False)]
    assert list(pending) == [long]
    assert long.next_pos == 0 and long.worker == -1  # take_batch proposes; it changes nothing
    long.next_pos, long.worker, long.chunk_in_flight = 100, 1, True  # (what Scheduler marks)
    assert take_batch(pending, worker=0, budget=budget) == []  # pinned elsewhere
    assert take_batch(pending, worker=1, budget=budget) == []  # its chunk still runs
    long.chunk_in_flight = False
    assert [(c.start, c.end) for c in take_batch(pending, 1, budget)] == [(100, 200)]
    long.next_pos = 200
    last = take_batch(pending, worker=1, budget=budget)
    assert [(c.start, c.end, c.is_last) for c in last] == [(200, 250, True)]
    assert not pending


def test_short_requests_share_forwards_with_a_long_prompt():
    budget = Budget(max_batch_tokens=100, max_batch_size=10)
    pending = deque([req(0, 1000), req(1, 20), req(2, 20), req(3, 20)])
    batch = take_batch(pending, 0, budget)
    # Shorts behind the long prompt get up to half the budget; the chunk takes the rest.
    assert sorted(ids(batch)) == [0, 1, 2]
    chunk = next(c for c in batch if c.request.request_id == 0)
    assert chunk.num_tokens == 60
    assert [r.request_id for r in pending] == [0, 3]


def test_chunking_disabled_keeps_prompts_whole():
    budget = Budget(max_batch_tokens=100, max_batch_size=10, chunked=False)
    pending = deque([req(0, 50), req(1, 80)])
    assert ids(take_batch(pending, 0, budget)) == [0]


def test_helpers():
    budget = Budget(max_batch_tokens=100, max_batch_size=3)
    assert is_full(3, 1, budget) and is_full(1, 100, budget) and not is_full(2, 99, budget)


def test_staged_batch_is_what_take_batch_would_pick():
    budget = Budget(max_batch_tokens=30, max_batch_size=3)
    staged = StagedBatch()
    reqs = [req(i, 10) for i in range(5)]
    assert [staged.try_add(r, budget) for r in reqs] == [True, True, True, False, False]
    assert staged.ids == [0, 1, 2] and staged.num_tokens == 30
    assert staged.columns.token_parts == [r.tokens for r in reqs[:3]]
    reqs[1].cancelled = True
    staged.note_cancelled()
    staged.drop_cancelled()
    assert staged.ids == [0, 2] and staged.num_tokens == 20
    assert [r.request_id for r in staged.clear()] == [0, 2]
    assert not staged and staged.ids == [] and staged.num_tokens == 0
    pending = deque([*reqs[3:], req(9, 100), req(10, 1)])
    staged.refill(pending, budget)
    assert staged.ids == [3, 4]  # stops at the long prompt: FIFO is kept
    assert [r.request_id for r in pending] == [9, 10]


def test_staged_batch_refuses_long_prompts():
    budget = Budget(max_batch_tokens=30, max_batch_size=3)
    assert not StagedBatch().try_add(req(0, 31), budget)
    assert StagedBatch().try_add(req(0, 31), Budget(30, 3, chunked=False)) is False
