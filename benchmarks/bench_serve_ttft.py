"""TTFT over HTTP vs the same prompts through an embedded Engine, on the real model.

Two engines with the same model run side by side: one inside this process (`await
engine.prefill(ids)`), one inside `python -m aioprefill.serve` (POST /v1/completions with the
same ids and `max_tokens` 1, over one bare keep-alive HTTP/1.1 connection from this process).
Requests alternate one by one between the two, one at a time, so both see the same machine
load; each latency is the caller's wall time from the call (or the request's first byte) to
the result (or the response's last byte). The difference of the medians is what the HTTP
server adds: parsing, JSON, routing and the loopback round trip.

    python benchmarks/bench_serve_ttft.py [--model PATH] [--requests 100] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import time

import uvloop
from bench_servers import Connection
from common import ROOT, free_port

from aioprefill import Engine, EngineConfig, PaddleModel, SimModel
from aioprefill.serve.__main__ import default_model


async def run(args: argparse.Namespace) -> None:
    path = args.model or default_model()
    port = free_port()
    sim = ["--sim-fixed-ms", "5", "--sim-per-token-us", "0"] if path == "sim" else []
    server = subprocess.Popen(
        [sys.executable, "-m", "aioprefill.serve", "--model", path, *sim, "--port", str(port),
         "--server", args.server, "--workers", "1", "--threads", "1"],  # as the engine beside it
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
    )  # fmt: skip
    rng = random.Random(0)
    model = SimModel(fixed_ms=5, per_token_us=0) if path == "sim" else None
    config = EngineConfig(model=model or PaddleModel.from_pretrained(path))
    prompts = [[rng.randrange(100, config.model.vocab_size) for _ in range(args.tokens)]
               for _ in range(args.requests)]  # fmt: skip
    bodies = [b'{"prompt": [%s], "max_tokens": 1}' % b",".join(b"%d" % t for t in p)
              for p in prompts]  # fmt: skip
    try:
        async with Engine(config) as engine:
            conn = None
            for _ in range(1200):  # the server loads the model too
                try:
                    conn = await Connection.open(port, b"/v1/completions")
                    if await conn.post(bodies[0]):
                        break
                except (OSError, asyncio.IncompleteReadError):
                    conn = None
                await asyncio.sleep(0.1)
            assert conn is not None, "the server did not start"
            for p, b in zip(prompts[:5], bodies[:5], strict=True):  # warm both
                await engine.prefill(p)
                await conn.post(b)
            embedded, http = [], []
            for p, b in zip(prompts, bodies, strict=True):
                t0 = time.perf_counter()
                await engine.prefill(p)
                t1 = time.perf_counter()
                ok = await conn.post(b)
                t2 = time.perf_counter()
                assert ok
                embedded.append((t1 - t0) * 1e3)
                http.append((t2 - t1) * 1e3)
            conn.close()
    finally:
        server.terminate()
        server.wait(60)
    e50, h50 = statistics.median(embedded), statistics.median(http)
    diffs = sorted(h - e for h, e in zip(http, embedded, strict=True))
    print(f"{args.requests} requests of {args.tokens} tokens, alternating, one at a time; "
          f"model {path}; server {args.server}")  # fmt: skip
    print(f"embedded Engine.prefill  p50 {e50:7.2f} ms  p90 {_p(embedded, 0.9):7.2f} ms")
    print(f"HTTP /v1/completions     p50 {h50:7.2f} ms  p90 {_p(http, 0.9):7.2f} ms")
    print(f"HTTP adds: {h50 - e50:+.2f} ms at p50 (median of paired differences "
          f"{statistics.median(diffs):+.2f} ms)")  # fmt: skip


def _p(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model", default=None, help="checkpoint dir, .gguf (default: SmolLM2), or 'sim'"
    )
    p.add_argument("--server", default="uvicorn", help="the serve process's --server")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--tokens", type=int, default=64)
    uvloop.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
