"""Soak: hundreds of thousands of requests with random cancellations; nothing lost, flat memory.

Drives an engine of zero-cost SimModel workers (`fixed_ms=0, per_token_us=0`, so the engine
itself is the bottleneck) with `--requests` prompts, `--concurrency` in flight at a time, and
cancels a random `--cancel` fraction of them after 0-2 ms (before, during or after their
forward). Every prompt is unique, and every result is checked against the CRC the worker
must return for it. At the end it checks that each request ended exactly once (a result, or
its cancellation), that the engine holds nothing (no pending, no in-flight, empty queues), and
reports the engine process's RSS after warm-up and at the end, and the workers' RSS.

    .venv/bin/python benchmarks/soak.py                       # 200,000 requests, uvloop
    .venv/bin/python benchmarks/soak.py --requests 20000 --json

Exits 1 when a request was lost, answered twice or answered wrongly, or when RSS grew by more
than `--max-growth-mb` between warm-up and the end.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import time
import zlib
from pathlib import Path

import numpy as np

from aioprefill import Engine, EngineConfig, SimModel

VOCAB = 32000


def rss_mb(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def soak(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    np_rng = np.random.default_rng(args.seed)
    pool = [
        np_rng.integers(0, VOCAB, size=int(n), dtype=np.int32)
        for n in np_rng.integers(1, 64, size=4096)
    ]
    config = EngineConfig(
        model=SimModel(fixed_ms=0.0, per_token_us=0.0),
        num_workers=args.workers,
        max_pending=max(65536, 2 * args.concurrency),
    )
    loop = asyncio.get_running_loop()
    counts = {"answered": 0, "cancelled": 0, "wrong": 0, "error": 0, "ended": 0}
    warm_at = args.requests // 5
    rss: dict[str, float] = {}
    slots = asyncio.Semaphore(args.concurrency)

    async with Engine(config) as engine:
        pids = engine.worker_pids()

        def done(task: asyncio.Task, expected: int) -> None:
            slots.release()
            counts["ended"] += 1
            if task.cancelled():
                counts["cancelled"] += 1
            elif task.exception() is not None:
                counts["error"] += 1
            elif task.result().token == expected:
                counts["answered"] += 1
            else:
                counts["wrong"] += 1

        started = time.perf_counter()
        for i in range(args.requests):
            if i == warm_at:
                gc.collect()
                rss["engine_start_mb"] = rss_mb()
                rss["workers_start_mb"] = sum(rss_mb(p) for p in pids)
            # Unique per request: its index in the first two ids, then a pooled tail.
            prompt = np.concatenate(
                [np.array([i // VOCAB, i % VOCAB], np.int32), pool[i % len(pool)]]
            )
            expected = zlib.crc32(prompt.astype("<i4").tobytes()) % VOCAB
            await slots.acquire()
            task = loop.create_task(engine.prefill(prompt))
            task.add_done_callback(lambda t, e=expected: done(t, e))
            if rng.random() < args.cancel:
                loop.call_later(rng.random() * 0.002, task.cancel)
        for _ in range(args.concurrency):  # every task has ended once all slots are back
            await slots.acquire()
        elapsed = time.perf_counter() - started
        await asyncio.sleep(0.01)  # let the last cancellations' bookkeeping settle
        stats = engine.stats()
        internals = {
            "pending_queue": len(engine._sched.pending),
            "in_flight_batches": sum(len(w.in_flight) for w in engine._pool.slots),
            "free_ids": sum(len(w.free_ids) for w in engine._pool.slots),
        }
        gc.collect()
        rss["engine_end_mb"] = rss_mb()
        rss["workers_end_mb"] = sum(rss_mb(p) for p in pids)

    lost = args.requests - counts["ended"]
    growth = rss["engine_end_mb"] - rss["engine_start_mb"]
    report = {
        "requests": args.requests,
        "seconds": round(elapsed, 2),
        "requests_per_s": round(args.requests / elapsed),
        **counts,
        "lost": lost,
        "engine": {
            "submitted": stats.submitted,
            "completed": stats.completed,
            "cancelled": stats.cancelled,
            "failed": stats.failed,
            "pending": stats.pending,
            "in_flight": stats.in_flight,
            "batches": stats.batches,
            "mean_batch_size": round(stats.batch_size.mean, 1),
            **internals,
        },
        "rss_mb": {k: round(v, 1) for k, v in rss.items()},
        "rss_growth_mb": round(growth, 1),
    }
    ok = (
        lost == 0
        and counts["wrong"] == 0
        and counts["error"] == 0
        and counts["answered"] + counts["cancelled"] == args.requests
        and stats.completed >= counts["answered"]
        and stats.submitted == stats.completed + stats.cancelled + stats.failed
        and stats.pending == 0
        and stats.in_flight == 0
        and not any(internals.values())
        and growth <= args.max_growth_mb
    )
    report["ok"] = ok
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=1000)
    parser.add_argument("--cancel", type=float, default=0.05, help="fraction cancelled")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    parser.add_argument("--max-growth-mb", type=float, default=32.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    args = parser.parse_args()
    if args.seed is None:
        args.seed = random.randrange(1 << 30)
    if args.loop == "uvloop":
        import uvloop

        report = uvloop.run(soak(args))
    else:
        report = asyncio.run(soak(args))
    report["seed"] = args.seed
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
