"""Worker death under load, measured: detection time, time until the replacement serves, and
requests retried versus failed, from one injected-fault run.

Two SimModel workers serve a steady closed-loop load (`--concurrency` callers, each sending
its next prompt as soon as the last one ends). Every `--interval` seconds the run SIGKILLs a
worker that is mid-forward, `--kills` times. For each kill it reports, from the moment just
before `os.kill`:

- detected: the engine logs the death (its sentinel fired on the event loop; requests are
  retried or failed right there),
- ready: the replacement worker reported Ready (backoff 50 ms, then spawn + start-up),
- serves: the engine resolved the first request answered by the replacement,

and, over the run, how many requests the engine had in flight on the victim at each kill, how
many it retried and how many failed with `WorkerCrashed` (a request fails when its retry was
killed too). Retries can exceed the in-flight count: until the sentinel fires, the engine may
hand the dead worker one more batch (its last result was still in the ring), and that batch
is retried too. Results the worker wrote before it died are read and delivered, not retried.

    .venv/bin/python benchmarks/bench_faults.py                  # 5 kills, uvloop
    .venv/bin/python benchmarks/bench_faults.py --kills 10 --json
    .venv/bin/python benchmarks/bench_faults.py --concurrency 0   # idle workers: bare detection
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import statistics
import time

import uvloop

from aioprefill import Engine, EngineConfig, PrefillResult, SimModel, WorkerCrashed
from aioprefill.workers.sim import expected_token


class _Events(logging.Handler):
    """Timestamps (monotonic ns) of the engine's 'died' and 'ready' log lines, per worker."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.events: list[tuple[str, int, int]] = []  # (kind, worker, t_ns)

    def emit(self, record: logging.LogRecord) -> None:
        now = time.monotonic_ns()
        msg = record.getMessage()
        if "died with exit code" in msg or " ready (pid" in msg:
            kind = "died" if "died" in msg else "ready"
            self.events.append((kind, int(msg.split()[1]), now))

    def first(self, kind: str, worker: int, after_ns: int) -> int | None:
        times = [t for k, w, t in self.events if k == kind and w == worker and t >= after_ns]
        return min(times) if times else None


async def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    events = _Events()
    logger = logging.getLogger("aioprefill")
    logger.addHandler(events)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # keep the run's own log lines off the terminal
    config = EngineConfig(
        model=SimModel(fixed_ms=args.fixed_ms, per_token_us=0.0),
        num_workers=2,
        max_restarts=args.kills + 1,
    )
    results: list[PrefillResult] = []
    crashed = 0
    wrong = 0
    stop = asyncio.Event()
    kills: list[dict] = []
    async with Engine(config) as engine:

        async def caller() -> None:
            nonlocal crashed, wrong
            while not stop.is_set():
                prompt = [rng.randrange(1, 32000) for _ in range(rng.randrange(1, 64))]
                try:
                    r = await engine.prefill(prompt)
                except WorkerCrashed:
                    crashed += 1
                    continue
                if r.token != expected_token(prompt):
                    wrong += 1
                results.append(r)

        callers = [asyncio.create_task(caller()) for _ in range(args.concurrency)]
        await asyncio.sleep(args.interval)  # warm up
        for _ in range(args.kills):
            while True:  # a worker mid-forward (any ready worker when there is no load)
                busy = [w for w in engine._pool.slots if w.ready and (w.in_flight or not callers)]
                if busy:
                    break
                await asyncio.sleep(0.001)
            w = rng.choice(busy)
            assert w.handle is not None
            held = sum(len(b.chunks) for b in w.in_flight)
            pid = w.handle.pid
            t_kill = time.monotonic_ns()
            os.kill(pid, signal.SIGKILL)
            kills.append({"worker": w.index, "pid": pid, "held": held, "t_kill": t_kill})
            await asyncio.sleep(args.interval)
        stop.set()
        await asyncio.gather(*callers)
        stats = engine.stats()
    logger.removeHandler(events)

    rows = []
    for k in kills:
        t0, idx = k["t_kill"], k["worker"]
        died = events.first("died", idx, t0)
        ready = events.first("ready", idx, t0)
        served = [r.finished_ns for r in results if r.worker == idx and r.forward_start_ns > t0]
        rows.append(
            {
                "worker": idx,
                "in_flight_at_kill": k["held"],
                "detected_ms": None if died is None else (died - t0) / 1e6,
                "ready_ms": None if ready is None else (ready - t0) / 1e6,
                "serves_ms": (min(served) - t0) / 1e6 if served else None,
            }
        )

    def summary(key: str) -> dict | None:
        values = [r[key] for r in rows if r[key] is not None]
        if not values:
            return None
        return {"median": round(statistics.median(values), 3), "max": round(max(values), 3)}

    return {
        "kills": rows,
        "detected_ms": summary("detected_ms"),
        "ready_ms": summary("ready_ms"),
        "serves_ms": summary("serves_ms"),
        "in_flight_at_kills": sum(r["in_flight_at_kill"] for r in rows),
        "retried": stats.retried,
        "failed_worker_crashed": crashed,
        "completed": stats.completed,
        "wrong_results": wrong,
        "worker_restarts": stats.worker_restarts,
        "config": {
            "fixed_ms": args.fixed_ms,
            "concurrency": args.concurrency,
            "interval_s": args.interval,
            "loop": args.loop,
            "seed": args.seed,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--interval", type=float, default=1.5, help="seconds between kills")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--fixed-ms", type=float, default=5.0, help="SimModel forward time")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.seed is None:
        args.seed = random.randrange(1 << 30)
    report = uvloop.run(run(args)) if args.loop == "uvloop" else asyncio.run(run(args))
    if args.json:
        print(json.dumps(report))
        return
    print("kill  worker  in_flight  detected_ms  ready_ms  serves_ms")

    def ms(value: float | None, width: int) -> str:
        return f"{value:>{width}.2f}" if value is not None else f"{'-':>{width}}"

    for i, r in enumerate(report["kills"]):
        print(
            f"{i + 1:>4}  {r['worker']:>6}  {r['in_flight_at_kill']:>9}  "
            f"{ms(r['detected_ms'], 11)}  {ms(r['ready_ms'], 8)}  {ms(r['serves_ms'], 9)}"
        )
    for key in ("detected_ms", "ready_ms", "serves_ms"):
        if report[key] is not None:
            print(f"{key}: median {report[key]['median']}, max {report[key]['max']}")
    print(
        f"in flight at the kills {report['in_flight_at_kills']}, "
        f"retried {report['retried']}, failed (WorkerCrashed) {report['failed_worker_crashed']}, "
        f"completed {report['completed']}, wrong {report['wrong_results']}"
    )
    print(json.dumps(report["config"]))


if __name__ == "__main__":
    main()
