"""What reading a prefix from the Mooncake Store costs, against computing it: the numbers
behind the store tier's cost rule (`aioprefill.kvstore.cost`, docs/kv-store.md).

1. Loads over loopback TCP. A writer process (this script with `--writer`) lends the store
   its segment and puts N blocks through a `StoreTier` (real values: header, token ids,
   payload, CRC32); this process (a 16 MiB segment, the least Mooncake takes; the blocks
   live in the writer's) loads chains of k blocks, interleaved round by round:
   - `raw`: one `batch_get_into` of the k values into the registered load buffer (the
     client alone);
   - `tier`: `StoreTier.load`: the same call on the load thread, every value checked, and
     each payload copied into a cache-slot array by the sink (what a worker pays).
   Medians over `--repeats` rounds; a least-squares fit of time(k) = latency + k * bytes / bw
   gives each mode's per-chain latency and bandwidth.
2. Puts, in the writer: `offer` per block (the copy on the forward's path) and the put
   thread's throughput (first offer to drained).
3. The other side of the rule: the tiny Llama's forward per computed token (an Engine with
   `PaddleModel(seed=0)`, one 1-thread worker, a 512-token prompt), measured in this run
   between store rounds; with `--smollm2`, SmolLM2-135M too. Then, per block size, the
   seconds per token a load costs (latency amortized over k) against the forward's, and
   `min_blocks` (the shortest chain worth reading).

    python benchmarks/bench_kvstore.py [--repeats 7] [--smollm2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

import numpy as np

from aioprefill.kvstore import KVStoreOptions
from aioprefill.kvstore.cost import min_blocks
from aioprefill.kvstore.identity import StoreIdentity
from aioprefill.kvstore.master import LocalMaster
from aioprefill.kvstore.tier import StoreTier

B = 16
# One block's payload: tiny Llama (4 layers x K,V x 4 heads x 32 x f32 + hidden 256 f32, per
# token: 5 KiB) and SmolLM2-135M (30 x 2 x 3 x 64 x f32 + 576 f32: 47.25 KiB per token).
SIZES = {"tiny-llama": 16 * 5 * 1024, "smollm2": 16 * 48384}
CHAINS = (1, 2, 4, 8, 16, 32)
N = max(CHAINS)


def identity(name: str) -> StoreIdentity:
    return StoreIdentity("bench-" + name, "float32", name, B)


def tokens(i: int) -> np.ndarray:
    return np.arange(i * B, (i + 1) * B, dtype=np.int32)


def writer(master: str) -> None:
    """Put N blocks of every size, report put costs, keep the segment until stdin closes."""
    out = {}
    tiers = []
    for name, size in SIZES.items():
        opts = KVStoreOptions(
            master=master, segment_bytes=256 << 20, put_buffer_bytes=(N + 1) * (size + 4096)
        )
        t = StoreTier(opts, identity(name), size)
        t.start()
        assert t.wait_up(30)
        payload = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        start = time.perf_counter()
        offers = []
        for i in range(N):
            t0 = time.perf_counter()
            assert t.offer(i + 1, tokens(i), [payload])
            offers.append(time.perf_counter() - t0)
        with t.puts.cond:
            t.puts.cond.wait_for(lambda t=t: len(t.puts.free) == len(t.puts.slots), 60)
        elapsed = time.perf_counter() - start
        assert t.stats.puts == N, t.stats
        out[name] = {
            "offer_us": statistics.median(offers) * 1e6,
            "put_MBps": N * t.value_bytes / elapsed / 1e6,
        }
        tiers.append(t)
    print(json.dumps(out), flush=True)
    sys.stdin.read()
    for t in tiers:
        t.close()


def fit(points: dict[int, float], value_bytes: int) -> tuple[float, float]:
    """Least squares of time = latency + k * value_bytes / bw: (latency_s, bytes_per_s)."""
    ks = np.array(list(points), dtype=float)
    ts = np.array(list(points.values()))
    slope, intercept = np.polyfit(ks, ts, 1)
    return max(float(intercept), 0.0), value_bytes / float(slope)


def load_rounds(master: str, repeats: int) -> dict[str, dict[str, dict[int, float]]]:
    times: dict[str, dict[str, dict[int, list[float]]]] = {}
    for name, size in SIZES.items():
        opts = KVStoreOptions(
            master=master,
            segment_bytes=16 << 20,
            put_buffer_bytes=0,
            load_buffer_bytes=(N + 1) * (size + 4096),
            read_latency_s=0.0,
        )
        t = StoreTier(opts, identity(name), size, seconds_per_token=1.0)
        t.start()
        assert t.wait_up(30)
        slots = np.empty((N, size), dtype=np.uint8)
        chain = [(i + 1, tokens(i)) for i in range(N)]
        keys = [t.identity.key(h) for h, _ in chain]
        base = t.loader.buffer.ctypes.data

        def sink(c: int, i: int, payload: memoryview, slots: np.ndarray = slots) -> None:
            slots[i] = np.frombuffer(payload, dtype=np.uint8)

        per = times.setdefault(name, {"raw": {}, "tier": {}})
        for r in range(repeats + 2):
            for k in CHAINS:
                t0 = time.perf_counter()
                codes = t.link.store.batch_get_into(
                    keys[:k], [base + i * t.loader.stride for i in range(k)], [t.value_bytes] * k
                )
                raw = time.perf_counter() - t0
                assert all(c == t.value_bytes for c in codes), codes
                t0 = time.perf_counter()
                assert t.load([chain[:k]], sink) == [k], t.stats
                tier = time.perf_counter() - t0
                if r >= 2:  # two warm-up rounds
                    per["raw"].setdefault(k, []).append(raw)
                    per["tier"].setdefault(k, []).append(tier)
        t.close()
    return {
        n: {m: {k: statistics.median(v) for k, v in ks.items()} for m, ks in modes.items()}
        for n, modes in times.items()
    }


async def forward_per_token(model: object, prompt_len: int, repeats: int) -> float:
    from aioprefill import Engine, EngineConfig

    rng = np.random.default_rng(1)
    async with Engine(EngineConfig(model=model, max_batch_tokens=max(8192, prompt_len))) as e:
        await e.prefill(rng.integers(0, 1000, prompt_len).tolist())  # warm-up
        got = []
        for _ in range(repeats):
            r = await e.prefill(rng.integers(0, 1000, prompt_len).tolist())
            got.append((r.forward_end_ns - r.forward_start_ns) / 1e9 / prompt_len)
    return statistics.median(got)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--smollm2", action="store_true")
    ap.add_argument("--writer", metavar="MASTER")
    args = ap.parse_args()
    if args.writer:
        writer(args.writer)
        return
    from aioprefill import PaddleModel

    models = {"tiny-llama": PaddleModel(seed=0)}
    if args.smollm2:
        from tests.tokenizer_files import smollm2_gguf

        models["smollm2"] = PaddleModel.from_pretrained(smollm2_gguf())
    with LocalMaster() as master:
        w = subprocess.Popen(
            [sys.executable, __file__, "--writer", master.address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert w.stdout is not None
            line = next(x for x in iter(w.stdout.readline, "") if x.startswith("{"))
            puts = json.loads(line)
            spt = {n: asyncio.run(forward_per_token(m, 512, 3)) for n, m in models.items()}
            loads = load_rounds(master.address, args.repeats)
            spt2 = {n: asyncio.run(forward_per_token(m, 512, 3)) for n, m in models.items()}
        finally:
            w.communicate("", timeout=120)
    report(puts, loads, {n: (spt[n] + spt2[n]) / 2 for n in spt}, args)


def report(puts, loads, spt, args) -> None:  # type: ignore[no-untyped-def]
    print(f"# bench_kvstore: loopback TCP, {args.repeats} rounds, chains {CHAINS}, B={B}")
    print("\n## 1. loads (median ms per chain of k blocks)")
    for name, modes in loads.items():
        size = SIZES[name]
        print(f"\n{name}: payload {size} B per block")
        print("mode  " + "".join(f"{f'k={k}':>9}" for k in CHAINS) + "   latency   bandwidth")
        for mode, pts in modes.items():
            lat, bw = fit(pts, size)
            row = "".join(f"{pts[k] * 1e3:9.3f}" for k in CHAINS)
            print(f"{mode:5} {row}  {lat * 1e3:6.3f} ms  {bw / 1e9:6.2f} GB/s")
    print("\n## 2. puts (writer process)")
    for name, p in puts.items():
        print(
            f"{name}: offer {p['offer_us']:.1f} us/block (forward's path), "
            f"put thread {p['put_MBps']:.0f} MB/s"
        )
    print("\n## 3. the rule: load k blocks iff latency + k*bytes/bw < k*B*forward_s_per_token")
    for name, sec in spt.items():
        size = SIZES[name]
        lat, bw = fit(loads[name]["tier"], size)
        per_tok_read = size / bw / B
        k = min_blocks(size, B, sec, bw, lat)
        print(
            f"{name}: forward {sec * 1e6:.1f} us/token (512-token prompt, 1 thread); "
            f"store read {per_tok_read * 1e6:.2f} us/token + {lat * 1e3:.3f} ms per chain; "
            f"ratio compute/read per block {sec * B / (size / bw):.1f}x; "
            f"min_blocks {k}"
        )


if __name__ == "__main__":
    main()
