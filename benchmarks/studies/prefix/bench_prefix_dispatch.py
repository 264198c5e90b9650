"""The prefix cache's share of the bubble, in process: per batch, the time from the call that
forms it (a forward ended) to the moment it is handed to the pool, cache off vs on.

A real `Scheduler` (policy `forward`'s staged batch) and `PrefixCache` on one group, against a
sink that accepts every batch; unique prompts (nothing ever read, every block written, the
cache full after a few batches so each write evicts), batches of 16; the median over all
batches, best of 5 interleaved runs. No workers: the figure is the engine's own work between a
forward's end and the next batch's write, which the machine's other load disturbs far less than
an end-to-end run.

    python benchmarks/studies/prefix/bench_prefix_dispatch.py [LENGTH ...]   (default: 64 512)

Run from a copy of an older commit (`git archive REV aioprefill benchmarks | tar -x -C DIR`,
then this script with `PYTHONPATH=DIR`, from the copy's own benchmarks/ folder) for the
before figure.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from aioprefill.sched.columns import Columns
from aioprefill.sched.prefix import PrefixCache
from aioprefill.sched.scheduler import Scheduler
from aioprefill.sched.units import Budget, InFlightBatch


class _Slot:
    cache_blocks, block_bytes, generation, usable = 4096, 1, 1, True
    in_flight: tuple = ()


class _Sink:
    def __init__(self) -> None:
        self.slots = [_Slot()]
        self.at = 0
        self.last: InFlightBatch | None = None

    def send(self, group: int, columns: Columns, *, backlogged: bool) -> InFlightBatch:
        self.at = time.perf_counter_ns()
        columns.pack(1, [], 0)
        self.last = InFlightBatch(1, columns.num_tokens, 0, backlogged)
        return self.last


def dispatch_us(prompts: list[bytes], cache_on: bool) -> float:
    """Median microseconds from `dispatch` to the sink's `send`, over every batch."""
    sink = _Sink()
    cache = PrefixCache(sink.slots, 16) if cache_on else None
    sched = Scheduler(Budget(1 << 20, 16), staging=True, cache=cache)
    for tokens in prompts:
        sched.submit(tokens, 0, None)
    gaps = []
    while sched.num_pending:
        t0 = time.perf_counter_ns()
        sched.dispatch(0, sink, backlogged=True)
        gaps.append(sink.at - t0)
        assert sink.last is not None
        sched.release(sink.last.chunks)
        sched.unpin(sink.last)
        sched.finish(len(sink.last.chunks))
    return statistics.median(gaps) / 1e3


def main(lengths: list[int]) -> None:
    rng = np.random.default_rng(3)
    print("| prompt tokens | cache off (us) | cache on (us) |")
    print("| --- | --- | --- |")
    for n in lengths:
        prompts = [rng.integers(0, 32000, n).astype("<i4").tobytes() for _ in range(2000)]
        off, on = [], []
        for _ in range(5):
            off.append(dispatch_us(prompts, False))
            on.append(dispatch_us(prompts, True))
        print(f"| {n} | {min(off):.1f} | {min(on):.1f} |")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [64, 512])
