"""Where the store's hits go: one `store` run of `bench_kvstore_cluster` with every worker's
store-tier event log on (`AIOPREFILL_STORE_DIAG`, `aioprefill.kvstore.diag`), then, per request, the
blocks an ideal store would have given it (unbounded, instant puts: every full block of its
prompt's prefix that an earlier request's prompt had, the last token excepted) against what it
got (`cached_tokens`), the missing blocks put in the first category that explains them:

  not asked        the worker did not ask the store for that block: "chain ended" when it
                   asked for the blocks before it (the chain stops at the last block the local
                   cache gave the prompt a slot for), "no lookup" when it asked for none (a
                   later chunk, a chunk reading a local prefix that ends past it, link down)
  rule: held       the cost rule refused the batch's lookup, and the store held the block then
  rule: not held   refused, and the store did not hold it either (it is counted here, not below)
  not computed yet the lookup came before any node had computed the block (its source request
                   was still queued or running)
  put pending      computed, not yet put when the lookup came (the put's latency)
  put dropped      never put: the put budget was full (back-pressure)
  never put        computed, never put (put recently by that worker, link down)
  evicted          put before the lookup and missing at it (the store's eviction)
  never written    no node wrote (so put) it: computed past the slots its own prompt was given
  busy / timeout   the load buffer was still owned by a late call / the lookup passed its deadline
  unannounced      (`--directory`) no node had announced the chain's head: no call made

    python benchmarks/kvstore_gap.py [bench_kvstore_cluster's options]
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import bench_kvstore_cluster as bench
import numpy as np

from aioprefill import Engine, EngineConfig, KVStoreOptions, SimModel
from aioprefill.bench.presets import SIM_PRESETS
from aioprefill.kvstore.master import LocalMaster
from aioprefill.prefix.hashing import block_hashes

# A worker's log time and the request's (the engine's clock, converted) disagree by up to
# tens of ms on the busy host: an ask counts as the request's until this long after its end.
_LATE = 0.2


async def run(trace, configs: list[EngineConfig], speedup: float) -> list[dict]:
    engines = [Engine(c) for c in configs]
    for e in engines:
        await e.start()
    wall0, mono0 = time.time(), time.monotonic_ns()
    out: list[dict] = [{} for _ in trace]
    try:
        t0 = time.monotonic()

        async def one(i: int, at: float, ids: list[int]) -> None:
            await asyncio.sleep(max(0.0, t0 + at / speedup - time.monotonic()))
            r = await engines[i % len(engines)].prefill(ids)
            out[i] = {"node": i % len(engines), "cached": r.cached_tokens,
                      "start": wall0 + (r.submitted_ns - mono0) / 1e9,
                      "end": wall0 + (r.finished_ns - mono0) / 1e9}  # fmt: skip

        await asyncio.gather(*(one(i, at, ids) for i, (at, ids) in enumerate(trace)))
    finally:
        for e in engines:
            await e.close()
    return out


def analyse(trace, reqs: list[dict], logs: list[dict], block: int) -> None:
    put_at: dict[int, float] = {}
    wrote_at: dict[int, float] = {}
    dropped: set[int] = set()
    asks: dict[int, list[tuple[float, str, int, int]]] = {}  # hash -> (t, decision, idx, got)
    for log in logs:
        for t, hashes in log["puts"]:
            for h in hashes:
                put_at[h] = min(put_at.get(h, t), t)
        for t, hashes in log["written"]:
            for h in hashes:
                wrote_at[h] = min(wrote_at.get(h, t), t)
        dropped.update(h for _, h in log["drops"])
        for t, decision, chains, got, *_ in log["asks"]:
            for chain, g in zip(chains, got, strict=True):
                for j, h in enumerate(chain):
                    asks.setdefault(h, []).append((t, decision, j, g))
    seen: set[int] = set()
    why: Counter[str] = Counter()
    ideal = actual = prompt = 0
    for (_, ids), r in zip(trace, reqs, strict=True):
        hashes = block_hashes(np.asarray(ids, dtype="<i4").tobytes(), block)
        usable = hashes[: (len(ids) - 1) // block]
        k = 0
        while k < len(usable) and usable[k] in seen:
            k += 1
        seen.update(hashes)
        got = r["cached"] // block
        prompt += len(ids)
        ideal += k * block
        actual += r["cached"]
        if got >= k:
            continue
        h = usable[got]
        mine = [a for a in asks.get(h, []) if r["start"] - 1e-3 <= a[0] <= r["end"] + _LATE]
        if not mine:
            window = [a for j in range(got) for a in asks.get(usable[j], [])
                      if r["start"] - 1e-3 <= a[0] <= r["end"] + _LATE]  # fmt: skip
            reason = "not asked: chain ended" if window else "not asked: no lookup"
        else:
            t, decision, _, _ = mine[0]
            held = put_at.get(h, float("inf")) < t
            if decision == "skip":
                reason = "rule: held" if held else "rule: not held"
            elif decision == "unlisted":  # (`--directory`: no node had announced the head)
                reason = "unannounced: held" if held else "unannounced: not held"
            elif decision in ("busy", "timeout"):
                reason = decision
            elif held:
                reason = "evicted"
            elif h in put_at:
                reason = "put pending" if wrote_at.get(h, t) < t else "not computed yet"
            elif h in dropped:
                reason = "put dropped"
            elif h in wrote_at:
                reason = "never put" if wrote_at[h] < t else "not computed yet"
            else:
                reason = "never written"
        why[reason] += (k - got) * block
    print(f"ideal hit ratio {ideal / prompt:.3f}, got {actual / prompt:.3f} "
          f"(gap {(ideal - actual) / prompt:.3f} of the prompt tokens), by reason:")  # fmt: skip
    for reason, n in why.most_common():
        print(f"  {reason:18} {n / prompt:6.3f}  ({n / max(1, ideal - actual):4.0%} of the gap)")
    for log in logs:
        s = log["stats"]
        print("  worker:", {k: v for k, v in s.items() if v and not k.endswith("bytes")})
    load_parts(logs)


def load_parts(logs: list[dict]) -> None:
    """Where a load call's time goes (`Loader.parts`), calls that found nothing apart."""
    names = ("handoff", "store call", "checks", "wake back", "into slots", "rest", "in all")
    for found in (False, True):
        rows = [(a[4], a[6]) for log in logs for a in log["asks"]
                if len(a) > 6 and len(a[6]) == 5 and (sum(a[3]) > 0) == found]  # fmt: skip
        if not rows:
            continue
        cols = [[p[i] for _, p in rows] for i in range(5)]
        cols += [[took - sum(p) for took, p in rows], [took for took, _ in rows]]
        print(f"load calls that found {'some' if found else 'nothing'} ({len(rows)}), ms "
              "median / mean:")  # fmt: skip
        print("  " + ", ".join(f"{n} {np.median(c) * 1e3:.3f}/{np.mean(c) * 1e3:.3f}"
                               for n, c in zip(names, cols, strict=True)))  # fmt: skip


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.cluster_arguments(ap)
    ap.add_argument("--logs", type=Path, help="keep the workers' logs here")
    ap.add_argument("--analyse", type=Path, help="only analyse the logs a run left here")
    args = ap.parse_args()
    trace = bench.load_trace(args.trace, args.requests, args.block)
    if args.analyse:
        logs = [json.loads(p.read_text()) for p in sorted(args.analyse.glob("store-*.json"))]
        reqs = json.loads((args.analyse / "requests.json").read_text())
        analyse(trace, reqs, logs, args.block)
        return
    cost = SIM_PRESETS[args.preset]
    model = SimModel(fixed_ms=cost.fixed_ms, per_token_us=cost.per_token_us, attn_ns=cost.attn_ns,
                     kv_bytes_per_token=args.kv_per_token)  # fmt: skip
    local = args.local_blocks * args.block * args.kv_per_token
    with tempfile.TemporaryDirectory() as tmp:
        d = str(args.logs or tmp)
        Path(d).mkdir(parents=True, exist_ok=True)
        os.environ["AIOPREFILL_STORE_DIAG"] = d  # the workers inherit it
        with LocalMaster() as m:
            events = bench.event_endpoints(args)
            store = KVStoreOptions(
                master=m.address,
                segment_bytes=args.segment_mb << 20,
                scratch_blocks=args.scratch_blocks,
                peer_events=tuple(events) if args.directory else (),
            )
            configs = [EngineConfig(model=model, prefix_cache_bytes=local,
                                    prefix_block_tokens=args.block, kv_store="mooncake",
                                    kv_store_options=store,
                                    kv_events_endpoint=events[i] if args.directory else None)
                       for i in range(bench.NODES)]  # fmt: skip
            reqs = asyncio.run(run(trace, configs, args.speedup))
        logs = [json.loads(p.read_text()) for p in sorted(Path(d).glob("store-*.json"))]
        (Path(d) / "requests.json").write_text(json.dumps(reqs))
    print(f"# kvstore_gap: {' '.join(sys.argv[1:])}; {len(logs)} worker logs")
    analyse(trace, reqs, logs, args.block)


if __name__ == "__main__":
    main()
