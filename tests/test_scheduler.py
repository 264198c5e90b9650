"""The Scheduler on plain data: what it marks once a batch is sent, retries, and its invariants."""

import itertools

import numpy as np
import pytest

from aioprefill.sched.batching import Budget
from aioprefill.sched.scheduler import Scheduler
from tests.policies.fake_pool import FakePool


def sched_and_pool(groups=1, capacity=1 << 30, tokens=100, size=10, staging=False):
    return Scheduler(Budget(tokens, size), staging=staging), FakePool(groups, capacity)


def submit(s: Scheduler, n: int):
    return s.submit(bytes(4 * n), 0, None)


def test_a_sent_chunk_pins_its_request_and_a_full_ring_changes_nothing():
    s, pool = sched_and_pool(groups=2, capacity=1)
    long = submit(s, 250)
    pool.slots[1].in_flight.append(None)  # type: ignore[arg-type]  # group 1's ring is full
    assert not s.dispatch(1, pool, backlogged=False)
    assert (long.next_pos, long.worker, long.num_chunks, list(s.pending)) == (0, -1, 0, [long])
    pool.slots[1].in_flight.clear()
    assert s.dispatch(1, pool, backlogged=False)
    assert (long.next_pos, long.worker, long.chunk_in_flight) == (100, 1, True)
    assert s.pending_tokens == 150 and s.num_pending == 1
    assert not s.dispatch(0, pool, backlogged=False)  # pinned to group 1
    s.check_invariants(pool.in_flight_batches())


def test_retry_requeues_from_the_first_token_ahead_of_the_staged_batch():
    s, pool = sched_and_pool(staging=True)
    a = submit(s, 5)
    assert s.dispatch(0, pool, backlogged=False)
    b = submit(s, 5)  # staged
    lost = pool.slots[0].in_flight.popleft()
    assert [c.request for c in lost.chunks] == [a]
    s.requeue_first([r for r in [a] if s.retry(r)])
    assert list(s.pending) == [a, b] and not s.staged and a.attempts == 1
    assert s.num_pending == 2 and s.pending_tokens == 10
    s.check_invariants([])


def test_invariants_catch_a_counter_out_of_step():
    s, _ = sched_and_pool()
    submit(s, 5)
    s.check_invariants([])
    s.num_pending += 1
    with pytest.raises(AssertionError, match=r"num_pending 2 \(recounted 1\)"):
        s.check_invariants([])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_traffic_conserves_every_token(seed):
    rng = np.random.default_rng(seed)
    print("seed", seed)
    s, pool = sched_and_pool(groups=2, tokens=64, size=8, staging=bool(seed % 2))
    reqs = [submit(s, int(rng.integers(1, 200))) for _ in range(200)]
    sent: dict[int, list[tuple[int, int]]] = {r.request_id: [] for r in reqs}
    while s.num_pending or pool.in_flight_batches():
        group = int(rng.integers(0, 2))
        g = pool.slots[group]
        if g.in_flight:
            done = g.in_flight.popleft().chunks
            s.release(done)
            s.finish(sum(c.is_last for c in done))
        if s.dispatch(group, pool, backlogged=True):
            batch = g.in_flight[-1]
            assert sum(c.num_tokens for c in batch.chunks) <= 64 and len(batch.chunks) <= 8
            for c in batch.chunks:
                sent[c.request.request_id].append((c.start, c.end))
        s.check_invariants(pool.in_flight_batches())
    for r in reqs:
        spans = sent[r.request_id]
        assert spans[0][0] == 0 and spans[-1][1] == r.num_tokens
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
