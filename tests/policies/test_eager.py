"""Policy `eager` against a fake pool: every request alone, at once, to the least-loaded group."""

from tests.policies.fake_pool import Harness


def test_each_arrival_is_sent_alone_at_once():
    h = Harness("eager")
    reqs = [h.arrive(3) for _ in range(3)]
    assert h.sent_ids() == [[r.request_id] for r in reqs]
    assert [b.backlogged for b in h.pool.sent] == [False, True, True]


def test_arrivals_go_to_the_least_loaded_group():
    h = Harness("eager", groups=2)
    for _ in range(3):
        h.arrive(3)
    assert [b.group for b in h.pool.sent] == [0, 1, 0]
    h.done(0)
    h.done(0)
    h.arrive(3)
    assert h.pool.sent[-1].group == 0  # group 0 is empty now, group 1 still has one


def test_forward_done_sends_nothing_new_without_pending_work():
    h = Harness("eager")
    h.arrive(3)
    h.done(0)
    assert len(h.pool.sent) == 1 and h.answered == [1]


def test_a_full_ring_keeps_the_request_at_the_head_until_an_answer_frees_room():
    h = Harness("eager", capacity=2)
    a, b, c = h.arrive(3), h.arrive(3), h.arrive(3)
    assert h.sent_ids() == [[a.request_id], [b.request_id]]
    assert h.sched.num_pending == 1 and list(h.sched.pending) == [c]
    h.done(0)
    assert h.sent_ids()[-1] == [c.request_id]


def test_a_long_prompt_queues_all_its_chunks_on_one_group_in_order():
    h = Harness("eager", groups=2, capacity=2, max_batch_tokens=100)
    long = h.arrive(250)
    assert [(b.group, b.spans) for b in h.pool.sent] == [(0, [(0, 100)]), (0, [(100, 200)])]
    assert long.worker == 0 and h.sched.pending[0] is long
    h.arrive(5)  # waits behind the long prompt's head-of-line chunk
    assert len(h.pool.sent) == 2
    h.done(0)
    assert [(b.group, b.spans) for b in h.pool.sent[2:]] == [(0, [(200, 250)]), (1, [(0, 5)])]
    h.done(0)
    h.done(0)
    h.done(1)
    assert long.num_chunks == 3 and len(h.answered) == 2


def test_a_cancelled_request_is_never_sent():
    h = Harness("eager", capacity=1)
    h.arrive(3)
    doomed = h.arrive(3)
    h.cancel(doomed)
    kept = h.arrive(3)
    h.done(0)
    assert h.sent_ids() == [[1], [kept.request_id]]


def test_eager_never_arms_a_timer():
    h = Harness("eager")
    h.arrive(3)
    assert not h.timer.armed
