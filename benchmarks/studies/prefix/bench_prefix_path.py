"""The CPU work on the path between two forwards, prefix cache off vs on, in one process.

Everything the cache can add to the bubble is CPU work on this path: the engine forming the
next batch once a forward ended (`Scheduler.dispatch`, the staged batch's hand-off), the pool
packing and encoding it (`Columns.pack`, `protocol.encode_into`), and the worker decoding it
(`protocol.decode_to_worker`: its forward starts once it holds the decoded batch). The rest of
a gap is the OS waking two processes, the same with the cache or without. Timed here with no
worker and no ring, so another job on the machine disturbs it far less than an end-to-end run:
per batch, the median over every batch of a backlog, best of the repeats, off and on
interleaved. The cache is full after a few batches (every write evicts), nothing is ever read.
Each path starts from an empty young generation (`gc.collect(0)`, untimed): a backlog drained in
a tight loop would otherwise land the collections of the previous batch's allocations (its
refill hashing the next prompts) in the next path, where in an engine the allocations of
everything else between two forwards decide when they fall.

Shapes: `gpu-class` is the default bench's saturation (prompts lognormal(64, 0.5) tokens,
batches of up to 8,192 tokens, the default budget's 512 blocks), `gpu-class 1/batch` the same
prompts one a batch (its 0.8x point: ~1.3 a batch); `512x16` is
`bench_prefix.py`'s no-reuse run (unique 512-token prompts, batches of 16, 4,096 blocks).
Also the engine's whole work per request (submit, hashing, planning, release), in us.

    python benchmarks/studies/prefix/bench_prefix_path.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np

from aioprefill.sched.columns import Columns
from aioprefill.sched.prefix import PrefixCache
from aioprefill.sched.scheduler import Scheduler
from aioprefill.sched.units import Budget, InFlightBatch
from aioprefill.wire import protocol


class _Slot:
    block_bytes, generation, usable = 1, 1, True
    in_flight: tuple = ()

    def __init__(self, blocks: int) -> None:
        self.cache_blocks = blocks


class _Pool:
    """What `WorkerPool.send` and the worker do with a batch, timed step by step."""

    def __init__(self, blocks: int) -> None:
        self.slots = [_Slot(blocks)]
        self.buffer = bytearray(1 << 16)
        self.stamps: list[tuple[int, int, int]] = []
        self.last: InFlightBatch | None = None

    def send(self, group: int, columns: Columns, *, backlogged: bool) -> InFlightBatch:
        t0 = time.perf_counter_ns()
        data = protocol.encode_into(columns.pack(1, [], t0), self.buffer)
        t1 = time.perf_counter_ns()
        protocol.decode_to_worker(data)
        t2 = time.perf_counter_ns()
        data.release()
        self.stamps.append((t0, t1, t2))
        self.last = InFlightBatch(1, columns.num_tokens, t0, backlogged)
        return self.last


def run(prompts: list[bytes], budget: Budget, blocks: int, on: bool) -> tuple[float, ...]:
    """(form us, pack+encode us, decode us) medians per batch; engine us per request."""
    pool = _Pool(blocks)
    cache = PrefixCache(pool.slots, 16) if on else None
    sched = Scheduler(budget, staging=True, cache=cache)
    begin = time.perf_counter_ns()
    for tokens in prompts:
        sched.submit(tokens, 0, None)
    form = []
    while sched.num_pending:
        gc.collect(0)  # each path from a fresh young generation (see the docstring)
        t = time.perf_counter_ns()
        sched.dispatch(0, pool, backlogged=True)
        form.append(pool.stamps[-1][0] - t)
        assert pool.last is not None
        sched.release(pool.last.chunks)
        sched.unpin(pool.last)
        sched.finish(len(pool.last.chunks))
    per_request = (time.perf_counter_ns() - begin) / 1e3 / len(prompts)
    encode = [b - a for a, b, _ in pool.stamps]
    decode = [c - b for _, b, c in pool.stamps]
    return (*(statistics.median(x) / 1e3 for x in (form, encode, decode)), per_request)


def shapes(rng: np.random.Generator, num: int) -> dict[str, tuple[list[bytes], Budget, int]]:
    lens = np.clip(rng.lognormal(np.log(64), 0.5, num), 1, 8192).astype(int)
    return {
        "gpu-class": (
            [rng.integers(1, 32000, n).astype("<i4").tobytes() for n in lens],
            Budget(8192, 256),
            512,
        ),
        # the 0.8x point of the default bench: ~1.3 requests a batch; here one
        "gpu-class 1/batch": (
            [rng.integers(1, 32000, n).astype("<i4").tobytes() for n in lens[: num // 4]],
            Budget(8192, 1),
            512,
        ),
        "512x16": (
            [rng.integers(1, 32000, 512).astype("<i4").tobytes() for _ in range(num // 4)],
            Budget(1 << 20, 16),
            4096,
        ),
    }


def main(repeats: int) -> None:
    print("| shape | cache | form (us) | pack + encode (us) | decode (us) | path total (us) |"
          " engine per request (us) |")  # fmt: skip
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name, (prompts, budget, blocks) in shapes(np.random.default_rng(3), 8000).items():
        best: dict[bool, list[tuple[float, ...]]] = {False: [], True: []}
        for i in range(repeats):
            for on in (False, True) if i % 2 == 0 else (True, False):
                best[on].append(run(prompts, budget, blocks, on))
        for on in (False, True):
            form, enc, dec, per_req = (min(col) for col in zip(*best[on], strict=True))
            print(f"| {name} | {'on' if on else 'off'} | {form:.1f} | {enc:.1f} | {dec:.1f} |"
                  f" {form + enc + dec:.1f} | {per_req:.2f} |")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    main(parser.parse_args().repeats)
