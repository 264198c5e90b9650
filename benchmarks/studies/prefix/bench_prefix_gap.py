"""Where the gap between two forwards goes, cache on vs off (no reuse), A B B A.

One `SimModel` worker with the `gpu-class` costs (10.9 ms + 25.7 us/token), 229 closed-loop
clients sending unique prompts of lognormal(64, 0.5) tokens for 4 s (saturation: full batches of
~105), the engine's default cache against cache off. Per run: requests/s; the mean gap between
two forwards on the worker's clock (and its median); of it, the forward's end to the next
batch's dispatch stamp (the engine's part) and from the later of the two to the next forward's
start (the ring, the worker's wake-up and decode); the CPU time of the engine process (with its
clients) and of the workers over the run.

    python benchmarks/studies/prefix/bench_prefix_gap.py [on,off,off,on] \
        [SECONDS per run, default 4]
"""

from __future__ import annotations

import asyncio
import itertools
import os
import statistics
import sys
import time

import numpy as np

from aioprefill import Engine, EngineConfig, SimModel


def _children_cpu_s() -> float:
    """CPU seconds used so far by this process's child processes (the workers)."""
    me, total, tick = os.getpid(), 0.0, os.sysconf("SC_CLK_TCK")
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


async def run(cache_on: bool, seconds: float = 4.0, clients: int = 229) -> str:
    model = SimModel(fixed_ms=10.9, per_token_us=25.7, attn_ns=0.69)
    cfg = EngineConfig(model=model) if cache_on else EngineConfig(model=model, prefix_cache_bytes=0)
    rng = np.random.default_rng(time.time_ns())
    results = []
    async with Engine(cfg) as engine:
        warm = [rng.integers(1, 32000, 64).astype(np.int32) for _ in range(50)]
        await asyncio.gather(*(engine.prefill(p) for p in warm))
        end = time.monotonic() + seconds

        async def client() -> None:
            while time.monotonic() < end:
                n = int(np.clip(rng.lognormal(np.log(64), 0.5), 1, 8192))
                results.append(await engine.prefill(rng.integers(1, 32000, n).astype(np.int32)))

        workers0, engine0 = _children_cpu_s(), time.process_time()
        await asyncio.gather(*(client() for _ in range(clients)))
        workers_s, engine_s = _children_cpu_s() - workers0, time.process_time() - engine0
    batches = sorted(
        {
            r.batch_id: (r.forward_start_ns, r.forward_end_ns, r.dispatched_ns) for r in results
        }.values()
    )
    pairs = list(itertools.pairwise(batches))
    gaps = [s2 - e1 for (_, e1, _), (s2, _, _) in pairs]
    gap, p50 = statistics.mean(gaps) / 1e3, statistics.median(gaps) / 1e3
    engine_part = statistics.mean(d2 - e1 for (_, e1, _), (_, _, d2) in pairs) / 1e3
    after = statistics.mean(s2 - max(e1, d2) for (_, e1, _), (s2, _, d2) in pairs) / 1e3
    return (
        f"{'on' if cache_on else 'off'}: {len(results) / seconds:.1f} req/s, gap {gap:.0f} us "
        f"(p50 {p50:.0f} us, {len(gaps)} gaps) "
        f"(end -> next dispatched {engine_part:.0f} us; then -> next start {after:.0f} us); "
        f"CPU: engine + clients {engine_s:.2f} s, workers {workers_s:.2f} s over {seconds:g} s"
    )


async def main(order: list[str], seconds: float) -> None:
    for arm in order:
        print(f"{await run(arm == 'on', seconds)}  (load {os.getloadavg()[0]:.1f})", flush=True)


if __name__ == "__main__":
    arms = (sys.argv[1] if len(sys.argv) > 1 else "on,off,off,on").split(",")
    asyncio.run(main(arms, float(sys.argv[2]) if len(sys.argv) > 2 else 4.0))
