"""A prompt queued behind others is hashed when a batch is about to need it (after the batch
before it was written), not when it arrives; its hashes are the same either way."""

from __future__ import annotations

import numpy as np

from aioprefill.sched.prefix import PrefixCache, block_hashes
from aioprefill.sched.scheduler import Scheduler
from aioprefill.sched.units import Budget, InFlightBatch
from tests.prefix.test_index import B, groups


class _Sink:
    def __init__(self) -> None:
        self.slots = groups(1, 64)
        self.sent: list[InFlightBatch] = []

    def send(self, group, columns, *, backlogged):
        batch = InFlightBatch(len(self.sent), columns.num_tokens, 0, backlogged)
        self.sent.append(batch)
        return batch


def test_queued_prompts_are_hashed_after_the_batch_before_them_went():
    sink = _Sink()
    sched = Scheduler(Budget(max_batch_tokens=24, max_batch_size=2), staging=True,
                      cache=PrefixCache(sink.slots, B))  # fmt: skip
    prompts = [np.arange(i * 100, i * 100 + 12, dtype="<i4").tobytes() for i in range(7)]
    reqs = [sched.submit(p, 0, None) for p in prompts]
    # the first two joined the staged batch (hashed to check what the cache holds); the
    # third found it full, the rest queued behind it: none of those hashed yet
    assert [r.hasher is None for r in reqs] == [True, True] + [False] * 5
    assert sched.dispatch(0, sink, backlogged=True)
    # sent: the next two staged (hashed), and the next batch's worth of the queue ahead
    assert [r.hasher is None for r in reqs] == [True] * 6 + [False]
    for r, p in zip(reqs, prompts, strict=True):  # read: hashed now if it was not
        assert r.hashes == block_hashes(p, B)
    assert sched.dispatch(0, sink, backlogged=True) and len(sink.sent) == 2
