"""The prefix cache's engine side, each figure cache on next to cache off in one run.

1. Hashing: `block_hashes` of a 15k-token prompt (what every request pays once, at submit).
2. No reuse: a backlog of random 512-token prompts (32 blocks each, none ever seen again) on one
   `SimModel(fixed_ms=2)` worker, batches of 16: requests/s and the bubble between forwards,
   cache off and on interleaved (ABBA...), so the cost of hashing, planning and writing blocks
   that are never read is measured against the same machine state.
3. Scheduling cost in process (a real `Scheduler` and `PrefixCache` against a sink that accepts
   every batch; no workers, so the machine's other load matters far less): microseconds per
   request to submit, form and send batches of 16 and release them, cache off vs on, for 1-token
   prompts (nothing to hash), unique 512-token prompts (32 blocks hashed and written each, never
   read) and a repeated 512-token prompt (31 blocks read each); the best of 5 interleaved runs.
4. Reuse: 32 prompts sharing a 1,000-token prefix plus 50 tokens each, sent at once after the
   prefix was seen once: tokens computed (`stats().tokens`), and a chat turn (1,000 tokens of
   history + 50 new) with the tiny Llama's CPU cost model: its forward time, on vs off.

    python benchmarks/bench_prefix.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import time

import numpy as np
import uvloop

from aioprefill import Engine, EngineConfig, SimModel
from aioprefill.sched.columns import Columns
from aioprefill.sched.prefix import PrefixCache, block_hashes
from aioprefill.sched.scheduler import Scheduler
from aioprefill.sched.units import Budget, InFlightBatch


def hashing(repeats: int) -> tuple[float, int]:
    tokens = np.random.default_rng(0).integers(0, 32000, 15_000).astype("<i4").tobytes()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        hashes = block_hashes(tokens, 16)
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1e6, len(hashes)


async def no_reuse(cache_bytes: int, num: int, rng: random.Random) -> tuple[float, float]:
    """(requests/s, median bubble in us) for a backlog of unique 512-token prompts."""
    cfg = EngineConfig(
        model=SimModel(fixed_ms=2.0, per_token_us=0.0),
        max_batch_size=16,
        prefix_cache_bytes=cache_bytes,
    )
    prompts = [[rng.randrange(32000) for _ in range(512)] for _ in range(num)]
    async with Engine(cfg) as engine:
        await asyncio.gather(*(engine.prefill(p) for p in prompts[:64]))  # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*(engine.prefill(p) for p in prompts[64:]))
        elapsed = time.perf_counter() - t0
    forwards = sorted({(r.forward_start_ns, r.forward_end_ns) for r in results})
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(forwards)][3:]
    return len(results) / elapsed, statistics.median(gaps) / 1e3


class _Slot:
    cache_blocks, block_bytes, generation, usable = 4096, 1, 1, True
    in_flight: tuple = ()


class _Sink:
    """Accepts every batch (packing it, as the pool does before encoding)."""

    def __init__(self) -> None:
        self.slots = [_Slot()]
        self.last: InFlightBatch | None = None

    def send(self, group: int, columns: Columns, *, backlogged: bool) -> InFlightBatch:
        columns.pack(1, [], 0)
        self.last = InFlightBatch(1, columns.num_tokens, 0, backlogged)
        return self.last


def scheduling_us(prompts: list[bytes], cache_on: bool) -> float:
    """Microseconds per request: submit all, then dispatch batches of 16 and answer each."""
    sink = _Sink()
    cache = PrefixCache(sink.slots, 16) if cache_on else None
    sched = Scheduler(Budget(1 << 20, 16), staging=True, cache=cache)
    t0 = time.perf_counter_ns()
    for tokens in prompts:
        sched.submit(tokens, 0, None)
    while sched.num_pending:
        sched.dispatch(0, sink, backlogged=True)
        assert sink.last is not None
        sched.release(sink.last.chunks)
        sched.unpin(sink.last)
        sched.finish(len(sink.last.chunks))
    return (time.perf_counter_ns() - t0) / 1e3 / len(prompts)


def scheduling(num: int) -> list[tuple[str, float, float]]:
    rng = np.random.default_rng(3)
    one = [np.asarray([1], "<i4").tobytes()] * num
    unique = [rng.integers(0, 32000, 512).astype("<i4").tobytes() for _ in range(num)]
    same = [unique[0]] * num
    rows = []
    for name, prompts in (("1-token", one), ("unique 512", unique), ("repeated 512", same)):
        off, on = [], []
        for _ in range(5):
            off.append(scheduling_us(prompts, False))
            on.append(scheduling_us(prompts, True))
        rows.append((name, min(off), min(on)))
    return rows


async def reuse(cache_bytes: int) -> tuple[int, float]:
    """(tokens computed for the 32-prompt burst, forward ms of one chat turn)."""
    model = SimModel(fixed_ms=3.0, per_token_us=134.0, attn_ns=145.0)  # the tiny Llama on CPU
    rng = random.Random(1)
    prefix = [rng.randrange(32000) for _ in range(1000)]
    async with Engine(EngineConfig(model=model, prefix_cache_bytes=cache_bytes)) as engine:
        await engine.prefill([*prefix, 1])
        before = engine.stats().tokens
        burst = [prefix + [rng.randrange(32000) for _ in range(50)] for _ in range(32)]
        await asyncio.gather(*(engine.prefill(p) for p in burst))
        computed = engine.stats().tokens - before
        turn = await engine.prefill(prefix + [rng.randrange(32000) for _ in range(50)])
    return computed, (turn.forward_end_ns - turn.forward_start_ns) / 1e6


async def main(args: argparse.Namespace) -> None:
    ms, blocks = hashing(20 if args.quick else 100)
    print(f"### Hashing\n\n15,000-token prompt ({blocks} blocks): {ms:.2f} ms median\n")
    rng = random.Random(7)
    num = 1200 if args.quick else 4000
    rows: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    for label in ["off", "on", "on", "off"] * (1 if args.quick else 2):
        rows[label].append(await no_reuse(0 if label == "off" else 1 << 30, num, rng))
    print("### No reuse: unique 512-token prompts, SimModel(fixed_ms=2), batches of 16\n")
    print("| cache | requests/s (per run) | bubble p50 us (per run) |")
    print("| --- | --- | --- |")
    for label, runs in rows.items():
        rates = ", ".join(f"{r:,.0f}" for r, _ in runs)
        print(f"| {label} | {rates} | {', '.join(f'{b:.0f}' for _, b in runs)} |")
    rate = statistics.median(r for r, _ in rows["on"]) / statistics.median(
        r for r, _ in rows["off"]
    )
    gap = statistics.median(b for _, b in rows["on"]) / statistics.median(b for _, b in rows["off"])
    print(f"\non/off (medians): requests/s {rate:.3f}, bubble {gap:.2f}\n")
    print("### Scheduling cost in process, us per request (best of 5, interleaved)\n")
    print("| prompts | cache off | cache on | on - off |")
    print("| --- | --- | --- | --- |")
    for name, off_us, on_us in scheduling(2000 if args.quick else 8000):
        print(f"| {name} | {off_us:.2f} | {on_us:.2f} | {on_us - off_us:+.2f} |")
    print()
    off, on = await reuse(0), await reuse(1 << 30)
    print("### Reuse: 32 prompts = 1,000 shared tokens + 50 each; a 1,050-token chat turn\n")
    print("| cache | tokens computed (burst) | chat turn forward ms |")
    print("| --- | --- | --- |")
    for label, (tokens, turn_ms) in (("off", off), ("on", on)):
        print(f"| {label} | {tokens:,} | {turn_ms:.1f} |")
    print(
        f"\nprefix + 32 suffixes = {1000 + 32 * 50:,} tokens; turn speed-up {off[1] / on[1]:.1f}x"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    uvloop.run(main(parser.parse_args()))
