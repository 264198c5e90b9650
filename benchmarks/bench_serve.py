"""Server CPU per request of `python -m aioprefill.serve` (uvicorn, granian ASGI and RSGI,
/v1/completions and /v1/embeddings) against the bare /prefill example and mosec, side by side in
one run, on one harness with the same arrivals.

Every variant is a real server process tree on 127.0.0.1 serving a zero-cost model: a SimModel
engine whose forwards take 0.5 ms (sleeping, not computing), or for mosec a worker that hashes
the prompt. The client is benchmarks/bench_servers.py's (bare keep-alive HTTP/1.1 connections on
uvloop), in two phases per variant: bursty (bursts of `--burst` requests every `--interval-ms`,
open loop) and saturated (`--concurrency` requests always outstanding). Server CPU is the CPU
time of the whole server process tree (server, HTTP workers, engine workers; schedstat, every
thread) over the phase, divided by the requests answered. Variants run in interleaved rounds,
medians reported.

    python benchmarks/bench_serve.py [--rounds 3] [--duration 5] [--variants a,b]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import httpx
import uvloop
from bench_servers import Pool, bursty, saturated
from common import ROOT, free_port, tree_cpu_s

SIM = ["--model", "sim", "--sim-fixed-ms", "0.5", "--sim-per-token-us", "0"]
# name -> (command after `python`, path, body kind)
VARIANTS: dict[str, tuple[list[str], bytes, str]] = {
    "serve uvicorn /v1/completions": (["-m", "aioprefill.serve", *SIM], b"/v1/completions", "c"),
    "serve granian /v1/completions": (
        ["-m", "aioprefill.serve", *SIM, "--server", "granian"], b"/v1/completions", "c"),
    "serve granian-rsgi /v1/completions": (
        ["-m", "aioprefill.serve", *SIM, "--server", "granian-rsgi"], b"/v1/completions", "c"),
    "serve uvicorn /v1/embeddings": (["-m", "aioprefill.serve", *SIM], b"/v1/embeddings", "e"),
    "serve granian /v1/embeddings": (
        ["-m", "aioprefill.serve", *SIM, "--server", "granian"], b"/v1/embeddings", "e"),
    "serve granian-rsgi /v1/embeddings": (
        ["-m", "aioprefill.serve", *SIM, "--server", "granian-rsgi"], b"/v1/embeddings", "e"),
    "example asgi /prefill": (
        [str(ROOT / "examples" / "asgi_server.py"), "--sim-fixed-ms", "0.5",
         "--sim-per-token-us", "0"], b"/prefill", "t"),
    "mosec /inference": (
        [str(ROOT / "benchmarks" / "tools" / "mosec_server.py")], b"/inference", "c"),
}  # fmt: skip


class Server:
    def __init__(self, argv: list[str]) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, *argv, "--port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'examples'}"),
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"

    def ready(self, probe: bytes, path: bytes) -> None:
        for _ in range(600):
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.post(self.url + path.decode(), content=probe).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError("server not ready")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def bodies(kind: str) -> list[bytes]:
    rng = random.Random(0)
    key = {"c": b"prompt", "e": b"input", "t": b"tokens"}[kind]
    extra = b', "max_tokens": 1' if kind == "c" else b""
    return [b'{"%s": [%s]%s}' % (key, b", ".join(b"%d" % rng.randrange(1, 32000)
            for _ in range(64)), extra) for _ in range(256)]  # fmt: skip


async def measure(name: str, args: argparse.Namespace) -> dict[str, float]:
    argv, path, kind = VARIANTS[name]
    body = bodies(kind)
    server = Server(argv)
    pool = Pool(server.port, path)
    try:
        await asyncio.to_thread(server.ready, body[0], path)
        await saturated(pool, body, args.concurrency, 0.5)  # warm up, open the connections
        pid, out = server.proc.pid, {}
        c0 = tree_cpu_s(pid)
        n = await bursty(pool, body, args.burst, args.interval_ms / 1e3, args.duration)
        out["bursty_cpu_ms"] = (tree_cpu_s(pid) - c0) * 1e3 / n
        c0, t0 = tree_cpu_s(pid), time.monotonic()
        n = await saturated(pool, body, args.concurrency, args.duration)
        out["sat_cpu_ms"] = (tree_cpu_s(pid) - c0) * 1e3 / n
        out["sat_rps"] = n / (time.monotonic() - t0)
    finally:
        pool.close()
        server.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=5.0, help="seconds per phase")
    p.add_argument("--burst", type=int, default=64)
    p.add_argument("--interval-ms", type=float, default=100.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names")
    args = p.parse_args()
    names = [n.strip() for n in args.variants.split(",")]
    print(f"bursts of {args.burst} every {args.interval_ms:g} ms, then {args.concurrency} "
          f"concurrent; {args.duration:g} s per phase; {args.rounds} interleaved rounds; "
          f"{os.cpu_count()} CPUs; whole server process tree", flush=True)  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = defaultdict(list)
    for r in range(args.rounds):
        for name in names:
            runs[name].append(uvloop.run(measure(name, args)))
            print(f"  round {r + 1}: {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    width = max(map(len, names))
    print(f"\n{'server':<{width}}  bursty CPU ms/req  saturated req/s  CPU ms/req")
    for name in names:
        med = {k: statistics.median(run[k] for run in runs[name]) for k in runs[name][0]}
        print(f"{name:<{width}}  {med['bursty_cpu_ms']:17.3f}  {med['sat_rps']:15.0f}  "
              f"{med['sat_cpu_ms']:10.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
