"""One group with a prefix cache: prompts the group holds nothing of wait in the staged batch
(the O(1) hand-off), and their reads and writes are planned when it is sent."""

import numpy as np

from tests.policies.fake_pool import Harness

PREFIX = list(range(100, 140))  # ten blocks of 4


def test_prompts_with_new_blocks_are_staged_and_write_them_when_sent():
    h = Harness("forward", cache_blocks=64)
    h.arrive(ids=[5] * 3)  # the group is busy
    a = h.arrive(ids=list(range(1, 10)))  # two new blocks
    b = h.arrive(ids=list(range(50, 59)))
    assert h.sched.staged.requests == [a, b] and not h.sched.pending
    h.done(0)
    batch = h.pool.sent[-1]
    assert batch.ids == [a.request_id, b.request_id] and batch.cache is not None
    assert list(np.frombuffer(batch.cache[2], "<i4")) == [0, 2, 4]  # each writes its 2 blocks
    assert [c.cached for c in batch.chunks] == [0, 0] and batch.spans == [(0, 9), (0, 9)]
    h.done(0)
    again = h.arrive(ids=list(range(1, 10)))  # the group holds its first block: not staged
    assert h.pool.sent[-1].ids == [again.request_id] and again.cached_tokens == 8


def test_a_staged_prompt_reads_what_an_earlier_one_of_its_batch_writes():
    h = Harness("forward", cache_blocks=64)
    h.arrive(ids=[5] * 3)
    a = h.arrive(ids=[*PREFIX, 1])
    b = h.arrive(ids=[*PREFIX, 2])  # the group holds none of it yet: staged too
    assert h.sched.staged.requests == [a, b]
    h.done(0)
    batch = h.pool.sent[-1]
    assert [c.cached for c in batch.chunks] == [0, 40]  # b reads a's blocks (piggyback)
    assert batch.spans == [(0, 41), (40, 41)] and b.cached_tokens == 40


def test_a_prompt_the_group_holds_waits_in_the_queue_and_stops_staging_behind_it():
    h = Harness("forward", cache_blocks=64, max_batch_tokens=45)
    h.arrive(ids=[*PREFIX, 1])
    h.done(0)
    h.arrive(ids=[5] * 3)  # busy
    hit = h.arrive(ids=[*PREFIX, 2])  # its first block is held: formed by take_batch
    new = h.arrive(ids=list(range(1, 10)))  # behind it in the queue, not staged
    assert not h.sched.staged.requests and list(h.sched.pending) == [hit, new]
    h.done(0)
    assert h.sent_ids()[-1] == [hit.request_id, new.request_id]  # 1 + 9 uncached tokens
    assert [c.cached for c in h.pool.sent[-1].chunks] == [40, 0]


def test_a_cancelled_staged_prompt_gives_its_slots_back():
    h = Harness("forward", cache_blocks=4)
    h.arrive(ids=[5] * 3)
    a = h.arrive(ids=list(range(1, 10)))  # 2 blocks pinned as it joins
    b = h.arrive(ids=list(range(50, 59)))  # 2 more: every slot pinned
    h.cancel(a)  # (the harness recounts slots and pins after every event)
    h.done(0)
    batch = h.pool.sent[-1]
    assert batch.ids == [b.request_id] and batch.cache is not None
    assert list(np.frombuffer(batch.cache[2], "<i4")) == [0, 2]
    assert len(h.sched.cache.indexes[0]) == 2  # a's blocks forgotten, b's held


def test_a_group_restart_voids_the_plan_made_while_staging():
    h = Harness("forward", cache_blocks=64)
    h.arrive(ids=[5] * 3)
    a = h.arrive(ids=list(range(1, 10)))
    h.sched.lost_group(0)  # the group died and restarted: its index starts empty
    h.pool.slots[0].generation += 1
    h.check()
    h.done(0)
    batch = h.pool.sent[-1]
    assert batch.ids == [a.request_id] and batch.cache is not None
    assert list(np.frombuffer(batch.cache[3], "<i4")) == [0, 1]  # planned again, afresh


def test_a_staged_prompt_costs_only_what_it_does_not_read_from_an_earlier_one():
    h = Harness("forward", cache_blocks=64, max_batch_tokens=45)
    h.arrive(ids=[5] * 3)
    a = h.arrive(ids=[*PREFIX, 1])  # 41 tokens
    b = h.arrive(ids=[*PREFIX, 2])  # reads a's 40: costs 1 (42 <= 45)
    c = h.arrive(ids=[*PREFIX, 7, 8, 9, 10, 11])  # reads 40, computes 5: 47 > 45, queued
    assert h.sched.staged.requests == [a, b] and list(h.sched.pending) == [c]
    h.done(0)
    assert h.sent_ids()[-1] == [a.request_id, b.request_id]
