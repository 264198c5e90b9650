"""Engine-level costs, each side by side with its floor in one run.

1. Bubble: with a backlog and `SimModel(fixed_ms=2)`, the gap between one forward's end and the
   next forward's start on one worker (worker clocks), for small (4) and full (256) batches,
   next to two floors measured in the same run between the same two vCPUs (the engine pinned
   to one, the worker or the echo process to the other, when there are two):
   - the bare eventfd round trip (uvloop `add_reader` on one side, a blocking read on the other);
   - the bare hand-off after idle: a process that sleeps 2 ms (the forward), writes an eventfd
     and blocks until the loop answers; this pays what the bubble pays for waking a vCPU that
     went idle during the forward, and nothing else.
2. Overhead: requests/s through the whole engine with `SimModel(fixed_ms=0)` and 1-token prompts,
   for the forward and eager policies, and (with --profile) where the engine's time goes.
3. Idle: CPU time used by the engine process plus 2 idle workers over 10 s.

    python benchmarks/bench_engine.py [--quick] [--profile] [--prefix-cache-bytes N]

`--prefix-cache-bytes 0` turns the prefix cache off (default: EngineConfig's, on), for the
cache on/off comparison in docs/prefix-cache.md (1-token prompts: nothing to cache, so this
measures what the cache costs traffic that never reuses anything).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import itertools
import multiprocessing as mp
import os
import pstats
import statistics
import sys
import time

import numpy as np
import uvloop
from common import proc_cpu_s

from aioprefill import Engine, EngineConfig, SimModel

CACHE: dict[str, int] = {}  # EngineConfig's prefix cache setting (--prefix-cache-bytes)


def _echo_child(fd_in: int, fd_out: int) -> None:
    while True:
        os.eventfd_read(fd_in)
        os.eventfd_write(fd_out, 1)


async def eventfd_round_trip(n: int, cpu: int | None) -> np.ndarray:
    """Round trip: loop writes efd A; child (blocking read) writes efd B; loop wakes on B."""
    a, b = os.eventfd(0), os.eventfd(0, os.EFD_NONBLOCK)
    ctx = mp.get_context("fork")  # no paddle in this process: fork is safe here
    child = ctx.Process(target=_echo_child, args=(a, b), daemon=True)
    child.start()
    if cpu is not None:
        os.sched_setaffinity(child.pid, {cpu})
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


def _handoff_child(fd_in: int, fd_out: int, n: int, result_fd: int) -> None:
    gaps = np.empty(n, dtype=np.int64)
    for i in range(n):
        time.sleep(0.002)  # the "forward": the vCPU goes idle as it does under a real one
        end = time.monotonic_ns()
        os.eventfd_write(fd_out, 1)
        os.eventfd_read(fd_in)
        gaps[i] = time.monotonic_ns() - end
    os.write(result_fd, gaps.tobytes())


async def handoff_after_idle(n: int, cpu: int | None) -> np.ndarray:
    """Bare hand-off: child sleeps 2 ms, signals, blocks; the loop answers at once."""
    a, b = os.eventfd(0), os.eventfd(0, os.EFD_NONBLOCK)
    r, w = os.pipe()
    child = mp.get_context("fork").Process(target=_handoff_child, args=(a, b, n, w), daemon=True)
    child.start()
    if cpu is not None:
        os.sched_setaffinity(child.pid, {cpu})
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    count = 0

    def on_b() -> None:
        nonlocal count
        os.eventfd_read(b)
        os.eventfd_write(a, 1)
        count += 1
        if count == n:
            done.set_result(None)

    loop.add_reader(b, on_b)
    await done
    loop.remove_reader(b)
    data = b""
    while len(data) < 8 * n:
        data += os.read(r, 1 << 20)
    child.join()
    for fd in (a, b, r, w):
        os.close(fd)
    return np.frombuffer(data, dtype=np.int64)[20:]


async def bubble(num_requests: int, batch_size: int, cpu: int | None) -> np.ndarray:
    """Gaps between consecutive forwards on one worker while a backlog waits."""
    cfg = EngineConfig(
        model=SimModel(fixed_ms=2.0, per_token_us=0.0), max_batch_size=batch_size, **CACHE
    )
    async with Engine(cfg) as engine:
        if cpu is not None:
            for pid in engine.worker_pids():
                os.sched_setaffinity(pid, {cpu})
        results = await asyncio.gather(*(engine.prefill([1]) for _ in range(num_requests)))
    forwards = sorted({(r.forward_start_ns, r.forward_end_ns) for r in results})
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(forwards)]
    return np.asarray(gaps[5:], dtype=np.int64)


async def throughput(policy: str, num_requests: int, profile: bool) -> tuple[float, str]:
    cfg = EngineConfig(model=SimModel(fixed_ms=0.0, per_token_us=0.0), policy=policy, **CACHE)
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


async def idle_cpu(seconds: float) -> float:
    """CPU seconds used by the engine process and 2 idle workers over `seconds` of wall time."""
    async with Engine(EngineConfig(model=SimModel(fixed_ms=1.0), num_workers=2)) as engine:
        await engine.prefill([1])
        pids = [os.getpid(), *engine.worker_pids()]
        before = sum(proc_cpu_s(p) for p in pids)
        await asyncio.sleep(seconds)  # the engine idles; this sleep is the measurement window
        after = sum(proc_cpu_s(p) for p in pids)
    return after - before


def _us(ns: float) -> str:
    return f"{ns / 1e3:.1f}"


async def main(args: argparse.Namespace) -> None:
    n_rt = 2000 if args.quick else 5000
    n_req = 20_000 if args.quick else 50_000
    idle_s = 3.0 if args.quick else 10.0
    cpu = None
    all_cpus = os.sched_getaffinity(0)
    if len(all_cpus) >= 2:
        os.sched_setaffinity(0, {0})  # the engine on vCPU 0, the other side on vCPU 1
        cpu = 1
    rows: dict[str, list[tuple[float, float]]] = {}

    def add(name: str, samples: np.ndarray) -> None:
        rows.setdefault(name, []).append((np.median(samples), np.percentile(samples, 99)))

    for rep in range(args.repeats):
        add("floor: eventfd round trip", await eventfd_round_trip(n_rt, cpu))
        add("floor: hand-off after a 2 ms idle", await handoff_after_idle(n_rt // 5, cpu))
        add("bubble, batches of 4", await bubble(4 * (600 if args.quick else 1500), 4, cpu))
        add("bubble, batches of 256", await bubble(256 * (100 if args.quick else 200), 256, cpu))
        print(
            f"  repeat {rep}: " + ", ".join(f"{k} {_us(v[-1][0])}" for k, v in rows.items()),
            file=sys.stderr,
        )
    print(
        f"\n### Bubble between forwards vs the wake-up floors (us; medians of {args.repeats} runs"
        f"{', engine on vCPU 0, other side on vCPU 1' if cpu else ''})\n"
    )
    print("| what | p50 | p99 |")
    print("| --- | --- | --- |")
    for name, v in rows.items():
        print(
            f"| {name} | {_us(statistics.median(x[0] for x in v))} | "
            f"{_us(statistics.median(x[1] for x in v))} |"
        )
    for floor in ("floor: eventfd round trip", "floor: hand-off after a 2 ms idle"):
        for b in ("bubble, batches of 4", "bubble, batches of 256"):
            ratios = [x[0] / f[0] for x, f in zip(rows[b], rows[floor], strict=True)]
            print(
                f"\n{b} / {floor[7:]} (p50, per run): {', '.join(f'{r:.2f}' for r in ratios)}; "
                f"median {statistics.median(ratios):.2f}",
                end="",
            )
    print("  (target <= 1.5)")
    os.sched_setaffinity(0, all_cpus)  # the rest runs unpinned, as a user would

    print("\n### Engine overhead: 1-token prompts, SimModel(fixed_ms=0), 1 worker\n")
    print("| policy | requests/s |")
    print("| --- | --- |")
    report = ""
    for policy in ("forward", "eager"):
        rates = [(await throughput(policy, n_req, False))[0] for _ in range(args.repeats)]
        print(f"| {policy} | {statistics.median(rates):,.0f} |")
    if args.profile:  # a separate run: the profiler's own cost must not reach the figures above
        report = (await throughput("forward", n_req, True))[1]
    if report:
        print("\nProfile of the engine process (forward policy), top 15 by own time:\n")
        print("```\n" + report.strip() + "\n```")

    cpu = await idle_cpu(idle_s)
    print(
        f"\n### Idle\n\nengine + 2 idle workers: {cpu * 1e3:.1f} ms CPU over {idle_s:.0f} s "
        f"= {100 * cpu / idle_s:.3f}% of one core (target < 1%)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefix-cache-bytes", type=int, default=None)
    parsed = parser.parse_args()
    if parsed.prefix_cache_bytes is not None:
        CACHE["prefix_cache_bytes"] = parsed.prefix_cache_bytes
    uvloop.run(main(parsed))
