"""Expert-parallel lockstep policies against a fake pool: a step goes to every rank (empty
batches only beside real work), the next step waits for every rank, and the ep-timer baseline
steps on its clock whatever is pending."""

from tests.policies.fake_pool import Harness


def lockstep(policy: str = "forward", **kw) -> Harness:
    return Harness(policy, groups=2, expert_parallel=True, **kw)


def step(h: Harness, first: int) -> list[tuple[int, list[int]]]:
    return [(b.group, b.ids) for b in h.pool.sent[first:]]


def test_one_request_runs_on_one_rank_and_the_other_gets_an_empty_batch():
    h = lockstep()
    r = h.arrive(5)
    assert step(h, 0) == [(0, [r.request_id]), (1, [])]


def test_nothing_pending_sends_nothing():
    h = lockstep()
    h.arrive(5)
    h.done(0)
    h.done(1)
    assert len(h.pool.sent) == 2 and h.timer.due_ns is None


def test_the_next_step_waits_for_every_rank_and_splits_by_tokens():
    h = lockstep()
    h.arrive(5)
    a, b, c = h.arrive(40), h.arrive(10), h.arrive(20)
    assert len(h.pool.sent) == 2  # the first step still runs
    h.done(1)  # the idle rank answers first: no step yet, rank 0 still runs
    assert len(h.pool.sent) == 2
    h.done(0)
    assert step(h, 2) == [(0, [a.request_id]), (1, [b.request_id, c.request_id])]


def test_a_chunked_prompt_continues_on_its_rank_while_the_other_takes_new_work():
    h = lockstep(max_batch_tokens=100)
    long = h.arrive(250)
    assert step(h, 0) == [(0, [long.request_id]), (1, [])]
    short = h.arrive(30)
    h.done(0)
    h.done(1)  # the step ends: rank 0 continues the prompt, rank 1 takes the new request
    assert step(h, 2) == [(0, [long.request_id]), (1, [short.request_id])]
    h.done(0)
    h.done(1)
    assert step(h, 4) == [(0, [long.request_id]), (1, [])]
    assert [s for s, _ in h.pool.sent[4].spans] == [200]


def test_a_rank_down_holds_every_step():
    h = lockstep()
    h.pool.slots[1].ready = False
    h.arrive(5)
    assert not h.pool.sent
    h.pool.slots[1].ready = True
    h.policy.on_capacity()
    assert len(h.pool.sent) == 2


def test_ep_timer_steps_on_its_clock_even_with_nothing_pending():
    h = lockstep("ep-timer")
    r = h.arrive(5)
    assert not h.pool.sent and h.timer.armed  # waits for the next tick
    h.fire_timer()
    assert step(h, 0) == [(0, [r.request_id]), (1, [])]
    h.done(0)
    h.done(1)
    h.fire_timer()  # idle: a step of empty batches all the same
    assert step(h, 2) == [(0, []), (1, [])]
    assert h.timer.armed  # and it keeps ticking
    h.fire_timer()  # the empty step still runs: this tick sends nothing
    assert len(h.pool.sent) == 4
