"""Policy `forward` with several groups, against a fake pool: a group takes its fair share of
the pending work (`policies/share.py`), not the whole burst; `forward-greedy` keeps the old rule
as a baseline. Time is the harness's clock, so the fitted cost model is exact."""

import pytest

from aioprefill.sched.policies.share import FairShare
from tests.policies.fake_pool import FakeBatch, FakeGroup, Harness

PREFIX = list(range(100, 140))  # ten blocks of 4


def burst(policy: str, n: int = 8, *, at_ns: int = 0) -> tuple[Harness, list[int]]:
    """Group 0 and group 1 each run one 10-token request; `n` more of 10 tokens wait."""
    h = Harness(policy, groups=2, max_batch_tokens=1000, max_batch_size=64)
    h.arrive(10, at_ns=at_ns)
    h.arrive(10, at_ns=at_ns)
    assert [b.group for b in h.pool.sent] == [0, 1]
    return h, [h.arrive(10, at_ns=at_ns).request_id for _ in range(n)]


def test_the_group_free_first_takes_its_share_and_the_next_one_the_rest():
    h, waiting = burst("forward")
    h.done(0, at_ns=10_000)  # 1,000 ns/token; group 1's forward is as far along: done
    assert h.pool.sent[-1].group == 0 and h.sent_ids()[-1] == waiting[:4]
    h.done(1, at_ns=10_000)
    assert h.pool.sent[-1].group == 1 and h.sent_ids()[-1] == waiting[4:]
    h.done(0)
    h.done(1)
    assert sorted(h.answered) == sorted([1, 2, *waiting]) and h.sched.num_in_flight == 0


def test_the_greedy_baseline_gives_the_first_group_free_the_whole_burst():
    h, waiting = burst("forward-greedy")
    h.done(0, at_ns=10_000)
    assert h.sent_ids()[-1] == waiting
    h.done(1, at_ns=10_000)
    assert len(h.pool.sent) == 3  # group 1 found nothing to do


def test_a_group_takes_more_while_its_peer_still_has_a_long_forward_to_run():
    h = Harness("forward", groups=2, max_batch_tokens=1000, max_batch_size=64)
    h.arrive(10, at_ns=0)
    h.arrive(100, at_ns=0)  # group 1: 100 tokens, 90 of them left when group 0 is done
    waiting = [h.arrive(10, at_ns=0).request_id for _ in range(8)]
    h.done(0, at_ns=10_000)
    # share = ceil((80 waiting + 90 left on group 1) / 2) = 85: eight of ten tokens fit
    assert h.sent_ids()[-1] == waiting[:8]


def test_idle_groups_get_their_shares_at_once():
    for policy, sizes in (("forward", [4, 4]), ("forward-greedy", [8])):
        h = Harness(policy, groups=2, max_batch_tokens=1000, max_batch_size=64)
        for g in h.pool.slots:
            g.ready = False  # (both restarting while the burst arrives)
        waiting = [h.arrive(10).request_id for _ in range(8)]
        assert not h.pool.sent
        for g in h.pool.slots:
            g.ready = True
        h.policy.on_capacity()
        h.check()
        assert [len(ids) for ids in h.sent_ids()] == sizes, policy
        assert [i for ids in h.sent_ids() for i in ids] == waiting  # first come first served


def test_a_staged_batch_over_the_share_goes_back_in_order_and_cancelled_ones_are_dropped():
    h, waiting = burst("forward")
    assert h.sched.staged.ids == waiting
    h.cancel(h.sched.staged.requests[1])
    h.done(0, at_ns=10_000)  # share = ceil((70 + 0) / 2) = 35: three of ten (a fourth would
    assert h.sent_ids()[-1] == [waiting[0], *waiting[2:4]]  # put the midpoint at 35)
    assert not h.sched.staged and h.sched.num_pending == 4
    h.done(1, at_ns=10_000)  # ceil((40 + 30 just sent to group 0) / 2) = 35
    assert h.sent_ids()[-1] == waiting[4:7]
    h.done(0, at_ns=40_000)
    assert h.sent_ids()[-1] == waiting[7:]
    h.done(1)
    h.done(0)
    assert waiting[1] not in h.answered and h.sched.num_in_flight == 0


def test_requests_with_a_home_still_go_home_and_the_rest_is_shared():
    h = Harness("forward", groups=2, cache_blocks=64, max_batch_tokens=400, max_batch_size=16)
    h.arrive(ids=[*PREFIX, 1])
    h.done(0)  # group 0 holds PREFIX
    h.arrive(ids=[7] * 8)  # group 1 (it stored least)
    h.arrive(ids=[8] * 8)  # group 0
    homed = [h.arrive(ids=[*PREFIX, i]).request_id for i in range(4)]
    plain = [h.arrive(ids=[9] * 10).request_id for _ in range(4)]
    h.done(1)
    assert h.pool.sent[-1].group == 1 and h.sent_ids()[-1] == plain
    h.done(0)
    assert h.pool.sent[-1].group == 0 and h.sent_ids()[-1] == homed
    assert [c.cached for c in h.pool.sent[-1].chunks] == [40] * 4


# ---- FairShare itself -------------------------------------------------------------------


class Clock:
    now = 0

    def __call__(self) -> int:
        return self.now


def timed(share: FairShare, clock: Clock, group: FakeGroup, tokens: int, ns: int) -> None:
    batch = FakeBatch(group.index, [0], [(0, tokens)], False)
    group.in_flight.append(batch)
    share.sent(group.index, batch)
    clock.now += ns
    group.in_flight.popleft()
    share.ended_unless_in(group.index, group.in_flight)


def test_the_cost_model_is_fitted_from_timed_forwards_and_estimates_what_is_left():
    clock = Clock()
    share = FairShare(clock)
    g0, g1 = FakeGroup(0), FakeGroup(1)
    for tokens in (100, 1000, 300, 2000):  # gpu-class: 10.9 ms + 25.7 us/token
        timed(share, clock, g0, tokens, int(10.9e6 + 25.7e3 * tokens))
    assert share.fixed_ns == pytest.approx(10.9e6, rel=1e-6)
    assert share.ns_per_token == pytest.approx(25.7e3, rel=1e-6)
    batch = FakeBatch(1, [0], [(0, 1000)], False)
    g1.in_flight.append(batch)
    share.sent(1, batch)
    total = 10.9e6 + 25.7e3 * 1000
    assert share.to_run(g1, clock.now) == pytest.approx(total / 25.7e3)
    clock.now += int(total / 2)
    assert share.to_run(g1, clock.now) == pytest.approx(total / 2 / 25.7e3, abs=1e-3)
    # It would take ceil((1000 + 712) / 2) = 856 and leave 144 tokens, 3.7 ms of work: less
    # than the 10.9 ms a forward costs anyway, so it takes all it can.
    assert share.share(0, [g0, g1], 1000) is None
    assert share.share(0, [g0, g1], 3000) == -int(-(3000 + total / 2 / 25.7e3) // 2)
    clock.now += int(total)
    assert share.share(0, [g0, g1], 1000) == 500  # group 1 is due: half each (11.9 ms left)
    assert share.share(0, [g0, g1], 800) is None  # (400 tokens: 10.3 ms)
    g1.ring_full = True
    assert share.share(0, [g0, g1], 1000) is None  # only one usable group: no sharing


def test_before_any_forward_was_timed_a_batch_in_flight_counts_whole():
    share = FairShare(Clock())
    g0, g1 = FakeGroup(0), FakeGroup(1)
    g1.in_flight.append(FakeBatch(1, [0], [(0, 300)], False))
    assert share.to_run(g1, 0) == 300 and share.share(0, [g0, g1], 101) == 201
