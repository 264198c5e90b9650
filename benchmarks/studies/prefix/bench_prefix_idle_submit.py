"""An idle worker's path from `prefill()` to the ring: what the prefix cache adds per request.

One request at a time (unique lognormal(64, 0.5) prompts, ~4 full blocks each, 3 ms apart so
the worker is idle when each arrives) to a gpu-class `SimModel` engine, cache on (the default
1 GiB) and off, alternating arms. The harness wraps the path's functions in its own process
(nothing in the library changes when it is not run) and prints, per arm, the median
microseconds of each call and of `prefill()` entry to `send` (the batch handed to the pool).
At this rate every call runs cold (caches and branch predictors lost to idleness), which is
what a lightly loaded node's requests pay.

    python benchmarks/studies/prefix/bench_prefix_idle_submit.py [--rounds 2] [--requests 200]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import statistics
import time
from typing import Any

import numpy as np
import uvloop

import aioprefill.sched.batching as batching
import aioprefill.sched.prefix.cache as prefix_cache
import aioprefill.sched.prefix.plan as prefix_plan
import aioprefill.sched.scheduler as scheduler
from aioprefill import Engine, EngineConfig
from aioprefill.bench.presets import SIM_PRESETS
from aioprefill.engine.pool import pool as pool_module

CALLS: dict[str, list[float]] = collections.defaultdict(list)
ENTERED = [0]


def wrap(cls: Any, name: str, label: str) -> None:
    orig = getattr(cls, name)

    def timed(*a: Any, **k: Any) -> Any:
        t = time.perf_counter_ns()
        out = orig(*a, **k)
        CALLS[label].append((time.perf_counter_ns() - t) / 1e3)
        if label == "pool.send" and ENTERED[0]:
            CALLS["prefill->send"].append((t - ENTERED[0]) / 1e3)
            ENTERED[0] = 0
        return out

    setattr(cls, name, timed)


for cls, name, label in [
    (scheduler.Scheduler, "submit", "submit"),
    (batching.StagedBatch, "try_add", "try_add"),
    (prefix_cache.PrefixCache, "hashes", "hashes"),
    (prefix_cache.PrefixCache, "plan", "cache.plan"),
    (prefix_plan.BatchPlan, "place", "plan.place"),
    (batching.StagedBatch, "planned", "planned"),
    (pool_module.WorkerPool, "send", "pool.send"),
]:
    wrap(cls, name, label)


async def arm(cache_bytes: int, n: int, rng: np.random.Generator) -> dict[str, float]:
    def prompt() -> list[int]:
        size = max(1, int(rng.lognormal(np.log(64), 0.5)))
        return [int(x) for x in rng.integers(1, 32000, size)]

    config = EngineConfig(model=SIM_PRESETS["gpu-class"], prefix_cache_bytes=cache_bytes)
    async with Engine(config) as engine:
        for _ in range(20):  # warm-up
            await engine.prefill(prompt())
        CALLS.clear()
        for _ in range(n):
            p = prompt()
            ENTERED[0] = time.perf_counter_ns()
            await engine.prefill(p)
            await asyncio.sleep(0.003)
    return {k: statistics.median(v) for k, v in CALLS.items()}


async def main(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    for r in range(args.rounds):
        for name in ("on", "off") if r % 2 == 0 else ("off", "on"):
            medians = await arm(1 << 30 if name == "on" else 0, args.requests, rng)
            print(f"{name:3} " + "  ".join(f"{k} {v:.1f}" for k, v in sorted(medians.items())))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=200)
    uvloop.run(main(ap.parse_args()))
