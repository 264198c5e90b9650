"""Tensor- and expert-parallel groups, each figure side by side with its baseline in one run.

1. Bubble: with a backlog and `SimModel(fixed_ms=2)`, the gap between one forward's end and the
   next forward's start (rank 0's clock), for one lone worker and for one tensor-parallel group
   of 2 ranks (the batch written to both rings, the next one sent once *both* answered; the
   ranks meet at a real barrier each step). Target: TP=2 <= 1.2x the lone worker.
2. EP idle: 2 `SimModel` ranks in one expert-parallel group, warmed up, then idle for
   `--idle-s`: empty batches per second (`engine.stats().empty_batches`) and the CPU time of
   the engine process and both ranks, for policy `forward` (a step only when work is pending)
   and the `ep-timer` baseline (a step every 5 ms, as the original design pushed empties).
3. EP under bursty load: the same group, gamma-distributed gaps (shape 0.25: bursts and lulls)
   at `--rate` requests/s for `--duration` s, lognormal prompt lengths: the share of rank-steps
   that ran an empty batch, and mean / p99 TTFT, `forward` vs `ep-timer`.

Every repeat runs both sides of each comparison back to back; the table shows medians over the
repeats, ratios taken within each repeat.

    python benchmarks/bench_parallel.py [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import time

import numpy as np
import uvloop
from common import proc_cpu_s

from aioprefill import Engine, EngineConfig, SimModel


async def bubble_us(tp_size: int, num_requests: int) -> float:
    """Median gap (us) between consecutive forwards of one group with a backlog."""
    cfg = EngineConfig(
        model=SimModel(fixed_ms=2.0, per_token_us=0.0), tp_size=tp_size, max_batch_size=4
    )
    async with Engine(cfg) as engine:
        results = await asyncio.gather(*(engine.prefill([1]) for _ in range(num_requests)))
    forwards = sorted({(r.forward_start_ns, r.forward_end_ns) for r in results})
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(forwards)][5:]
    return float(np.median(gaps)) / 1e3


def ep_config(policy: str) -> EngineConfig:
    model = SimModel(fixed_ms=2.0, per_token_us=20.0)
    return EngineConfig(model=model, num_workers=2, expert_parallel=True, policy=policy)


async def ep_idle(policy: str, seconds: float) -> tuple[float, float]:
    """(empty batches per second, CPU % of one core for the engine and both ranks) at idle."""
    async with Engine(ep_config(policy)) as engine:
        await asyncio.gather(*(engine.prefill([1, 2, 3]) for _ in range(8)))
        await asyncio.sleep(0.2)  # let the last step finish
        pids = [os.getpid(), *engine.worker_pids()]
        empties, cpu = engine.stats().empty_batches, sum(proc_cpu_s(p) for p in pids)
        t0 = time.monotonic()
        await asyncio.sleep(seconds)  # the engine idles: this sleep is the measurement window
        wall = time.monotonic() - t0
        empties = engine.stats().empty_batches - empties
        cpu = sum(proc_cpu_s(p) for p in pids) - cpu
    return empties / wall, 100.0 * cpu / wall


async def ep_load(
    policy: str, rate: float, duration: float, seed: int
) -> tuple[float, float, float]:
    """(share of empty rank-steps, mean TTFT ms, p99 TTFT ms) under bursty arrivals."""
    rng = np.random.default_rng(seed)
    n = max(1, int(rate * duration))
    gaps = rng.gamma(0.25, 1.0 / (0.25 * rate), n)
    lengths = np.clip(rng.lognormal(np.log(64), 0.7, n).astype(int), 1, 2048)
    async with Engine(ep_config(policy)) as engine:
        await asyncio.gather(*(engine.prefill([1, 2, 3]) for _ in range(8)))
        before = engine.stats()
        start = time.monotonic()
        tasks = []
        for gap, length in zip(np.cumsum(gaps), lengths, strict=True):
            delay = start + gap - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)  # open-loop arrivals: the load generator's clock
            prompt = rng.integers(0, 32000, int(length)).tolist()
            tasks.append(asyncio.ensure_future(engine.prefill(prompt)))
        results = await asyncio.gather(*tasks)
        after = engine.stats()
    ttft = np.array([(r.finished_ns - r.submitted_ns) / 1e6 for r in results])
    batches = after.batches - before.batches
    empty = after.empty_batches - before.empty_batches
    return empty / max(1, batches), float(ttft.mean()), float(np.percentile(ttft, 99))


def med(values: list[float]) -> float:
    return statistics.median(values)


async def main(args: argparse.Namespace) -> None:
    n_bubble = 1200 if args.quick else 4000
    idle_s = 1.0 if args.quick else args.idle_s
    rows: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    for rep in range(args.repeats):
        single, tp2 = await bubble_us(1, n_bubble), await bubble_us(2, n_bubble)
        add("bubble, lone worker (us)", single)
        add("bubble, TP=2 group (us)", tp2)
        add("bubble ratio TP=2 / lone", tp2 / single)
        for policy in ("forward", "ep-timer"):
            empties, cpu = await ep_idle(policy, idle_s)
            add(f"EP idle, {policy}: empty batches/s", empties)
            add(f"EP idle, {policy}: CPU % of a core (engine + 2 ranks)", cpu)
        loads = {
            p: await ep_load(p, args.rate, args.duration, seed=rep) for p in ("forward", "ep-timer")
        }
        for policy, (share, mean, p99) in loads.items():
            add(f"EP bursty, {policy}: empty rank-steps (%)", 100 * share)
            add(f"EP bursty, {policy}: TTFT mean (ms)", mean)
            add(f"EP bursty, {policy}: TTFT p99 (ms)", p99)
        add(
            "EP bursty: TTFT mean ratio forward / ep-timer",
            loads["forward"][1] / loads["ep-timer"][1],
        )
        add(
            "EP bursty: TTFT p99 ratio forward / ep-timer",
            loads["forward"][2] / loads["ep-timer"][2],
        )
        print(f"  repeat {rep} done", flush=True)
    width = max(map(len, rows))
    print(
        f"\nmedians over {args.repeats} repeats (--rate {args.rate:g} --duration {args.duration:g})"
    )
    for name, values in rows.items():
        print(f"  {name:<{width}}  {med(values):10.3f}   ({', '.join(f'{v:.3g}' for v in values)})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=2.0)
    parser.add_argument("--rate", type=float, default=100.0, help="requests/s for part 3")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds for part 3")
    uvloop.run(main(parser.parse_args()))
