"""Policy `forward` against a fake pool: gather while a forward runs, send on forward-done."""

from tests.policies.fake_pool import Harness


def test_an_idle_group_gets_the_first_request_at_once():
    h = Harness("forward")
    r = h.arrive(5)
    assert h.sent_ids() == [[r.request_id]]
    assert h.pool.sent[0].backlogged is False


def test_arrivals_during_a_forward_gather_into_one_batch_sent_on_forward_done():
    h = Harness("forward")
    h.arrive(5)
    later = [h.arrive(5).request_id for _ in range(4)]
    assert len(h.pool.sent) == 1  # nothing more while the forward runs
    assert h.sched.staged.ids == later  # kept ready, columns built
    h.done(0)
    assert h.sent_ids()[1] == later and h.pool.sent[1].backlogged
    assert not h.sched.staged and h.sched.num_pending == 0


def test_early_answer_sends_the_next_batch_before_the_answer_is_read():
    h = Harness("forward")
    h.arrive(5)
    second = h.arrive(5)
    g = h.pool.slots[0]
    h.done(0, early=True)
    assert h.sent_ids()[1] == [second.request_id]
    assert len(g.in_flight) == 1  # the new batch; on_forward_done sent no other
    h.done(0)
    assert len(h.pool.sent) == 2 and h.answered == [1, 2]


def test_budgets_split_the_gathered_work_over_forwards():
    h = Harness("forward", max_batch_tokens=20, max_batch_size=3)
    h.arrive(1)
    for _ in range(7):
        h.arrive(5)
    assert len(h.sched.staged) == 3  # max_batch_size; the rest queues behind
    h.done(0)
    h.done(0)
    h.done(0)
    assert [len(ids) for ids in h.sent_ids()] == [1, 3, 3, 1]


def test_two_groups_each_idle_one_gets_work_and_busy_ones_none():
    h = Harness("forward", groups=2)
    a, b, c = h.arrive(3), h.arrive(3), h.arrive(3)
    assert [(x.group, x.ids) for x in h.pool.sent] == [(0, [a.request_id]), (1, [b.request_id])]
    h.done(1)  # group 1 finishes first: late binding sends the gathered request there
    assert (h.pool.sent[2].group, h.pool.sent[2].ids) == (1, [c.request_id])


def test_a_full_ring_keeps_the_batch_and_the_next_group_takes_it():
    h = Harness("forward", groups=2)
    h.pool.slots[0].capacity = 0  # ring 0 has no room
    r = h.arrive(4)
    assert h.pool.slots[0].ring_full and not h.pool.slots[0].usable
    assert [(x.group, x.ids) for x in h.pool.sent] == [(1, [r.request_id])]
    h.pool.slots[1].capacity = 1
    s = h.arrive(4)  # group 1 busy, group 0 full: staged, nothing lost
    assert h.sched.staged.ids == [s.request_id]
    h.done(1)
    assert h.pool.sent[-1].ids == [s.request_id]


def test_a_long_prompt_is_chunked_on_one_group_and_shorts_share_its_forwards():
    h = Harness("forward", groups=2, max_batch_tokens=100)
    long = h.arrive(250)
    assert h.pool.sent[0].spans == [(0, 100)] and long.worker == 0 and long.chunk_in_flight
    short = h.arrive(20)  # group 1 is idle: it takes the short one, never the long prompt
    assert (h.pool.sent[1].group, h.pool.sent[1].ids) == (1, [short.request_id])
    late = h.arrive(30)
    h.done(1)
    assert h.pool.sent[2].group == 1 and h.pool.sent[2].ids == [late.request_id]
    h.done(0)  # the long prompt's next chunk goes to group 0 only
    assert (h.pool.sent[3].group, h.pool.sent[3].spans) == (0, [(100, 200)])
    h.done(0)
    assert h.pool.sent[4].spans == [(200, 250)]
    h.done(0)
    h.done(1)
    assert sorted(h.answered) == sorted([short.request_id, late.request_id, long.request_id])
    assert long.num_chunks == 3


def test_early_answer_lets_the_next_chunk_ride_along():
    h = Harness("forward", max_batch_tokens=100)
    long = h.arrive(250)
    h.arrive(10)
    h.done(0, early=True)
    assert h.pool.sent[1].spans == [(0, 10), (100, 190)]  # sent before the answer was read
    assert long.chunk_in_flight  # the old batch's answer did not clear the new chunk's flag


def test_cancelled_requests_are_not_sent_and_between_chunks_their_kv_is_freed():
    h = Harness("forward", max_batch_tokens=100)
    h.arrive(1)
    staged = h.arrive(5)
    kept = h.arrive(5)
    h.cancel(staged)
    h.done(0)
    assert h.pool.sent[1].ids == [kept.request_id]
    h.done(0)
    long = h.arrive(150)
    h.cancel(long)  # chunk in flight: its KV is freed when that forward ends
    assert h.pool.slots[0].freed == []
    h.done(0)
    assert h.pool.slots[0].freed == [long.request_id]
    assert len(h.pool.sent) == 3 and h.sched.num_pending == 0 and h.sched.num_in_flight == 0


def test_forward_never_arms_a_timer():
    h = Harness("forward")
    for _ in range(5):
        h.arrive(3)
    h.done(0)
    assert not h.timer.armed
