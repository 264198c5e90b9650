"""A Paddle worker's memory under a long prefix-cache replay (issue 22): does its RSS stay
within the cache's byte budget plus a fixed overhead while blocks are evicted many times over?

One real Paddle worker (the tiny default model, 4 layers, hidden 256: a 16-token block is
84,610 bytes) replays the Mooncake synthetic trace (`../shared/traces/
mooncake_synthetic_trace.jsonl`, its `hash_ids` scaled to `--trace-block-tokens` tokens each,
so prompts keep its reuse: 65% of its blocks seen before) closed loop (`--concurrency`
requests in flight, arrival times ignored: this measures memory, not latency), once per
`--budgets` entry (`off` = `prefix_cache_bytes=0`), each on a fresh engine. A sampler reads
the worker's /proc/PID/status (VmRSS, RssAnon, VmHWM) every `--sample-s` seconds. Printed per
budget: RSS idle (after start), at each quarter of the requests, the peak and VmHWM, the
growth over the second half (where a leak would show: the cache is full by then and every
write evicts) and after each of `--passes` replays of the same requests in the same engine (a
leak grows pass after pass; the allocator's high-water mark of the largest batches does not),
the slots the budget buys and the bytes they hold, evictions and hit ratio; then
each budget's peak against the cache-off peak plus the budget: the overhead X in
"RSS <= RSS(cache off) + budget + X".

    python benchmarks/studies/prefix/bench_prefix_rss.py [--requests 3993] \
        [--budgets 64MiB,off,16MiB] [--passes 1] [--trace-block-tokens 8] [--concurrency 16] \
        [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from aioprefill import Engine, EngineConfig, PaddleModel
from aioprefill.bench.prefix import CacheBudget, distinct_blocks, trace_prompts
from aioprefill.bench.traces import read_trace, shape_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: common.py
from common import TRACE

MIB = 1 << 20


def status_kib(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, RssShmem and VmHWM of `pid`, in KiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def budget_bytes(text: str) -> int:
    """`off`, or a size: 64MiB, 1GiB, 500000."""
    budget = CacheBudget.parse(text)
    if budget.kind != "bytes":
        raise SystemExit(f"--budgets: {text!r} is not a size (64MiB) or off")
    return int(budget.value)


async def replay(prompts: list[np.ndarray], budget: int, args: argparse.Namespace) -> dict:
    model = PaddleModel(seed=0, num_threads=args.threads)
    config = EngineConfig(model=model, num_workers=1, prefix_cache_bytes=budget)
    async with Engine(config) as engine:
        (pid,) = engine.worker_pids()
        await engine.prefill(prompts[0][:8])  # one forward: the runtime's first allocations
        idle = status_kib(pid)
        samples: list[tuple[float, int, int, int]] = []  # (s, requests done, VmRSS, RssAnon)
        done = 0
        start = time.monotonic()
        finished = asyncio.Event()

        async def sample() -> None:
            while not finished.is_set():
                s = status_kib(pid)
                samples.append((time.monotonic() - start, done, s["VmRSS"], s["RssAnon"]))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(finished.wait(), args.sample_s)

        async def client(todo: list[np.ndarray]) -> None:
            nonlocal done
            while todo:
                await engine.prefill(todo.pop())
                done += 1

        sampler = asyncio.create_task(sample())
        ends = []  # VmRSS (KiB) after each pass over the trace
        for _ in range(args.passes):
            queue = prompts[::-1]  # clients pop from the end: trace order
            await asyncio.gather(*(client(queue) for _ in range(args.concurrency)))
            ends.append(status_kib(pid)["VmRSS"])
        finished.set()
        await sampler
        end = status_kib(pid)
        samples.append((time.monotonic() - start, done, end["VmRSS"], end["RssAnon"]))
        cache = engine.stats().prefix_cache
    rss = np.array([s[2] for s in samples]) / 1024
    reqs = np.array([s[1] for s in samples])
    n = len(prompts) * args.passes
    quarter = [float(rss[min(np.searchsorted(reqs, q * n // 4), len(rss) - 1)]) for q in (1, 2, 3)]
    half = reqs >= n // 2
    return {
        "budget_bytes": budget,
        "seconds": samples[-1][0],
        "idle_mib": idle["VmRSS"] / 1024,
        "quarters_mib": [*quarter, float(rss[-1])],
        "pass_ends_mib": [e / 1024 for e in ends],
        "peak_mib": float(rss.max()),
        "hwm_mib": end["VmHWM"] / 1024,
        "anon_idle_mib": idle["RssAnon"] / 1024,
        "anon_peak_mib": max(s[3] for s in samples) / 1024,
        "second_half_growth_mib": float(rss[half].max() - rss[half][0]) if half.any() else 0.0,
        "capacity_blocks": cache.capacity_blocks,
        "held_bytes": cache.bytes,
        "evictions": cache.evictions,
        "hit_ratio": cache.hit_ratio,
        "samples": [[round(t, 2), d, r, a] for t, d, r, a in samples],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--requests", type=int, default=3993, help="the trace's first N")
    ap.add_argument("--trace-block-tokens", type=int, default=8, help="tokens per hash id")
    ap.add_argument("--budgets", default="64MiB,off,16MiB", help="prefix_cache_bytes each")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--passes", type=int, default=1, help="replay the requests this many times")
    ap.add_argument("--threads", type=int, default=1, help="the worker's CPU threads")
    ap.add_argument("--sample-s", type=float, default=0.25)
    ap.add_argument("--json", help="write every figure and sample here")
    args = ap.parse_args()
    sched = shape_trace(read_trace(args.trace), args.requests, args.trace_block_tokens, None)
    prompts = trace_prompts(sched, PaddleModel(seed=0).vocab_size)
    tokens = int(sum(len(p) for p in prompts))
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.2f}; {len(prompts)} requests, {tokens:,} tokens, "
          f"{distinct_blocks(sched, 16):,} distinct 16-token blocks; concurrency "
          f"{args.concurrency}")  # fmt: skip
    runs = {}
    for name in args.budgets.split(","):
        r = asyncio.run(replay(prompts, budget_bytes(name), args))
        runs[name] = r
        q = " / ".join(f"{x:.0f}" for x in r["quarters_mib"])
        print(f"{name:>7}: {r['seconds']:5.0f} s  RSS idle {r['idle_mib']:.0f} MiB, at 1/4 2/4 "
              f"3/4 4/4 of the requests {q}, peak {r['peak_mib']:.0f} (VmHWM "
              f"{r['hwm_mib']:.0f}), second half +{r['second_half_growth_mib']:.1f} MiB, after "
              f"each pass {' / '.join(f'{e:.0f}' for e in r['pass_ends_mib'])}; "
              f"{r['capacity_blocks']} slots, {r['held_bytes'] / MIB:.1f} MiB held, "
              f"{r['evictions']:,} evictions, hit ratio {r['hit_ratio']:.3f}",
              flush=True)  # fmt: skip
    if "off" in runs:
        off = runs["off"]
        for name, r in runs.items():
            if name == "off":
                continue
            b = r["budget_bytes"] / MIB
            x = r["peak_mib"] - off["peak_mib"] - b
            hwm = r["hwm_mib"] - off["hwm_mib"] - b
            print(f"{name}: peak RSS {r['peak_mib']:.0f} MiB = cache off {off['peak_mib']:.0f} + "
                  f"budget {b:.0f} + X = {x:+.1f} MiB (VmHWM: {hwm:+.1f}); slots hold "
                  f"{r['held_bytes'] / MIB:.1f} MiB of the budget")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
