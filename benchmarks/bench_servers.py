"""Server CPU per request and requests/s of the example HTTP fronts, side by side in one run.

Each variant is a real server process from `examples/` on 127.0.0.1 (a SimModel engine with one
worker whose forwards take 0.5 ms whatever the batch, so the engine never limits throughput),
driven by the same client (bare keep-alive HTTP/1.1 connections on uvloop, in this process: the
cheapest Python client, so that the server saturates first) through two phases:

* bursty: bursts of `--burst` requests (64-token prompts, bodies pre-encoded) every
  `--interval-ms`, open loop, for `--duration` s: the server CPU a request costs at a load the
  server keeps up with;
* saturated: `--concurrency` requests always outstanding for `--duration` s: requests/s with
  the server as busy as it gets (the "server CPU" column says how busy: the client shares the
  machine's CPUs, so below 100% the client limited it too).

Server CPU is the server process's CPU time (all its threads, /proc/PID/task/*/schedstat) over
the phase (the engine's worker processes excluded), divided by the requests answered. Variants
run in interleaved rounds (`--rounds`), medians reported. `--profile` adds one cProfile run
(CPU time, bursty phase) per variant and prints where the server's thread spent it, by package
(profiling inflates Python's share: read the shares, not the microseconds).

    python benchmarks/bench_servers.py [--rounds 3] [--duration 5] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import aiohttp
import uvloop
from common import ROOT, cpu_s, free_port

# name -> (script, flags)
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "aiohttp / json": ("aiohttp_server.py", ["--json", "stdlib"]),
    "aiohttp / msgspec": ("aiohttp_server.py", ["--json", "msgspec"]),
    "starlette+uvicorn h11 / json": ("starlette_server.py", ["--http", "h11", "--json", "stdlib"]),
    "starlette+uvicorn httptools / json": ("starlette_server.py", ["--json", "stdlib"]),
    "starlette+uvicorn httptools / orjson": ("starlette_server.py", ["--json", "orjson"]),
    "starlette+uvicorn httptools / msgspec": ("starlette_server.py", ["--json", "msgspec"]),
    "bare ASGI+uvicorn httptools / msgspec": ("asgi_server.py", ["--json", "msgspec"]),
}
SIM = ["--sim-fixed-ms", "0.5", "--sim-per-token-us", "0"]


class Server:
    def __init__(self, script: str, flags: list[str], profile: str | None = None) -> None:
        self.port = free_port()
        extra = ["--profile", profile] if profile else []
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / script), "--port", str(self.port),
             *SIM, *flags, *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"

    async def ready(self, session: aiohttp.ClientSession) -> None:
        for _ in range(600):
            if self.proc.poll() is not None:
                raise RuntimeError(f"server died: {self.proc.stderr.read().decode()}")  # type: ignore[union-attr]
            try:
                async with session.get(self.url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
        raise RuntimeError("server not ready")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Connection:
    """A bare keep-alive HTTP/1.1 connection: the cheapest client Python has, so the server,
    not the client, is what saturates (aiohttp's client costs more CPU than the servers)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: bytes
    ) -> None:
        self.reader, self.writer, self.path = reader, writer, path

    @classmethod
    async def open(cls, port: int, path: bytes = b"/prefill") -> Connection:
        return cls(*await asyncio.open_connection("127.0.0.1", port), path)

    async def post(self, body: bytes) -> bool:
        self.writer.write(
            b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (self.path, len(body), body)
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = -1
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        if length < 0:  # e.g. chunked: this client would lose its place in the stream
            raise RuntimeError(f"response without Content-Length: {head!r}")
        await self.reader.readexactly(length)
        return head.startswith(b"HTTP/1.1 200")

    def close(self) -> None:
        self.writer.close()


class Pool:
    """Idle connections, opened on demand: one per request in flight."""

    def __init__(self, port: int, path: bytes = b"/prefill") -> None:
        self.port, self.path = port, path
        self.idle: list[Connection] = []

    async def post(self, body: bytes) -> bool:
        conn = self.idle.pop() if self.idle else await Connection.open(self.port, self.path)
        ok = await conn.post(body)
        self.idle.append(conn)
        return ok

    def close(self) -> None:
        for conn in self.idle:
            conn.close()


async def bursty(
    pool: Pool, bodies: list[bytes], burst: int, interval: float, duration: float
) -> int:
    loop = asyncio.get_running_loop()
    tasks = []
    t0 = loop.time()
    k = 0
    while loop.time() - t0 < duration:
        tasks += [asyncio.ensure_future(pool.post(bodies[(k * burst + i) % len(bodies)]))
                  for i in range(burst)]  # fmt: skip
        k += 1
        await asyncio.sleep(max(0.0, t0 + k * interval - loop.time()))
    return sum(await asyncio.gather(*tasks))


async def saturated(pool: Pool, bodies: list[bytes], concurrency: int, duration: float) -> int:
    stop = asyncio.get_running_loop().time() + duration
    done = 0

    async def client(i: int) -> None:
        nonlocal done
        while asyncio.get_running_loop().time() < stop:
            ok = await pool.post(bodies[i % len(bodies)])
            done += ok  # not `done += await ...`: that reads `done` before the await
            i += concurrency

    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return done


async def measure(name: str, args: argparse.Namespace, bodies: list[bytes]) -> dict[str, float]:
    script, flags = VARIANTS[name]
    server = Server(script, flags)
    pool = Pool(server.port)
    try:
        async with aiohttp.ClientSession() as session:
            await server.ready(session)
        await saturated(pool, bodies, args.concurrency, 0.5)  # warm up, open the connections
        out: dict[str, float] = {}
        pid = server.proc.pid
        c0 = cpu_s(pid)
        n = await bursty(pool, bodies, args.burst, args.interval_ms / 1e3, args.duration)
        out["bursty_cpu_ms"] = (cpu_s(pid) - c0) * 1e3 / n
        c0, t0 = cpu_s(pid), time.monotonic()
        n = await saturated(pool, bodies, args.concurrency, args.duration)
        wall = time.monotonic() - t0
        out["sat_cpu_ms"] = (cpu_s(pid) - c0) * 1e3 / n
        out["sat_rps"] = n / wall
        out["sat_server_util"] = (cpu_s(pid) - c0) / wall
    finally:
        pool.close()
        server.stop()
    return out


async def profile(name: str, args: argparse.Namespace, bodies: list[bytes]) -> dict[str, float]:
    script, flags = VARIANTS[name]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "prof")
        server = Server(script, flags, profile=path)
        async with aiohttp.ClientSession() as session:
            await server.ready(session)
        pool = Pool(server.port)
        n = await bursty(pool, bodies, args.burst, args.interval_ms / 1e3, args.duration)
        pool.close()
        server.stop()
        by_group: dict[str, float] = defaultdict(float)
        for (file, _, func), row in pstats.Stats(path).stats.items():  # type: ignore[attr-defined]
            by_group[_group(file, func)] += row[2]  # tottime
    total = sum(by_group.values())
    return {g: t / total for g, t in by_group.items()} | {"_us_per_req": total / n * 1e6}


def _group(file: str, func: str) -> str:
    if "/examples/" in file:
        return "app code"
    if "aioprefill" in file:
        return "aioprefill engine"
    for key in ("aiohttp", "starlette", "uvicorn", "httptools", "h11", "prometheus"):
        if f"/{key}/" in file or f"{key}." in func:
            return key
    if "json" in file or "json" in func or "msgspec" in func or "orjson" in func:
        return "JSON"
    if any(k in file or k in func for k in ("asyncio", "uvloop", "_weakrefset", "selectors")):
        return "asyncio/uvloop"
    if file == "~":
        return "builtins"
    return "other"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=5.0, help="seconds per phase")
    p.add_argument("--burst", type=int, default=64)
    p.add_argument("--interval-ms", type=float, default=100.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    names = [n.strip() for n in args.variants.split(",")]
    rng = random.Random(0)
    bodies = [b'{"tokens": [%s]}' % b", ".join(b"%d" % rng.randrange(1, 32000) for _ in range(64))
              for _ in range(256)]  # fmt: skip
    print(f"bursts of {args.burst} every {args.interval_ms:g} ms "
          f"({args.burst * 1000 / args.interval_ms:.0f} req/s offered), then {args.concurrency} "
          f"concurrent; {args.duration:g} s per phase; {args.rounds} interleaved rounds; "
          f"{os.cpu_count()} CPUs", flush=True)  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = defaultdict(list)
    for r in range(args.rounds):
        for name in names:
            runs[name].append(uvloop.run(measure(name, args, bodies)))
            print(f"  round {r + 1}: {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    width = max(map(len, names))
    print(f"\n{'front':<{width}}  bursty CPU ms/req  saturated req/s  CPU ms/req  server CPU")
    for name in names:
        med = {k: statistics.median(run[k] for run in runs[name]) for k in runs[name][0]}
        print(f"{name:<{width}}  {med['bursty_cpu_ms']:17.3f}  {med['sat_rps']:15.0f}  "
              f"{med['sat_cpu_ms']:10.3f}  {100 * med['sat_server_util']:9.0f}%")  # fmt: skip
    if args.profile:
        print("\nwhere the server's event-loop thread spends its time (cProfile tottime, bursty):")
        for name in names:
            shares = uvloop.run(profile(name, args, bodies))
            us = shares.pop("_us_per_req")
            top = ", ".join(f"{g} {100 * s:.0f}%" for g, s in
                            sorted(shares.items(), key=lambda kv: -kv[1]) if s >= 0.02)  # fmt: skip
            print(f"{name:<{width}}  {us:6.0f} us/req profiled: {top}")


if __name__ == "__main__":
    main()
