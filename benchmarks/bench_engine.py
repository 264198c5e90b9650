"""Engine-level costs, each side by side with its floor in one run.

1. Bubble: with a backlog and `SimModel(fixed_ms=2)`, the gap between one forward's end and the
   next forward's start on one worker (worker clocks), next to a bare eventfd round trip
   between two processes (asyncio/uvloop on one side, a blocking read on the other) measured
   in the same run: the wake-up floor any hand-off pays.
2. Overhead: requests/s through the whole engine with `SimModel(fixed_ms=0)` and 1-token prompts,
   for the forward and eager policies, and (with --profile) where the engine's time goes.
3. Idle: CPU time used by the engine process plus 2 idle workers over 10 s.

    python benchmarks/bench_engine.py [--quick] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import multiprocessing as mp
import os
import pstats
import statistics
import sys
import time

import numpy as np
import uvloop

from aioprefill import Engine, EngineConfig, SimModel


def _echo_child(fd_in: int, fd_out: int) -> None:
    while True:
        os.eventfd_read(fd_in)
        os.eventfd_write(fd_out, 1)


async def eventfd_round_trip(n: int) -> np.ndarray:
    """Round trip: loop writes efd A; child (blocking read) writes efd B; loop wakes on B."""
    a, b = os.eventfd(0), os.eventfd(0, os.EFD_NONBLOCK)
    ctx = mp.get_context("fork")  # no paddle in this process: fork is safe here
    child = ctx.Process(target=_echo_child, args=(a, b), daemon=True)
    child.start()
    loop = asyncio.get_running_loop()
    samples = np.empty(n, dtype=np.int64)
    waiter: asyncio.Future[None] | None = None

    def on_b() -> None:
        os.eventfd_read(b)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    loop.add_reader(b, on_b)
    try:
        for i in range(n + 200):
            waiter = loop.create_future()
            t0 = time.perf_counter_ns()
            os.eventfd_write(a, 1)
            await waiter
            if i >= 200:
                samples[i - 200] = time.perf_counter_ns() - t0
    finally:
        loop.remove_reader(b)
        child.kill()
        child.join()
        os.close(a)
        os.close(b)
    return samples


async def bubble(num_requests: int) -> np.ndarray:
    """Gaps between consecutive forwards on one worker while a backlog waits."""
    cfg = EngineConfig(model=SimModel(fixed_ms=2.0, per_token_us=0.0), max_batch_size=4)
    async with Engine(cfg) as engine:
        results = await asyncio.gather(*(engine.prefill([1]) for _ in range(num_requests)))
    forwards = sorted({(r.forward_start_ns, r.forward_end_ns) for r in results})
    gaps = [b[0] - a[1] for a, b in zip(forwards, forwards[1:], strict=False)]
    return np.asarray(gaps[5:], dtype=np.int64)


async def throughput(policy: str, num_requests: int, profile: bool) -> tuple[float, str]:
    cfg = EngineConfig(model=SimModel(fixed_ms=0.0, per_token_us=0.0), policy=policy)
    async with Engine(cfg) as engine:
        await asyncio.gather(*(engine.prefill([1]) for _ in range(1000)))  # warm-up
        prof = cProfile.Profile() if profile else None
        if prof:
            prof.enable()
        t0 = time.perf_counter()
        await asyncio.gather(*(engine.prefill([1]) for _ in range(num_requests)))
        elapsed = time.perf_counter() - t0
        if prof:
            prof.disable()
        mean_batch = engine.stats().batch_size.mean
    report = ""
    if prof:
        import io

        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
        report = out.getvalue()
    print(f"  {policy}: mean batch size {mean_batch:.1f}", file=sys.stderr)
    return num_requests / elapsed, report


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def idle_cpu(seconds: float) -> float:
    """CPU seconds used by the engine process and 2 idle workers over `seconds` of wall time."""
    async with Engine(EngineConfig(model=SimModel(fixed_ms=1.0), num_workers=2)) as engine:
        await engine.prefill([1])
        pids = [os.getpid(), *engine.worker_pids()]
        before = sum(_cpu_seconds(p) for p in pids)
        await asyncio.sleep(seconds)  # the engine idles; this sleep is the measurement window
        after = sum(_cpu_seconds(p) for p in pids)
    return after - before


def _us(ns: float) -> str:
    return f"{ns / 1e3:.1f}"


async def main(args: argparse.Namespace) -> None:
    n_rt = 2000 if args.quick else 5000
    n_req = 20_000 if args.quick else 50_000
    idle_s = 3.0 if args.quick else 10.0
    rows = []
    for rep in range(args.repeats):
        rt = await eventfd_round_trip(n_rt)
        gaps = await bubble(2000 if args.quick else 4000)
        rows.append((np.median(rt), np.percentile(rt, 99), np.median(gaps), np.percentile(gaps, 99)))
        print(f"  repeat {rep}: floor p50 {_us(rows[-1][0])} us, bubble p50 {_us(rows[-1][2])} us",
              file=sys.stderr)
    ratios = [r[2] / r[0] for r in rows]
    print("\n### Bubble vs the eventfd floor (us; medians over repeats)\n")
    print("| what | p50 | p99 |")
    print("| --- | --- | --- |")
    print(f"| bare eventfd round trip (floor) | {_us(statistics.median(r[0] for r in rows))} | "
          f"{_us(statistics.median(r[1] for r in rows))} |")
    print(f"| bubble between forwards, backlog, SimModel(fixed_ms=2) | "
          f"{_us(statistics.median(r[2] for r in rows))} | {_us(statistics.median(r[3] for r in rows))} |")
    print(f"\nbubble p50 / floor p50, per repeat: {', '.join(f'{x:.2f}' for x in ratios)}; "
          f"median {statistics.median(ratios):.2f} (target <= 1.5)")

    print("\n### Engine overhead: 1-token prompts, SimModel(fixed_ms=0), 1 worker\n")
    print("| policy | requests/s |")
    print("| --- | --- |")
    report = ""
    for policy in ("forward", "eager"):
        rates = []
        for _ in range(args.repeats):
            rate, rep = await throughput(policy, n_req, args.profile and policy == "forward")
            rates.append(rate)
            report = report or rep
        print(f"| {policy} | {statistics.median(rates):,.0f} |")
    if report:
        print("\nProfile of the engine process (forward policy), top 15 by own time:\n")
        print("```\n" + report.strip() + "\n```")

    cpu = await idle_cpu(idle_s)
    print(f"\n### Idle\n\nengine + 2 idle workers: {cpu * 1e3:.1f} ms CPU over {idle_s:.0f} s "
          f"= {100 * cpu / idle_s:.3f}% of one core (target < 1%)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    uvloop.run(main(parser.parse_args()))
