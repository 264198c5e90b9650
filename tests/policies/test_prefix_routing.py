"""Policies with a prefix cache, against a fake pool: requests cost their uncached tokens and
go to the group that holds (or is writing) their prefix unless waiting for it costs more than
it saves; then an idle group takes them, and keeps a second copy of the prefix."""

from tests.policies.fake_pool import Harness

PREFIX = list(range(100, 140))  # ten blocks of 4


def cached_of(h: Harness) -> list[int]:
    return [c.cached for c in h.pool.sent[-1].chunks]


def test_a_request_waits_for_the_busy_group_holding_its_prefix_while_the_other_works():
    h = Harness("forward", groups=2, cache_blocks=64, max_batch_tokens=200)
    h.arrive(ids=[*PREFIX, 1])
    h.done(0)  # group 0 now holds PREFIX
    h.arrive(ids=[7] * 8)  # group 0 busy with 8 tokens
    h.arrive(ids=[8] * 8)  # group 1 busy
    a = h.arrive(ids=[*PREFIX, 3])
    q = h.arrive(ids=[9] * 9)
    h.done(1)
    assert h.sent_ids()[-1] == [q.request_id]  # a waits: group 0 saves it 40 tokens, runs 8
    h.done(0)
    assert h.sent_ids()[-1] == [a.request_id] and cached_of(h) == [40]
    assert a.cached_tokens == 40


def writes_of(batch) -> int:
    """Blocks a sent batch writes (its write_slots column, int32)."""
    return 0 if batch.cache is None else len(batch.cache[3]) // 4


def test_an_idle_group_waits_while_the_home_serves_sooner_then_the_home_takes_it():
    h = Harness("forward", groups=2, cache_blocks=64)
    h.arrive(ids=[*PREFIX, 1])
    h.done(0)
    h.arrive(ids=[*PREFIX, *[7] * 8])  # its home is group 0: 8 tokens in flight (a wait of 4)
    a = h.arrive(ids=[*PREFIX, 3])  # against a gain of 40
    assert h.pool.sent[-1].group == 0 and not h.pool.slots[1].in_flight  # group 1 stays idle
    h.done(0)
    assert h.pool.sent[-1].group == 0 and h.sent_ids()[-1] == [a.request_id]
    assert cached_of(h) == [40]


def test_a_prefix_being_written_in_flight_makes_its_group_the_home():
    h = Harness("forward", groups=2, cache_blocks=64)
    first = h.arrive(ids=[*PREFIX, 1])  # group 0 computes and writes the prefix
    b = h.arrive(ids=[*PREFIX, 2])  # nothing is cached yet, but group 0 is writing it
    assert h.sent_ids() == [[first.request_id]] and not h.pool.slots[1].in_flight
    h.done(0)
    assert h.sent_ids()[-1] == [b.request_id] and cached_of(h) == [40]


def test_an_idle_group_takes_a_request_whose_home_is_too_busy_and_becomes_a_second_home():
    h = Harness("forward", groups=2, cache_blocks=64, max_batch_tokens=300)
    h.arrive(ids=[*PREFIX, 1])
    h.done(0)
    h.arrive(ids=[*PREFIX, *[7] * 200])  # on group 0: a wait of 100, over 2 x the 40 it saves
    a = h.arrive(ids=[*PREFIX, 3])
    batch = h.pool.sent[-1]
    assert batch.group == 1 and batch.ids == [a.request_id] and cached_of(h) == [0]
    assert writes_of(batch) == 10  # the prefix queues at group 0: group 1 keeps a copy too
    h.done(1)
    r = h.arrive(ids=[*PREFIX, 4])  # group 1 idle, group 0 still busy: read on group 1
    assert h.pool.sent[-1].group == 1 and h.sent_ids()[-1] == [r.request_id]
    assert cached_of(h) == [40]


def test_the_requests_left_to_a_home_count_in_its_wait_and_the_rest_go_elsewhere():
    h = Harness("forward", groups=2, cache_blocks=64, max_batch_tokens=400, max_batch_size=16)
    h.arrive(ids=[*PREFIX, 1])
    h.done(0)
    h.arrive(ids=[*PREFIX, *[7] * 8])  # on group 0 (its home): a wait of 4
    # Each saves 40 tokens (2 x 40 = 80) at group 0 and leaves 31 to compute there: the
    # first three wait (4, 35, 66 < 80), the fourth would wait 97 and runs on group 1.
    reqs = [h.arrive(ids=[*PREFIX, *[i] * 31]) for i in range(4)]
    assert not any(b.group == 1 and b.ids != [reqs[3].request_id] for b in h.pool.sent)
    assert h.pool.sent[-1].group == 1 and h.sent_ids()[-1] == [reqs[3].request_id]
    h.done(0)
    assert h.sent_ids()[-1] == [r.request_id for r in reqs[:3]] and cached_of(h) == [40] * 3


def test_a_new_prefix_goes_to_the_idle_group_that_stored_least():
    h = Harness("forward", groups=3, cache_blocks=64)
    h.arrive(ids=[*PREFIX, 1])  # all stored nothing: group 0
    h.done(0)
    b = h.arrive(ids=list(range(300, 321)))  # group 0 stored 10 blocks: group 1 takes it
    assert h.pool.sent[-1].group == 1 and h.sent_ids()[-1] == [b.request_id]
    h.done(1)
    c = h.arrive(ids=list(range(400, 409)))  # groups 0 and 1 stored 10 and 5: group 2
    assert h.pool.sent[-1].group == 2 and h.sent_ids()[-1] == [c.request_id]


def test_uncached_tokens_fill_the_budget():
    h = Harness("forward", cache_blocks=64, max_batch_tokens=45)
    h.arrive(ids=[*PREFIX, 1])
    h.done(0)
    h.arrive(ids=[5] * 4)  # busy
    reqs = [h.arrive(ids=PREFIX + [i] * 3) for i in range(5)]  # 43 tokens, 40 of them cached
    h.done(0)
    assert h.sent_ids()[-1] == [r.request_id for r in reqs]  # 5 x 3 uncached tokens <= 45
    assert cached_of(h) == [40] * 5


def test_eager_and_timeout_read_what_the_chosen_group_holds():
    for policy in ("eager", "timeout"):
        h = Harness(policy, cache_blocks=64, max_batch_tokens=100, batch_timeout_ms=1.0)
        h.arrive(ids=[*PREFIX, 1])
        if policy == "timeout":
            h.fire_timer()
        h.done(0)
        r = h.arrive(ids=[*PREFIX, 2])
        if policy == "timeout":
            h.fire_timer()
        assert h.sent_ids()[-1] == [r.request_id] and cached_of(h) == [40], policy
        h.done(0)


def test_expert_parallel_ranks_each_read_their_own_cache():
    h = Harness("forward", groups=2, cache_blocks=64, expert_parallel=True)
    h.arrive(ids=[*PREFIX, 1])
    sent = {b.group: b for b in h.pool.sent}
    h.done(0)
    h.done(1)
    holder = next(g for g, b in sent.items() if b.ids)
    h.arrive(ids=[*PREFIX, 2])
    step = {b.group: b for b in h.pool.sent[-2:]}
    assert holder == 0 and step[0].ids and not step[1].ids  # both on the lighter rank 0
    assert [c.cached for c in step[0].chunks] == [40]
