"""split_step: one expert-parallel step's work per rank, with plain requests (no processes)."""

from __future__ import annotations

import random
from collections import deque

import pytest

from aioprefill.sched.batching import Budget, Request, split_step

BUDGET = Budget(max_batch_tokens=100, max_batch_size=4)


def req(rid: int, n: int, **fields) -> Request:
    r = Request(rid, bytes(4 * n), 0)
    for k, v in fields.items():
        setattr(r, k, v)
    return r


def shape(steps) -> list[list[tuple[int, int, int]]]:
    return [[(c.request.request_id, c.start, c.end) for c in chunks] for chunks in steps]


def test_nothing_pending_means_no_work_anywhere() -> None:
    assert split_step(deque(), 3, BUDGET) == [[], [], []]


def test_one_request_goes_to_one_rank_the_others_get_nothing() -> None:
    q = deque([req(1, 10)])
    assert shape(split_step(q, 2, BUDGET)) == [[(1, 0, 10)], []]
    assert not q


def test_balanced_by_tokens_first_come_first_served() -> None:
    q = deque([req(1, 60), req(2, 10), req(3, 10), req(4, 30), req(5, 20)])
    steps = split_step(q, 2, BUDGET)
    # each goes to the rank with fewer tokens so far: 60 vs 10+10+30+20
    assert shape(steps) == [[(1, 0, 60)], [(2, 0, 10), (3, 0, 10), (4, 0, 30), (5, 0, 20)]]
    assert not q


def test_a_short_request_that_fits_nowhere_ends_the_step() -> None:
    q = deque([req(1, 90), req(2, 90), req(3, 20), req(4, 5)])
    assert shape(split_step(q, 2, BUDGET)) == [[(1, 0, 90)], [(2, 0, 90)]]
    assert [r.request_id for r in q] == [3, 4]  # 4 would fit but may not overtake 3


def test_pinned_continuation_goes_to_its_rank_and_long_prompts_are_chunked() -> None:
    pinned = req(1, 250, next_pos=100, worker=1)
    fresh_long = req(2, 300)
    q = deque([pinned, fresh_long, req(3, 40)])
    steps = split_step(q, 2, BUDGET)
    # rank 1 continues request 1; the new long prompt takes rank 0; both are then full, so 3
    # waits for the next step.
    assert shape(steps) == [[(2, 0, 100)], [(1, 100, 200)]]
    assert [r.request_id for r in q] == [1, 2, 3]  # both still have chunks to send


def test_skips_cancelled_and_running_chunks_and_respects_max_size() -> None:
    running = req(1, 250, next_pos=100, worker=0, chunk_in_flight=True)
    q = deque([running, req(2, 5, cancelled=True), *(req(i, 1) for i in range(3, 13))])
    steps = split_step(q, 2, BUDGET)
    assert [len(s) for s in steps] == [4, 4]
    assert [r.request_id for r in q] == [1, 11, 12]


@pytest.mark.parametrize("seed", range(5))
def test_random_queues_lose_nothing_and_stay_in_budget(seed: int) -> None:
    print("seed", seed)
    rng = random.Random(seed)
    q = deque(req(i, rng.choice([1, 5, 30, 99, 140, 400])) for i in range(40))
    total = sum(r.num_tokens for r in q)
    sent = 0
    for _ in range(200):
        steps = split_step(q, 3, BUDGET)
        if not any(steps):
            break
        for chunks in steps:
            assert len(chunks) <= BUDGET.max_batch_size
            assert sum(c.end - c.start for c in chunks) <= BUDGET.max_batch_tokens
            for c in chunks:  # mark sent and finished, as the scheduler would
                assert c.start == c.request.next_pos
                c.request.next_pos = c.end
                c.request.worker = steps.index(chunks)
                sent += c.end - c.start
    assert not q and sent == total
