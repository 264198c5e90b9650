"""Recovery decisions on plain data: who is retried after a death, and the restart backoff."""

from aioprefill.engine.pool.backoff import RestartBackoff
from aioprefill.engine.recovery import plan_recovery
from aioprefill.sched.batching import Chunk, Request
from tests.policies.fake_pool import FakeBatch


def req(rid: int, n: int = 4, attempts: int = 0) -> Request:
    r = Request(request_id=rid, tokens=bytes(4 * n), submitted_ns=0)
    r.attempts = attempts
    return r


def batch(*chunks: Chunk) -> FakeBatch:
    return FakeBatch(0, [], [], True, list(chunks))


def test_each_live_request_once_in_ring_order_retry_until_max_retries():
    a, b, c, d = req(1), req(2, attempts=2), req(3), req(4, n=300)
    c.cancelled = True
    lost = [batch(Chunk(a, 0, 4), Chunk(d, 0, 100)), batch(Chunk(b, 0, 4), Chunk(c, 0, 4))]
    pinned = [d]  # also queued between its chunks: counted once
    retry, fail = plan_recovery(lost, pinned, max_retries=2, may_retry=True)
    assert [r.request_id for r in retry] == [1, 4] and [r.request_id for r in fail] == [2]


def test_nothing_is_retried_while_closing():
    a = req(1)
    retry, fail = plan_recovery([batch(Chunk(a, 0, 4))], [], max_retries=3, may_retry=False)
    assert retry == [] and fail == [a]


def test_backoff_doubles_within_the_window_then_gives_up():
    b = RestartBackoff(window_s=60.0, max_restarts=3)
    assert [b.note_death(t) for t in (0.0, 1.0, 2.0)] == [0.05, 0.1, 0.2]
    assert b.note_death(3.0) is None and b.gave_up


def test_deaths_outside_the_window_are_forgotten():
    b = RestartBackoff(window_s=10.0, max_restarts=1)
    assert b.note_death(0.0) == 0.05
    assert b.note_death(20.0) == 0.05 and not b.gave_up
