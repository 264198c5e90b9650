"""Embeddings through a server: all-MiniLM-L6-v2 behind `python -m aioprefill.serve` against
the servers a user would run instead on a CPU (vLLM's CPU build, Infinity), the same sentences
over the same OpenAI `/v1/embeddings` route at the same client concurrency, on the same cores.

    python benchmarks/bench_embeddings_server.py [--sentences 1000] [--rounds 2] \
        [--concurrency 16] [--per-request 8,1] [--servers aioprefill,vllm,infinity] \
        [--aio-layouts 2x1,1x2] [--cores 0,1] [--lock FILE] \
        [--out benchmarks/results/serve/embeddings_servers.txt]

The sentences are bench_embeddings.py's (seeded, 8 to 256 tokens as MiniLM's tokenizer counts
them), so the two benchmarks' workloads match. Every server is started on the cores of
`--cores` (`taskset`; vLLM's OpenMP threads bound there too with VLLM_CPU_OMP_THREADS_BIND,
torch's threads in Infinity follow the affinity), one after another, each with a bounded
start-up timeout, and each killed by its process group at the end, also on failure:

- `aioprefill`: `python -m aioprefill.serve --model DIR --workers W --threads T --dtype float32`
  for each layout of `--aio-layouts` (W x T == number of cores);
- `vllm`: vllm-cpu's OpenAI server from its venv (`--vllm-python`, default
  ~/.cache/aioprefill/vllm-venv, built by tests/vllm/vllmvenv.py) with `--runner pooling
  --dtype float32` (it reads the directory's modules.json: mean pooling + Normalize; its CPU
  attention backend runs encoder-only attention; each request carries `truncate_prompt_tokens`
  = the model's max_seq_length, 256, without which vLLM refuses the sentences past it);
- `infinity`: `infinity_emb v2 --engine torch --device cpu --dtype float32 --url-prefix /v1`
  from its own venv (`--infinity-python`, default ~/.cache/aioprefill/infinity-venv, built by
  `bash benchmarks/tools/make_infinity_venv.sh`: infinity-emb 0.0.78 on torch's CPU wheel).

A server that cannot start within `--start-timeout` is reported and left out; the others run.
All servers stay up while the passes run, but only one is sent requests at a time (the idle
ones' CPU during each pass is measured and reported: it should be ~0). The client (this
process, aiohttp, uvloop) sends the 1,000 sentences as requests of K sentences (each K of
`--per-request`; K=1 is one sentence per request), `--concurrency` requests in flight, with
`encoding_format` base64 (the official openai client's default; `--encoding float` for JSON
floats). Each round is A B B A over the servers, for each K, under `--lock` (flock) when given: the
lock is held for one K of one round at a time (the first round also warms every server at that
K there), never during start-ups. Reported per server and K:
median wall seconds, sentences/s, the ratio to aioprefill's first layout, and the CPU seconds
of the server's process tree (every thread) and of the client. The embeddings every server
returned are compared with aioprefill's (cosine, per sentence): the comparison is of the same
work only if they agree (>= 0.9999).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import uvloop
from bench_embeddings import make_sentences
from common import ROOT, free_port, locked, tree_cpu_s

from aioprefill import PaddleModel, Tokenizer
from aioprefill.text.encoder_text import EncoderText
from tests.encoder_models import minilm_dir
from tests.vllm.nodes import Node

NAME = "minilm"
VLLM_PYTHON = Path.home() / ".cache" / "aioprefill" / "vllm-venv" / "bin" / "python"
INFINITY_PYTHON = Path.home() / ".cache" / "aioprefill" / "infinity-venv" / "bin" / "python"


def cpu_line() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def start(kind: str, layout: str, args: argparse.Namespace) -> Node:
    """Start one server on `args.cores` (not waiting for it)."""
    port, model = free_port(), str(minilm_dir())
    pin = ["taskset", "-c", args.cores]
    env = dict(os.environ)
    if kind == "aioprefill":
        w, t = layout.split("x")
        cmd = [sys.executable, "-m", "aioprefill.serve", "--model", model,
               "--served-model-name", NAME, "--host", "127.0.0.1", "--port", str(port),
               "--workers", w, "--threads", t, "--dtype", "float32"]  # fmt: skip
        env["PYTHONPATH"] = str(ROOT)
    elif kind == "vllm":
        cmd = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server",
               "--model", model, "--served-model-name", NAME, "--host", "127.0.0.1",
               "--port", str(port), "--runner", "pooling", "--dtype", "float32"]  # fmt: skip
        env |= {
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": _range(args.cores),
        }
    elif kind == "infinity":
        exe = Path(args.infinity_python).parent / "infinity_emb"
        cmd = [str(exe), "v2", "--model-id", model, "--served-model-name", NAME,
               "--host", "127.0.0.1", "--port", str(port), "--engine", "torch",
               "--device", "cpu", "--dtype", "float32", "--url-prefix", "/v1",
               "--batch-size", str(args.infinity_batch)]  # fmt: skip
        env |= {"INFINITY_ANONYMOUS_USAGE_STATS": "0", "DO_NOT_TRACK": "1"}
    else:
        raise SystemExit(f"unknown server {kind!r}")
    if kind != "aioprefill":  # no hub lookups (none reachable here: they wait for a timeout)
        env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return Node([*pin, *cmd], env, f"http://127.0.0.1:{port}", f"{kind}-{layout}")


def _range(cores: str) -> str:
    """`0,1` -> `0-1` (VLLM_CPU_OMP_THREADS_BIND takes ranges and lists)."""
    ids = [int(c) for c in cores.split(",")]
    if ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return cores


def decode(item: dict) -> np.ndarray:
    e = item["embedding"]
    if isinstance(e, str):
        return np.frombuffer(base64.b64decode(e), "<f4")
    return np.asarray(e, np.float32)


async def run_pass(
    session: aiohttp.ClientSession, url: str, sentences: list[str], per: int, conc: int,
    encoding: str, extra: dict,
) -> tuple[float, np.ndarray]:  # fmt: skip
    """Send every sentence, `per` to a request, `conc` requests in flight: (wall s, vectors)."""
    chunks = [sentences[i : i + per] for i in range(0, len(sentences), per)]
    out: list[np.ndarray | None] = [None] * len(chunks)
    sem = asyncio.Semaphore(conc)

    async def one(i: int) -> None:
        body = {"model": NAME, "input": chunks[i], "encoding_format": encoding, **extra}
        async with sem, session.post(url + "/v1/embeddings", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:500]}")
            data = (await r.json())["data"]
        data.sort(key=lambda d: d["index"])
        out[i] = np.stack([decode(d) for d in data])

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(len(chunks))))
    return time.perf_counter() - t0, np.concatenate(out)  # type: ignore[arg-type]


def client_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument("--per-request", default="8,1", help="sentences per request, comma list")
    p.add_argument("--servers", default="aioprefill,vllm,infinity")
    p.add_argument("--aio-layouts", default="2x1", help="aioprefill workers x threads, comma list")
    p.add_argument("--cores", default="0,1", help="taskset cores of every server")
    p.add_argument("--encoding", choices=["base64", "float"], default="base64")
    p.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    p.add_argument("--infinity-python", type=Path, default=INFINITY_PYTHON)
    p.add_argument("--infinity-batch", type=int, default=32, help="its --batch-size")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds, per server")
    p.add_argument("--warm", type=int, default=128, help="sentences of the warm-up pass")
    p.add_argument("--lock", default=None, help="flock this file around each round")
    p.add_argument("--min-cosine", type=float, default=0.9999)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    pers = [int(k) for k in args.per_request.split(",")]
    n_cores = len(args.cores.split(","))

    spec = PaddleModel.from_pretrained(minilm_dir())
    text = EncoderText.for_model(Tokenizer.from_pretrained(minilm_dir()), spec)
    sentences = make_sentences(args.sentences, text)
    lengths = [len(x) for x in text.encode_batch(sentences)]
    lines = [
        f"# {' '.join(sys.argv)}",
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}: "
        f"{cpu_line()}, {os.cpu_count()} CPUs, servers on cores {args.cores}; load "
        f"{os.getloadavg()[0]:.1f} at start",
        f"# commit {_git_head()}; {len(sentences)} sentences, {sum(lengths)} tokens "
        f"({min(lengths)}..{max(lengths)}, mean {statistics.mean(lengths):.0f}); client: "
        f"{args.concurrency} requests in flight, {' or '.join(map(str, pers))} sentences per "
        f"request, encoding_format {args.encoding}",
    ]

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)
        if args.out:  # as it goes: a run cut short keeps what it measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text("\n".join(lines) + "\n")

    for line in lines:
        print(line, flush=True)

    wanted: list[tuple[str, str]] = []
    for kind in args.servers.split(","):
        if kind == "aioprefill":
            for lay in args.aio_layouts.split(","):
                w, t = (int(v) for v in lay.split("x"))
                assert w * t == n_cores, f"layout {lay} does not use the {n_cores} cores"
                wanted.append((kind, lay))
        else:
            wanted.append((kind, "default"))

    nodes: dict[str, Node] = {}
    try:
        for kind, lay in wanted:  # one at a time: start-ups compete for the same cores
            name = f"{kind}_{lay}" if kind == "aioprefill" else kind
            t0 = time.monotonic()
            try:
                node = start(kind, lay, args)
            except FileNotFoundError as e:
                say(f"# {name}: left out, cannot start: {e}")
                continue
            try:
                node.wait_ready(args.start_timeout)
            except AssertionError as e:
                say(f"# {name}: left out, not ready: {str(e).splitlines()[0]}")
                tail = "\n".join(f"#   {x}" for x in node.output(1500).splitlines()[-12:])
                say(tail)
                node.stop(10)
                continue
            nodes[name] = node
            say(f"# {name}: ready in {time.monotonic() - t0:.0f} s ({' '.join(node.proc.args)})")
        if not nodes:
            raise SystemExit("no server started")
        uvloop.run(measure(nodes, sentences, pers, args, say))
    finally:
        for node in nodes.values():
            node.stop(30)


async def measure(nodes: dict[str, Node], sentences, pers, args, say) -> None:
    names = list(nodes)
    # vLLM refuses a prompt past max_seq_length (256) with a 400 unless told to truncate (on the
    # right for a pooling model, as sentence-transformers does); aioprefill and Infinity truncate
    st_config = json.loads((minilm_dir() / "sentence_bert_config.json").read_text())
    max_seq = st_config["max_seq_length"]
    extra = {n: {"truncate_prompt_tokens": max_seq} if n == "vllm" else {} for n in names}
    times: dict[tuple[str, int], list[float]] = {(n, k): [] for n in names for k in pers}
    srv_cpu: dict[tuple[str, int], list[float]] = {key: [] for key in times}
    cli_cpu: dict[tuple[str, int], list[float]] = {key: [] for key in times}
    vectors: dict[tuple[str, int], np.ndarray] = {}
    idle_max = 0.0
    timeout = aiohttp.ClientTimeout(total=3600)
    conn = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        longest = sorted(sentences, key=len)[-4:]  # every server takes them, before any lock
        for name in names:
            await run_pass(session, nodes[name].url, longest, 4, 1, args.encoding, extra[name])
        for r in range(args.rounds):
            for k in pers:
                with locked(args.lock):
                    if r == 0:  # warm each server at this shape
                        for name in names:
                            await run_pass(
                                session,
                                nodes[name].url,
                                sentences[: args.warm],
                                k,
                                args.concurrency,
                                args.encoding,
                                extra[name],
                            )
                    say(f"# round {r}, K={k}: load {os.getloadavg()[0]:.1f} at its start")
                    for name in [*names, *reversed(names)]:
                        pid = nodes[name].proc.pid
                        others = {o: tree_cpu_s(nodes[o].proc.pid) for o in names if o != name}
                        c0, cc0 = tree_cpu_s(pid), client_cpu()
                        wall, vec = await run_pass(
                            session,
                            nodes[name].url,
                            sentences,
                            k,
                            args.concurrency,
                            args.encoding,
                            extra[name],
                        )
                        cpu, ccpu = tree_cpu_s(pid) - c0, client_cpu() - cc0
                        idle = max(
                            (tree_cpu_s(nodes[o].proc.pid) - c for o, c in others.items()),
                            default=0.0,
                        )
                        idle_max = max(idle_max, idle)
                        times[name, k].append(wall)
                        srv_cpu[name, k].append(cpu)
                        cli_cpu[name, k].append(ccpu)
                        vectors[name, k] = vec
                        say(
                            f"round {r} K={k} {name}: {wall:6.2f} s "
                            f"{len(sentences) / wall:6.1f} sentences/s, server {cpu:5.1f} "
                            f"CPU-s, client {ccpu:4.1f} CPU-s, idle servers {idle:.2f} CPU-s"
                        )
                    if r == 0:  # same work? (said at once: a run cut short keeps it)
                        agreement(vectors, names, k, args.min_cosine, say)
    say(f"# the idle servers used at most {idle_max:.2f} CPU-s during another's pass")
    ref_name = names[0]
    say(
        "# medians over the rounds: wall seconds, sentences/s and the ratio to "
        f"{ref_name}; CPU seconds of the server's processes (all threads) and of the client"
    )
    n = len(sentences)
    for k in pers:
        base = statistics.median(times[ref_name, k])
        for name in names:
            med = statistics.median(times[name, k])
            cpu = statistics.median(srv_cpu[name, k])
            say(
                f"K={k:<3} {name:>16}: {med:7.2f} s {n / med:7.1f} sentences/s "
                f"x{base / med:.2f} | server {cpu:6.1f} CPU-s {n / cpu:6.1f} sentences/CPU-s | "
                f"client {statistics.median(cli_cpu[name, k]):4.1f} CPU-s"
            )


def agreement(vectors: dict, names: list[str], k: int, min_cosine: float, say) -> None:
    """Each server's vectors against the first's, per sentence."""
    ref = vectors[names[0], k]
    for name in names[1:]:
        v = vectors[name, k]
        cos = (v * ref).sum(1) / np.linalg.norm(v, axis=1) / np.linalg.norm(ref, axis=1)
        ok = "ok" if cos.min() >= min_cosine else f"BELOW {min_cosine}"
        say(
            f"# K={k} {name} vs {names[0]}: min cosine {cos.min():.7f} ({ok}), max |d| "
            f"{np.abs(v - ref).max():.1e}"
        )


def _git_head() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)  # fmt: skip
        return out.stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


if __name__ == "__main__":
    main()
