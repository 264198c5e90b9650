"""What pulling a KV export through Mooncake costs, against the raw transfer engine.

1. Pull throughput and latency for 1, 16 and 64 MiB exports of a Llama-3-8B-shaped layout
   (32 layers, 8 KV heads of 128, bf16: 128 KiB per token; a bare `KVExports` ledger with
   `kv_transfer` on, segments filled with random bytes). A separate decode process (this script
   with `--decode`), interleaved round by round, on the same process-wide transfer engine:
   - `raw`: `transfer_sync_read` of the whole region into a destination registered once (the
     transfer engine alone);
   - `raw_sliced`: the same as one batch of 4 MiB reads (`pull.SLICE_BYTES`, as pulls do);
   - `pull`: `pull_kv(params)` (a fresh destination, registered and deregistered, one read,
     then the 32-byte id check);
   - `pull_into`: `pull_kv(params, into=(keys, values))` into preallocated arrays (two reads);
   - `into_inline`: the same with `timeout_s=None` (the read in the calling thread);
   - `per_layer`: `pull_kv(params, into=[(k_l, v_l) ...])`: 64 reads in one batch.
   Medians (and p90) over `--repeats` rounds after two warm-up rounds; `x raw` is the faster
   raw mode's median time over the mode's.
2. Registration cost per export: deregister + register of an open export (mapping the
   segment, `register_memory`, its id entry), engine side, per size.
3. The prefill loop while 8 pulls run: a SimModel engine (2 ms forwards) with one 16 MiB
   export; the event loop's lag (a 1 ms sleeper's oversleep) and 16-token `prefill()` latency,
   first idle, then while 8 decode processes pull the export in a loop, then idle again, then
   beside 8 processes that only spin (the CPU contention alone, for comparison).

    python benchmarks/bench_kv_transfer.py [--repeats 15] [--sizes 1,16,64] [--seconds 3]
                                           [--pulls-only]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

import numpy as np

from aioprefill import Engine, EngineConfig, SimModel
from aioprefill.models import PaddleModel
from aioprefill.shm.segments import create_segment
from aioprefill.transfer import TransferOptions
from aioprefill.wire.kv import KVExports

SPEC = PaddleModel(
    num_layers=32, num_heads=32, num_kv_heads=8, hidden_size=4096, dtype="bfloat16",
    intermediate_size=14336, vocab_size=128256,
)  # fmt: skip
MODES = ("raw", "raw_sliced", "pull", "pull_into", "into_inline", "per_layer")


def _decode(repeats: int) -> None:
    """The decode process: params list on stdin, one JSON line of timings (seconds) out."""
    from aioprefill.transfer import pull_kv
    from aioprefill.transfer.local import local_engine
    from aioprefill.transfer.params import parse_params
    from aioprefill.transfer.pull import sliced

    out = {}
    for params in json.loads(sys.stdin.read()):
        p = parse_params(params)
        te = local_engine(p.protocol).engine
        dst = np.empty(p.nbytes, np.uint8)
        te.register_memory(int(dst.ctypes.data), p.nbytes)
        keys = np.empty(p.layout.shape, np.uint16)
        values = np.empty(p.layout.shape, np.uint16)
        layers = list(zip(keys, values, strict=True))
        ops = {
            "raw": lambda p=p, dst=dst, te=te: te.transfer_sync_read(
                p.session, int(dst.ctypes.data), p.addr, p.nbytes
            ),
            "raw_sliced": lambda p=p, dst=dst, te=te: te.batch_transfer_sync_read(
                p.session,
                *(
                    list(c)
                    for c in zip(*sliced([(int(dst.ctypes.data), p.addr, p.nbytes)]), strict=True)
                ),
            ),
            "pull": lambda params=params: pull_kv(params),
            "pull_into": lambda params=params, k=keys, v=values: pull_kv(params, into=(k, v)),
            "into_inline": lambda params=params, k=keys, v=values: pull_kv(
                params, into=(k, v), timeout_s=None
            ),
            "per_layer": lambda params=params, ls=layers: pull_kv(params, into=ls),
        }
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for rep in range(repeats + 2):
            for mode in MODES:
                t0 = time.perf_counter()
                rc = ops[mode]()
                took = time.perf_counter() - t0
                assert rc in (0, None) or hasattr(rc, "keys"), (mode, rc)
                if rep >= 2:
                    times[mode].append(took)
        te.unregister_memory(int(dst.ctypes.data))
        out[str(p.nbytes)] = times
    print(json.dumps(out), flush=True)


def _pull_loop() -> None:
    """A decode process that pulls one export (params on stdin) until killed."""
    from aioprefill.transfer import pull_kv

    params = json.loads(sys.stdin.readline())
    pull_kv(params)
    print("pulling", flush=True)
    while True:
        pull_kv(params)


def throughput(sizes_mib: list[int], repeats: int) -> None:
    ledger = KVExports(SPEC, 1 << 32, TransferOptions(export_ttl_s=None))
    per_token = ledger.layout.nbytes(1)
    handles, reg_costs = [], {}
    rng = np.random.default_rng(0)
    for mib in sizes_mib:
        ticket = ledger.reserve((mib << 20) // per_token)
        mm = create_segment(ticket.name, ticket.nbytes, track=False)
        mm[:] = rng.integers(0, 256, ticket.nbytes, dtype=np.uint8).tobytes()
        mm.close()
        handle = ledger.open(ticket)
        registry = ledger.transfer
        assert registry is not None
        costs = []
        for _ in range(20):  # deregister + register an open export
            t0 = time.perf_counter()
            registry.deregister(handle.name)
            registry.register(handle)
            costs.append(time.perf_counter() - t0)
        reg_costs[mib] = float(np.median(costs))
        handles.append(handle)
    params = [h.transfer_params() for h in handles]
    proc = subprocess.run(
        [sys.executable, __file__, "--decode", "--repeats", str(repeats)],
        input=json.dumps(params).encode(),
        capture_output=True,
        check=True,
    )
    times = json.loads(proc.stdout.decode().splitlines()[-1])
    print(f"pulls from another process, TCP over loopback, medians of {repeats} (p90):")
    print(f"{'size':>6} {'mode':>10} {'ms':>16} {'GB/s':>6} {'x raw':>6}")
    for mib, h in zip(sizes_mib, handles, strict=True):
        per = times[str(h.nbytes)]
        raw = min(float(np.median(per["raw"])), float(np.median(per["raw_sliced"])))
        for mode in MODES:
            med, p90 = float(np.median(per[mode])), float(np.percentile(per[mode], 90))
            print(
                f"{mib:>4}Mi {mode:>10} {med * 1e3:>7.2f} ({p90 * 1e3:>6.2f}) "
                f"{h.nbytes / med / 1e9:>6.2f} {raw / med:>6.2f}"
            )
    print("registration (deregister + register of an open export), engine side, median:")
    for mib, cost in reg_costs.items():
        print(f"{mib:>4}Mi {cost * 1e6:>8.1f} us")
    for h in handles:
        h.close()
    ledger.close_all()


async def _measure(engine: Engine, seconds: float) -> tuple[list[float], list[float]]:
    lags: list[float] = []
    lat: list[float] = []
    end = time.monotonic() + seconds

    async def sleeper() -> None:
        while time.monotonic() < end:
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t0 - 0.001)

    async def prefills() -> None:
        i = 0
        while time.monotonic() < end:
            t0 = time.perf_counter()
            await engine.prefill([i % 30000 + 1] * 16)
            lat.append(time.perf_counter() - t0)
            i += 1

    await asyncio.gather(sleeper(), prefills())
    return lags, lat


def _row(name: str, lags: list[float], lat: list[float]) -> str:
    q = np.percentile
    return (
        f"{name:>12} lag p50 {q(lags, 50) * 1e3:6.3f} p99 {q(lags, 99) * 1e3:6.3f} ms | "
        f"prefill p50 {q(lat, 50) * 1e3:6.2f} p99 {q(lat, 99) * 1e3:6.2f} ms ({len(lat)} reqs)"
    )


async def loop_lag(seconds: float, pullers: int = 8) -> None:
    config = EngineConfig(model=SimModel(fixed_ms=2.0, per_token_us=0.0), kv_transfer="mooncake")
    async with Engine(config) as engine:
        r = await engine.prefill([i % 30000 + 1 for i in range(65536)], return_kv=True)  # 16 MiB
        line = json.dumps(r.kv.transfer_params()) + "\n"
        rows = [_row("idle", *await _measure(engine, seconds))]
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                __file__,
                "--pull-loop",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
            )
            for _ in range(pullers)
        ]
        for proc in procs:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(line.encode())
            await proc.stdin.drain()
            assert await proc.stdout.readline() == b"pulling\n"
        rows.append(_row(f"{pullers} pulls", *await _measure(engine, seconds)))
        for proc in procs:
            proc.kill()
            await proc.wait()
        rows.append(_row("idle again", *await _measure(engine, seconds)))
        # control: as many processes that only burn CPU (what the pulls cost as CPU alone)
        spin = "while True: pass"
        procs = [
            await asyncio.create_subprocess_exec(sys.executable, "-c", spin) for _ in range(pullers)
        ]
        rows.append(_row(f"{pullers} spinners", *await _measure(engine, seconds)))
        for proc in procs:
            proc.kill()
            await proc.wait()
        r.kv.close()
    print(f"prefill loop, SimModel 2 ms forwards, one 16 MiB export, {seconds} s per phase:")
    print("\n".join(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--sizes", default="1,16,64", help="export sizes in MiB")
    ap.add_argument("--seconds", type=float, default=3.0, help="per loop-lag phase")
    ap.add_argument("--pulls-only", action="store_true", help="skip the loop-lag part (3.)")
    ap.add_argument("--decode", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pull-loop", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.pull_loop:
        _pull_loop()
        return
    if args.decode:
        _decode(args.repeats)
        return
    throughput([int(s) for s in args.sizes.split(",")], args.repeats)
    if not args.pulls_only:
        asyncio.run(loop_lag(args.seconds))


if __name__ == "__main__":
    main()
