"""Policies with a prefix cache, against a fake pool: requests cost their uncached tokens,
go to the group that holds their prefix unless waiting for it costs more, and no idle group is
left idle while requests wait."""

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


def test_an_idle_group_takes_a_request_rather_than_stay_idle():
    h = Harness("forward", groups=2, cache_blocks=64)
    h.arrive(ids=[*PREFIX, 1])
    h.done(0)
    h.arrive(ids=[7] * 8)  # group 0 busy
    a = h.arrive(ids=[*PREFIX, 3])  # group 1 is idle: it takes it, uncached
    assert h.pool.sent[-1].group == 1 and h.sent_ids()[-1] == [a.request_id]
    assert cached_of(h) == [0]


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
