"""Cluster prefix-cache hit ratio through vllm-router: `kv_aware` (fed by the nodes' KV
events) vs `round_robin` vs `cache_aware`, against one node holding the same total cache.

Every arm replays the same requests over HTTP: the Mooncake synthetic trace
(/work/shared/traces/mooncake_synthetic_trace.jsonl, or `--trace`), its first `--requests`
rows, arrivals `--speedup` times faster, each 512-token hash id standing for `--id-tokens`
token ids of its own (deterministic in the id and the place, so equal ids are equal tokens;
a prompt's partial last block is scaled in proportion). The nodes are
`python -m aioprefill.serve --model sim` with the GPU-class cost (bench preset `gpu-class`:
10.9 ms + 25.7 us per computed token; its 0.69 ns*len^2 attention term is left out, serve has
no flag for it, and it is under 1% at these lengths). A cluster arm starts `--nodes` fresh
nodes with `--node-cache-blocks` blocks of cache each behind a fresh vllm-router; the `single`
arm one node with `nodes` times that cache and `nodes` times the speed (the cost divided by
`nodes`: the cluster's cache and compute in one node, so that it is not overloaded), sent the
requests directly. The hit ratio is the
nodes' own count (`aioprefill_prefix_cache_hits_total / _queries_total` on /metrics) over the
arm, summed over nodes; TTFT is the client's request latency.

    python benchmarks/bench_cluster.py [--requests 3993] [--speedup 20] [--id-tokens 16]
        [--nodes 4] [--node-cache-blocks 2200]
        [--arms kv_aware@0.01,kv_aware,round_robin,cache_aware,single]

`kv_aware@T` runs kv_aware with `--router-temperature T`: at the default 0 the router sends
every request that no node has cached to the least-loaded node, ties broken in the same order,
so at low load new prompts pile onto one node and its cache thrashes (measured: one node got
2498 of 3993 requests at 5x); a small T breaks those ties at random while the cached prefix
still dominates the choice.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np
from common import ROOT, TRACE, free_port

ROUTER = Path(sys.executable).parent / "vllm-router"
GPU_CLASS = ("--sim-fixed-ms", "10.9", "--sim-per-token-us", "25.7")
KV_BYTES_PER_TOKEN = 131072  # SimModel's nominal KV size (Llama-3-8B's): the cache budget unit
VOCAB = 32000
TRACE_BLOCK = 512


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (uint64 -> uint64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def offline_hit_ratio(
    requests: list[tuple[float, list[int]]], nodes: int, capacity: int, block: int, rule: str
) -> float:
    """The hit ratio of `nodes` LRU caches of `capacity` blocks each over `requests` in order
    (a request reads at most `(n - 1) // block` blocks and stores its full blocks, as the
    engine does), routed `rr` (round-robin) or `best` (to the node holding the longest prefix,
    ties to the node with fewest requests): what a router could reach, no load in sight."""
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(nodes)]
    sent = [0] * nodes
    hit = total = 0
    for i, (_, tokens) in enumerate(requests):
        keys, key = [], 0
        for k in range(len(tokens) // block):  # a chained key per full block, as the engine's
            key = hash((key, tuple(tokens[k * block : (k + 1) * block])))
            keys.append(key)
        readable = (len(tokens) - 1) // block
        if rule == "rr":
            w = i % nodes
        else:
            got = [_cached(c, keys, readable) for c in caches]
            w = min(range(nodes), key=lambda j: (-got[j], sent[j]))
        cache = caches[w]
        sent[w] += 1
        hit += _cached(cache, keys, readable) * block
        total += len(tokens)
        for key in keys:
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hit / total


def _cached(cache: OrderedDict[int, None], keys: list[int], readable: int) -> int:
    k = 0
    while k < readable and keys[k] in cache:
        k += 1
    return k


def load_trace(path: Path, n: int, id_tokens: int, speedup: float) -> list[tuple[float, list[int]]]:
    """(arrival s, token ids) of the trace's first `n` requests."""
    out = []
    with path.open() as f:
        for line in f:
            if len(out) == n:
                break
            row = json.loads(line)
            ids = np.asarray(row["hash_ids"], dtype=np.uint64)
            last = row["input_length"] - (len(ids) - 1) * TRACE_BLOCK
            length = (len(ids) - 1) * id_tokens + max(1, -(-last * id_tokens // TRACE_BLOCK))
            pos = np.arange(length, dtype=np.uint64)
            x = _mix(ids[pos // np.uint64(id_tokens)] * np.uint64(id_tokens) + pos % id_tokens)
            tokens = (x % np.uint64(VOCAB - 1) + np.uint64(1)).astype(np.int64)
            out.append((row["timestamp"] / 1000 / speedup, tokens.tolist()))
    return out


class Proc:
    """A child process killed by pid when the bench leaves (even on error)."""

    url = ""

    def __init__(self, stack: ExitStack, args: list[str], name: str) -> None:
        self.log = Path(tempfile.mkstemp(prefix=f"bench-cluster-{name}-", suffix=".log")[1])
        with self.log.open("wb") as out:
            env = dict(os.environ, PYTHONPATH=str(ROOT))
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
        stack.callback(self.stop)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.unlink(missing_ok=True)

    def warnings(self) -> list[str]:
        """Its log's WARN/ERROR lines (a router refusing event batches says so there)."""
        text = self.log.read_text(errors="replace")
        return [line for line in text.splitlines() if "WARN" in line or "ERROR" in line]

    def wait_http(self, url: str) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # start-up only
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.proc.args[0]} exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"{url} did not start:\n{self.log.read_text()[-3000:]}")


def start_node(
    stack: ExitStack, cache_blocks: int, block: int, events: bool, speed: float = 1.0
) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cost = [f"{float(v) / speed:g}" if i % 2 else v for i, v in enumerate(GPU_CLASS)]
    args = [sys.executable, "-m", "aioprefill.serve", "--model", "sim", *cost,
            "--port", str(port), "--prefix-block-tokens", str(block),
            "--prefix-cache-bytes", str(cache_blocks * block * KV_BYTES_PER_TOKEN)]  # fmt: skip
    node = {"url": url}
    if events:
        node["events"] = f"tcp://127.0.0.1:{free_port()}"
        node["replay"] = f"tcp://127.0.0.1:{free_port()}"
        args += ["--kv-events-endpoint", node["events"]]
        args += ["--kv-events-replay-endpoint", node["replay"]]
    node["proc"] = Proc(stack, args, f"node{port}")
    return node


def start_router(stack: ExitStack, nodes: list[dict], arm: str, block: int) -> Proc:
    """vllm-router for an arm: a policy, `kv_aware@T` for kv_aware with `--router-temperature T`
    (0, the default, takes the cheapest node and breaks ties by the same order every time)."""
    policy, _, temperature = arm.partition("@")
    port = free_port()
    args = [str(ROUTER), "--worker-urls", *[n["url"] for n in nodes], "--host", "127.0.0.1",
            "--port", str(port), "--policy", policy, "--log-level", "warning",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            *os.environ.get("BENCH_ROUTER_FLAGS", "").split()]  # fmt: skip
    if temperature:
        args += ["--router-temperature", temperature]
    if policy == "kv_aware":
        args += ["--kv-event-model", "sim", "--kv-event-block-size", str(block)]
        for n in nodes:
            args += ["--kv-event-source", f"{n['url']}={n['events']}"]
            args += ["--kv-event-replay-source", f"{n['url']}={n['replay']}"]
    proc = Proc(stack, args, "router")
    proc.url = f"http://127.0.0.1:{port}"
    proc.wait_http(proc.url)
    return proc


def counters(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for name in ("prefix_cache_hits", "prefix_cache_queries", "prefix_cache_evictions"):
            if line.startswith(f"aioprefill_{name}_total "):
                out[name] = float(line.rsplit(" ", 1)[1])
        if (
            line.startswith("aioprefill_http_responses_total{")
            and "/v1/completions" in line
            and 'status="200"' in line
        ):
            out["answered"] = out.get("answered", 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def replay(url: str, requests: list[tuple[float, list[int]]]) -> tuple[list[float], int]:
    """Send each request at its arrival time; (latencies s, failures)."""
    lat: list[float] = []
    failed = 0
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as c:

        async def one(tokens: list[int]) -> None:
            nonlocal failed
            t = time.perf_counter()
            r = await c.post(
                url + "/v1/completions", json={"model": "sim", "prompt": tokens, "max_tokens": 1}
            )
            if r.status_code == 200:
                lat.append(time.perf_counter() - t)
            else:
                failed += 1

        start = time.perf_counter()
        tasks = []
        for arrival, tokens in requests:
            delay = start + arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(tokens)))
        await asyncio.gather(*tasks)
    return lat, failed


def run_arm(arm: str, requests: list, args: argparse.Namespace) -> dict:
    with ExitStack() as stack:
        single = arm == "single"
        n = 1 if single else args.nodes
        blocks = args.node_cache_blocks * (args.nodes if single else 1)
        speed = args.nodes if single else 1.0  # the single node: the cluster's cache and compute
        nodes = [
            start_node(stack, blocks, args.block, arm.startswith("kv_aware"), speed)
            for _ in range(n)
        ]
        for node in nodes:
            node["proc"].wait_http(node["url"])
        router = None if single else start_router(stack, nodes, arm, args.block)
        url = nodes[0]["url"] if router is None else router.url
        t0 = time.perf_counter()
        lat, failed = asyncio.run(replay(url, requests))
        wall = time.perf_counter() - t0
        per = [counters(node["url"]) for node in nodes]
        warned = [w for w in router.warnings() if "kv" in w.lower()] if router else []
    hits = sum(p.get("prefix_cache_hits", 0) for p in per)
    queries = sum(p.get("prefix_cache_queries", 0) for p in per)
    return {"arm": arm, "hit_ratio": hits / queries if queries else 0.0, "hit_tokens": hits,
            "queried_tokens": queries, "ttft_mean_ms": 1e3 * statistics.mean(lat),
            "ttft_p99_ms": 1e3 * float(np.percentile(lat, 99)), "failed": failed,
            "per_node": [int(p.get("answered", 0)) for p in per], "wall_s": wall,
            "router_kv_warnings": warned[:5], "evictions": sum(p.get("prefix_cache_evictions", 0)
            for p in per)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--requests", type=int, default=3993)
    ap.add_argument("--speedup", type=float, default=20.0)
    ap.add_argument("--id-tokens", type=int, default=16)
    ap.add_argument("--block", type=int, default=16, help="the engine's prefix_block_tokens")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--node-cache-blocks", type=int, default=2200)
    ap.add_argument("--arms", default="kv_aware@0.01,kv_aware,round_robin,cache_aware,single")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--offline", action="store_true", help="also print offline LRU ceilings")
    args = ap.parse_args()
    requests = load_trace(args.trace, args.requests, args.id_tokens, args.speedup)
    tokens = sum(len(t) for _, t in requests)
    print(f"{len(requests)} requests, {tokens} prompt tokens, {requests[-1][0]:.0f} s of arrivals;"
          f" {args.nodes} nodes x {args.node_cache_blocks} blocks of {args.block} tokens "
          f"(single: 1 x {args.nodes * args.node_cache_blocks})", flush=True)  # fmt: skip
    if args.offline:
        cap = args.node_cache_blocks
        single = offline_hit_ratio(requests, 1, cap * args.nodes, args.block, "best")
        best = offline_hit_ratio(requests, args.nodes, cap, args.block, "best")
        rr = offline_hit_ratio(requests, args.nodes, cap, args.block, "rr")
        print(f"offline LRU: single {single:.3f}, {args.nodes} nodes longest-prefix {best:.3f}, "
              f"round-robin {rr:.3f}", flush=True)  # fmt: skip
    rows = []
    for arm in filter(None, args.arms.split(",")):
        rows.append(r := run_arm(arm, requests, args))
        print(f"{arm:<15} hit {r['hit_ratio']:.3f}  TTFT mean {r['ttft_mean_ms']:.1f} ms "
              f"p99 {r['ttft_p99_ms']:.1f} ms  failed {r['failed']}  per node {r['per_node']}"
              f"  ({r['wall_s']:.0f} s)", flush=True)  # fmt: skip
        for w in r["router_kv_warnings"]:
            print("  router:", w[-200:])
    single = next((r for r in rows if r["arm"] == "single"), None)
    if single and single["hit_ratio"]:
        for r in rows:
            ratio = r["hit_ratio"] / single["hit_ratio"]
            print(f"{r['arm']:<15} hit ratio / single node's: {ratio:.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
