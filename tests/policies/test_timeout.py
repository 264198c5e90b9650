"""Policy `timeout` against a fake pool: seal a batch when full or when its oldest times out."""

from tests.policies.fake_pool import Harness

MS = 1_000_000


def test_arrivals_below_a_full_batch_arm_the_timer_for_the_oldest():
    h = Harness("timeout", batch_timeout_ms=10.0)
    h.arrive(3, at_ns=100)
    assert h.pool.sent == [] and h.timer.due_ns == 100 + 10 * MS
    h.arrive(3, at_ns=200)
    assert h.timer.due_ns == 100 + 10 * MS  # not re-armed by later arrivals


def test_a_timer_armed_for_requests_sealed_full_waits_for_the_next_ones_own_timeout():
    # Requests 1-2 leave in a full batch; the timer armed for request 1 must not seal request
    # 3's batch at request 1's deadline (it did: a partial batch sealed early).
    h = Harness("timeout", max_batch_size=2, batch_timeout_ms=10.0)
    first = [h.arrive(3, at_ns=100), h.arrive(3, at_ns=200)]
    assert h.sent_ids() == [[r.request_id for r in first]]
    late = h.arrive(3, at_ns=5 * MS)
    h.fire_timer()  # request 1's deadline, 100 ns + 10 ms
    assert len(h.sent_ids()) == 1 and h.timer.due_ns == 5 * MS + 10 * MS
    h.fire_timer()
    assert h.sent_ids()[1] == [late.request_id]


def test_the_timer_seals_everything_pending():
    h = Harness("timeout")
    reqs = [h.arrive(3) for _ in range(3)]
    h.fire_timer()
    assert h.sent_ids() == [[r.request_id for r in reqs]]
    assert not h.timer.armed  # nothing left to wait for


def test_a_full_batch_is_sealed_at_once():
    h = Harness("timeout", max_batch_size=3)
    reqs = [h.arrive(3) for _ in range(4)]
    assert h.sent_ids() == [[r.request_id for r in reqs[:3]]]
    assert h.timer.armed  # for the fourth one


def test_forward_done_rearms_for_what_is_left():
    h = Harness("timeout", max_batch_size=2)
    h.arrive(3)
    h.arrive(3)
    h.fire_timer() if h.timer.armed else None
    h.arrive(3, at_ns=500)
    h.timer.due_ns = None  # as if it fired while nothing could be sent
    h.done(0)
    assert h.timer.due_ns == 500 + 10 * MS


def test_a_full_ring_keeps_the_sealed_work_pending_until_room():
    h = Harness("timeout", capacity=1, max_batch_size=2)
    for _ in range(4):
        h.arrive(3)
    assert len(h.pool.sent) == 1 and h.sched.num_pending == 2
    h.done(0)
    assert len(h.pool.sent) == 2 and h.sched.num_pending == 0


def test_a_long_prompt_fills_the_budget_chunk_by_chunk():
    h = Harness("timeout", max_batch_tokens=100)
    long = h.arrive(250)
    assert h.pool.sent[0].spans == [(0, 100)]  # its tokens fill a batch: sealed at once
    h.done(0)
    assert h.pool.sent[1].spans == [(100, 200)]
    h.done(0)
    assert h.pool.sent == h.pool.sent[:2] and h.timer.armed  # 50 left: below a full batch
    h.fire_timer()
    assert h.pool.sent[2].spans == [(200, 250)]
    h.done(0)
    assert h.answered == [long.request_id]


def test_cancelled_requests_leave_nothing_to_seal():
    h = Harness("timeout")
    reqs = [h.arrive(3) for _ in range(2)]
    for r in reqs:
        h.cancel(r)
    h.fire_timer()
    assert h.pool.sent == [] and h.sched.num_pending == 0 and h.sched.num_in_flight == 0
