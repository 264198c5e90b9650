"""A real SmolLM2 pair behind vllm-router round-robin, on a multi-turn chat: with the Mooncake
Store shared by both nodes against without it. Round-robin sends turn k of a conversation to
the other node than turn k-1, so without the store a node's own cache holds the conversation
only up to turn k-2; with it, turn k loads turn k-1's blocks, which the other node put.

Two `python -m aioprefill.serve --model SmolLM2.gguf` nodes (one worker, `--threads` threads
each, the default 1 GiB local cache, or `--local-cache-mb` MiB: the issue's "small local
budgets"), and for the store runs a fresh `mooncake_master` (from
the wheel) that both name with `--kv-store-master`; a fresh `vllm-router --policy round_robin`
in front. `--conversations` (odd, so that each conversation alternates nodes) chats of
`--turns` turns run turn by turn (turn k of every conversation, then turn k+1), one request
at a time, through `/v1/chat/completions` with `max_tokens` 1: a shared system prompt, then
per turn a user message of ~`--user-words` words and, after it, a fixed assistant reply of
~`--reply-words` words (deterministic text; a prefill node does not decode). Each node first
answers one unrelated warm-up prompt directly (not through the router).

Per turn (means over conversations): prompt tokens, tokens cached
(`usage.prompt_tokens_details.cached_tokens`: local hits and store loads), tokens computed,
and the client's time to the answer (TTFT: the router's hop included). Runs in the order
local, store, store, local (ABBA); the table shows the means.

    python benchmarks/studies/kvstore/bench_kvstore_chat.py [--conversations 3] [--turns 6] \
        [--threads 1] [--local-cache-mb 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: common.py
from bench_cluster import ROUTER, Proc
from common import free_port

from aioprefill.kvstore.master import LocalMaster

_TEXT = (
    "the a of to and in is it you that he was for on are with as I his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how said "
    "an each she which do their time if will way about many then them write would like so these "
    "her long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find any new work part "
    "take get place made live where after back little only round man year came show every good "
    "me give our under name very through just form sentence great think say help low line differ "
    "turn cause much mean before move right boy old too same tell does set three want air well "
    "also play small end put home read hand port large spell add even land here must big high "
    "such follow act why ask men change went light kind off need house picture try us again "
    "animal point mother world near build self earth father head stand own page should country "
    "found answer school grow study still learn plant cover food sun four between state keep eye"
)
WORDS = _TEXT.split()
SYSTEM = (
    "You are a careful assistant for a travel company. Answer in short paragraphs, cite the "
    "booking rules when they apply, never invent prices, and ask one clarifying question when "
    "the request is ambiguous. The booking rules: refunds within 24 hours of booking are free; "
    "changes later than 7 days before departure cost a fee; children under 2 travel free."
)


def text(seed: int, words: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), words)).capitalize() + "."


def conversations(args: argparse.Namespace) -> list[list[tuple[str, str]]]:
    """(user message, assistant reply) per turn, per conversation."""
    return [
        [
            (text(1000 * c + 2 * t, args.user_words), text(1000 * c + 2 * t + 1, args.reply_words))
            for t in range(args.turns)
        ]
        for c in range(args.conversations)
    ]


def start_node(stack: ExitStack, args: argparse.Namespace, master: str | None) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "aioprefill.serve", "--model", str(args.gguf),
            "--port", str(port), "--workers", "1", "--threads", str(args.threads),
            "--device", "cpu"]  # fmt: skip
    if master is not None:
        argv += ["--kv-store-master", master]
    if args.local_cache_mb is not None:
        argv += ["--prefix-cache-bytes", str(args.local_cache_mb << 20)]
    node = Proc(stack, argv, f"chat{port}")
    node.url = f"http://127.0.0.1:{port}"
    return node


def start_router(stack: ExitStack, nodes: list[Proc]) -> Proc:
    port = free_port()
    argv = [str(ROUTER), "--worker-urls", *[n.url for n in nodes], "--host", "127.0.0.1",
            "--port", str(port), "--policy", "round_robin", "--log-level", "warning",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # fmt: skip
    router = Proc(stack, argv, "router")
    router.url = f"http://127.0.0.1:{port}"
    router.wait_http(router.url)
    return router


def store_hits(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("aioprefill_prefix_cache_store_hits_total "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def run(args: argparse.Namespace, store: bool) -> dict:
    """One run: per turn, lists over conversations of (prompt, cached, ttft s)."""
    chats = conversations(args)
    with ExitStack() as stack:
        master = stack.enter_context(LocalMaster()).address if store else None
        nodes = [start_node(stack, args, master) for _ in range(2)]
        for n in nodes:
            n.wait_http(n.url)
        with httpx.Client(timeout=600) as c:
            for i, n in enumerate(nodes):  # warm-up, off the router
                warm = [{"role": "user", "content": text(999_999 - i, 60)}]
                body = {"model": "m", "messages": warm, "max_tokens": 1}
                c.post(n.url + "/v1/chat/completions", json=body).raise_for_status()
            router = start_router(stack, nodes)
            turns: list[list[tuple[int, int, float]]] = []
            history: list[list[dict]] = [[{"role": "system", "content": SYSTEM}] for _ in chats]
            for t in range(args.turns):
                row = []
                for k, chat in enumerate(chats):
                    user, reply = chat[t]
                    history[k].append({"role": "user", "content": user})
                    body = {"model": "m", "messages": history[k], "max_tokens": 1}
                    t0 = time.perf_counter()
                    r = c.post(router.url + "/v1/chat/completions", json=body)
                    ttft = time.perf_counter() - t0
                    r.raise_for_status()
                    usage = r.json()["usage"]
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    row.append((usage["prompt_tokens"], cached, ttft))
                    history[k].append({"role": "assistant", "content": reply})
                turns.append(row)
            loaded = sum(store_hits(n.url) for n in nodes)
    return {"turns": turns, "store_hit_tokens": loaded}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--user-words", type=int, default=40)
    ap.add_argument("--reply-words", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--local-cache-mb", type=int, default=None,
                    help="each node's prefix cache (default: the engine's 1 GiB)")  # fmt: skip
    args = ap.parse_args()
    if args.conversations % 2 == 0:
        raise SystemExit("--conversations must be odd (so that each one alternates nodes)")
    if args.gguf is None:
        from tests.hf.smollm2 import gguf_path

        args.gguf = gguf_path()
    runs: dict[str, list[dict]] = {"local": [], "store": []}
    for mode in ("local", "store", "store", "local"):
        runs[mode].append(run(args, mode == "store"))
        print(f"# {mode} run done", file=sys.stderr, flush=True)
    print(
        f"# bench_kvstore_chat: SmolLM2-135M (GGUF), 2 serve nodes x 1 worker x {args.threads} "
        f"thread(s) behind vllm-router round_robin; {args.conversations} conversations x "
        f"{args.turns} turns, turn by turn, one request at a time; means of local,store,store,"
        f"local; local cache {args.local_cache_mb or '1024 (default)'} MiB"
    )
    print(f"{'turn':>4} {'prompt':>7} | {'cached':>7} {'computed':>8} {'TTFT ms':>8} | "
          f"{'cached':>7} {'computed':>8} {'TTFT ms':>8}   (local | store)")  # fmt: skip
    totals = {m: [0.0, 0.0, 0.0, 0] for m in runs}  # prompt, cached, ttft sum, requests
    for t in range(args.turns):
        cols = []
        for mode, rs in runs.items():
            cells = [cell for r in rs for cell in r["turns"][t]]
            prompt = statistics.mean(p for p, _, _ in cells)
            cached = statistics.mean(h for _, h, _ in cells)
            ttft = statistics.mean(s for _, _, s in cells)
            tot = totals[mode]
            tot[0] += sum(p for p, _, _ in cells)
            tot[1] += sum(h for _, h, _ in cells)
            tot[2] += sum(s for _, _, s in cells)
            tot[3] += len(cells)
            cols.append(f"{cached:7.0f} {prompt - cached:8.0f} {1e3 * ttft:8.1f}")
        print(f"{t:>4} {prompt:7.0f} | {cols[0]} | {cols[1]}")
    (pl, hl, sl, nl), (ps, hs, ss, ns) = totals["local"], totals["store"]
    loaded = statistics.mean(r["store_hit_tokens"] for r in runs["store"])
    print(f"hit ratio: local {hl / pl:.3f}, store {hs / ps:.3f} (x{(hs / ps) / (hl / pl):.2f}; "
          f"{loaded:.0f} tokens a run loaded from the store)")  # fmt: skip
    print(f"tokens computed: store / local x{(ps - hs) / (pl - hl):.2f}; "
          f"TTFT mean: local {1e3 * sl / nl:.1f} ms, store {1e3 * ss / ns:.1f} ms "
          f"(x{(ss / ns) / (sl / nl):.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
