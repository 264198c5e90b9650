"""What a KV export costs a tensor-parallel group, against one worker doing the same.

The tiny Llama `PaddleModel(seed=0)` (4 layers, 4 KV heads of 32: 4 KiB of KV per token), one
CPU thread per rank, through the engine, one request at a time: for a lone worker and for a
group of 2 ranks (each writes its 2 KV heads of the segment; rank 0 creates it and one
all_reduce of one number tells rank 1 it may attach), the worker's forward time (rank 0's
timestamps) of a prompt with `return_kv=True` against the same prompt without, interleaved.
The export's extra cost in the group minus the lone worker's is what the group's ordering adds
(the collective and rank 1's attach). Closed exports' segments are reused, as in serving.

The collective alone, too: 2 spawned ranks of a gloo group time the export's all_reduce of one
number (`Shard.kv_share().agree`) and, for scale, the all_reduce of a 16-token batch's [16, 256]
partial sums that every layer runs twice.

Medians over `--repeats` rounds after one warm-up round; on a shared machine quote the
differences and ratios, each measured side by side in one run.

    python benchmarks/bench_tp_kv.py [--repeats 21] [--tokens 16,1024]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time

import numpy as np

from aioprefill import Engine, EngineConfig, PaddleModel
from aioprefill.workers.group import free_port

COLLECTIVE_CALLS = 2000


def _rank(rank: int, master: str, out: multiprocessing.Queue) -> None:
    import paddle

    from aioprefill.workers.collectives import PaddleGroup
    from aioprefill.workers.paddle.shard import Shard

    group = PaddleGroup(rank, 2, master)
    agree = Shard(PaddleModel(seed=0), group, "tp").kv_share().agree
    assert agree is not None
    layer = paddle.ones([16, 256], dtype="float32")
    times: dict[str, list[float]] = {"agree": [], "layer": []}
    for name, fn in (("agree", lambda: agree(True)), ("layer", lambda: group.all_reduce(layer))):
        for _ in range(COLLECTIVE_CALLS):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    group.close()
    if rank == 0:
        out.put({k: statistics.median(v) * 1e6 for k, v in times.items()})


def collective_us() -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    master, out = f"127.0.0.1:{free_port()}", ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, master, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=120)
    for p in procs:
        p.join(30)
    return result


async def forward_ms(tp_size: int, prompts: list[list[int]], repeats: int) -> dict[tuple, float]:
    """Median forward ms per (prompt length, return_kv)."""
    model = PaddleModel(seed=0, device="cpu", num_threads=1)
    config = EngineConfig(model=model, tp_size=tp_size, max_batch_tokens=8192)
    samples: dict[tuple, list[float]] = {}
    async with Engine(config) as engine:
        for rep in range(repeats + 1):
            for prompt in prompts:
                for kv in (False, True):
                    r = await engine.prefill(prompt, return_kv=kv)
                    if r.kv is not None:
                        r.kv.close()
                    if rep:  # the first round warms up (and makes the segments to reuse)
                        ms = (r.forward_end_ns - r.forward_start_ns) / 1e6
                        samples.setdefault((len(prompt), kv), []).append(ms)
    return {k: statistics.median(v) for k, v in samples.items()}


async def main(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in args.tokens.split(",")]
    prompts = [rng.integers(0, 32000, n).tolist() for n in lengths]
    results = {tp: await forward_ms(tp, prompts, args.repeats) for tp in (1, 2)}
    print(f"forward ms, medians of {args.repeats} rounds (plain / return_kv / extra)")
    for n in lengths:
        extra = {}
        for tp, t in results.items():
            plain, kv = t[(n, False)], t[(n, True)]
            extra[tp] = kv - plain
            print(f"  {n:5d} tokens, tp={tp}: {plain:8.3f} / {kv:8.3f} / {kv - plain:+7.3f}")
        print(f"  {n:5d} tokens: the group's export costs {extra[2] - extra[1]:+.3f} ms more")
    us = collective_us()
    print(f"gloo all_reduce, median of {COLLECTIVE_CALLS}: the export's one number", end=" ")
    print(f"{us['agree']:.1f} us,")
    print(f"  a layer's [16, 256] partial sums {us['layer']:.1f} us (2 per layer per forward)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--tokens", default="16,1024", help="prompt lengths, comma-separated")
    asyncio.run(main(parser.parse_args()))
