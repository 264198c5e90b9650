"""Mooncake Store behind 4 nodes with small local caches: the hit ratio, the tokens computed and
the TTFT, with the store against without it, requests routed round-robin.

The Mooncake synthetic trace (`../shared/traces/mooncake_synthetic_trace.jsonl`, the first
`--requests`), scaled down: each 512-token hash id becomes one block of `--block` deterministic
token ids (so shared hash ids are shared blocks), a prompt's last block is partial, arrivals
are the trace's times divided by `--speedup`. Four engines in this process, one SimModel worker
each (the `--preset`'s cost, `--kv-per-token` bytes of nominal KV per token, which is
what a block weighs in the store), each with a local cache of `--local-blocks` blocks; request
i goes to node i % 4 (round-robin: turn k of a conversation lands on another node). Runs (the store
ones with a fresh master each), in the order local, store, store, local (ABBA: the means are
reported), then `one node` holding the four nodes' cache (`4 * --local-blocks`), for the hit
ratio a single cache reaches: `local` (no store), `store` (kv_store="mooncake"). With
`--directory`, a third arm `directory`: the store, each node publishing KV events on
127.0.0.1:`--events-port` + 2i and every worker subscribed to all four
(`KVStoreOptions.peer_events`: it asks the store only for announced chains); the order is
then local, store, directory, directory, store, local.

hit ratio = (tokens read from a local cache + tokens loaded from the store) / prompt tokens;
computed = prompt tokens - both; TTFT = prefill() call to result, mean and p90 over requests;
forward = the mean, over requests, of the worker's time for the forward that answered it
(store loads and the copies of the blocks put included).

    python benchmarks/bench_kvstore_cluster.py [--requests 600] [--speedup 4] [--block 16]
        [--local-blocks 64] [--kv-per-token 2048] [--segment-mb 256] [--preset gpu-class]
        [--scratch-blocks 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import numpy as np
from common import TRACE

from aioprefill import Engine, EngineConfig, KVStoreOptions, SimModel
from aioprefill.bench.presets import SIM_PRESETS
from aioprefill.kvstore.master import LocalMaster

NODES = 4


def load_trace(path: Path, n: int, block: int) -> list[tuple[float, list[int]]]:
    """(arrival s, token ids) of the first n requests, 512-token hash ids scaled to `block`."""
    out = []
    with path.open() as f:
        for i, line in zip(range(n), f, strict=False):
            row = json.loads(line)
            length = max(2, round(row["input_length"] * block / 512))
            ids: list[int] = []
            for h in row["hash_ids"]:
                rng = np.random.default_rng(1_000_003 * (h + 1))
                ids.extend(rng.integers(0, 30000, block).tolist())
            ids = ids[:length]
            if len(ids) < length:  # the trace's lengths and hash counts disagree: pad
                ids += np.random.default_rng(i).integers(0, 30000, length - len(ids)).tolist()
            out.append((row["timestamp"] / 1000.0, ids))
    return out


async def run(trace, configs: list[EngineConfig], speedup: float) -> dict[str, float]:
    engines = [Engine(c) for c in configs]
    for e in engines:
        await e.start()
    try:
        t0 = time.monotonic()
        ttft: list[float] = []
        forward: list[float] = []

        async def one(i: int, at: float, ids: list[int]) -> None:
            await asyncio.sleep(max(0.0, t0 + at / speedup - time.monotonic()))
            r = await engines[i % len(engines)].prefill(ids)
            ttft.append((r.finished_ns - r.submitted_ns) / 1e6)
            forward.append((r.forward_end_ns - r.forward_start_ns) / 1e6)

        await asyncio.gather(*(one(i, at, ids) for i, (at, ids) in enumerate(trace)))
        stats = [e.stats().prefix_cache for e in engines]
    finally:
        for e in engines:
            await e.close()
    prompt = sum(len(ids) for _, ids in trace)
    hit = sum(s.hit_tokens for s in stats)
    store = sum(s.store_hit_tokens for s in stats)
    return {
        "prompt_tokens": prompt,
        "local_hit": hit / prompt,
        "store_hit": store / prompt,
        "hit_ratio": (hit + store) / prompt,
        "computed": prompt - hit - store,
        "ttft_mean_ms": statistics.mean(ttft),
        "ttft_p90_ms": statistics.quantiles(ttft, n=10)[-1],
        "forward_ms": statistics.mean(forward),
    }


def cluster_arguments(ap: argparse.ArgumentParser) -> None:
    """The cluster's options (also `kvstore_gap.py`'s)."""
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--speedup", type=float, default=4.0)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--local-blocks", type=int, default=64)
    ap.add_argument("--kv-per-token", type=int, default=2048)
    ap.add_argument("--segment-mb", type=int, default=256, help="each worker's store segment")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument(
        "--scratch-blocks",
        type=int,
        default=KVStoreOptions().scratch_blocks,
        help="KVStoreOptions.scratch_blocks",
    )
    ap.add_argument("--preset", default="gpu-class", choices=sorted(SIM_PRESETS))
    ap.add_argument("--directory", action="store_true", help="add the directory arm")
    ap.add_argument("--events-port", type=int, default=25600, help="node i: this + 2i (+1)")


def event_endpoints(args: argparse.Namespace) -> list[str]:
    """Node i's KV events endpoint (`--events-port` + 2i; its replay socket takes the next)."""
    return [f"tcp://127.0.0.1:{args.events_port + 2 * i}" for i in range(NODES)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cluster_arguments(ap)
    args = ap.parse_args()
    trace = load_trace(args.trace, args.requests, args.block)
    cost = SIM_PRESETS[args.preset]
    model = SimModel(fixed_ms=cost.fixed_ms, per_token_us=cost.per_token_us, attn_ns=cost.attn_ns,
                     kv_bytes_per_token=args.kv_per_token)  # fmt: skip
    block_bytes = args.block * args.kv_per_token
    local = args.local_blocks * block_bytes

    events = event_endpoints(args)

    def cfg(cache: int, master: str | None = None, node: int | None = None) -> EngineConfig:
        extra: dict[str, object] = {}
        if master is not None:
            store = KVStoreOptions(
                master=master,
                segment_bytes=args.segment_mb << 20,
                scratch_blocks=args.scratch_blocks,
                peer_events=tuple(events) if node is not None else (),
            )  # buffers: defaults
            extra = {"kv_store": "mooncake", "kv_store_options": store}
            if node is not None:
                extra["kv_events_endpoint"] = events[node]
        return EngineConfig(model=model, prefix_cache_bytes=cache, prefix_block_tokens=args.block,
                            **extra)  # type: ignore[arg-type]  # fmt: skip

    def once(mode: str) -> dict[str, float]:
        if mode == "local":
            return asyncio.run(run(trace, [cfg(local) for _ in range(NODES)], args.speedup))
        if mode == "one node":
            return asyncio.run(run(trace, [cfg(NODES * local)], args.speedup))
        with LocalMaster() as m:  # a fresh, empty store each run
            nodes = range(NODES) if mode == "directory" else [None] * NODES
            configs = [cfg(local, m.address, i) for i in nodes]
            return asyncio.run(run(trace, configs, args.speedup))

    runs: dict[str, list[dict[str, float]]] = {"local": [], "store": [], "one node": []}
    order = ["local", "store", "store", "local", "one node"]  # ABBA, then the reference
    if args.directory:
        runs["directory"] = []
        order = ["local", "store", "directory", "directory", "store", "local", "one node"]
    for mode in order:
        runs[mode].append(once(mode))
    results = {
        mode: {k: statistics.mean(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()
    }
    print(
        f"# bench_kvstore_cluster: {args.requests} trace requests, x{args.speedup} speed, "
        f"block {args.block}, {NODES} nodes x {args.local_blocks} local blocks, "
        f"{args.kv_per_token} B/token of KV ({block_bytes} B/block), {args.preset} SimModel"
    )
    print(
        f"{'run':9} {'hit ratio':>9} {'local':>6} {'store':>6} {'computed':>9} "
        f"{'TTFT mean':>10} {'p90':>8} {'forward':>8}"
    )
    for name, r in results.items():
        print(
            f"{name:9} {r['hit_ratio']:9.3f} {r['local_hit']:6.3f} {r['store_hit']:6.3f} "
            f"{r['computed']:9.0f} {r['ttft_mean_ms']:8.1f}ms {r['ttft_p90_ms']:6.1f}ms "
            f"{r['forward_ms']:6.1f}ms"
        )
    base = results["local"]
    for arm in [a for a in ("store", "directory") if a in runs]:
        store = results[arm]
        print(
            f"{arm} / local: hit ratio x{store['hit_ratio'] / max(base['hit_ratio'], 1e-9):.2f}, "
            f"computed x{store['computed'] / base['computed']:.2f}, "
            f"TTFT mean x{store['ttft_mean_ms'] / base['ttft_mean_ms']:.2f}"
        )
        # Each run of the ABBA order on its own (the spread between runs on a shared host),
        # and each store run against the local run next to it (1st with 1st, 2nd with 2nd).
        for k in range(2):
            lo, st = runs["local"][k], runs[arm][k]
            print(
                f"{arm} pair {k + 1}: local TTFT {lo['ttft_mean_ms']:.1f}ms, {arm} TTFT "
                f"{st['ttft_mean_ms']:.1f}ms hit {st['hit_ratio']:.3f}: computed "
                f"x{st['computed'] / lo['computed']:.2f}, TTFT mean "
                f"x{st['ttft_mean_ms'] / lo['ttft_mean_ms']:.2f}"
            )


if __name__ == "__main__":
    main()
