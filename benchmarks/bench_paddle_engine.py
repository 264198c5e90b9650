"""Batching benefit of the real Paddle model through the whole engine, forward vs eager.

For 16- and 128-token prompts: 64 concurrent requests into an engine with one 1-thread
`PaddleModel(seed=0)` worker, policy `forward` (batches what arrives during a forward) versus
`eager` (one request per forward), both engines alive in the same run and measured alternately.
Reports requests/s and the forward/eager throughput ratio (median over repeats), plus engine
start-to-ready time (first start pays the forkserver's paddle import; later ones fork from it).

    python benchmarks/bench_paddle_engine.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np
import uvloop

from aioprefill import Engine, EngineConfig, PaddleModel


async def burst(engine: Engine, prompts: list[np.ndarray]) -> float:
    t0 = time.perf_counter()
    await asyncio.gather(*(engine.prefill(p) for p in prompts))
    return len(prompts) / (time.perf_counter() - t0)


async def main(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    model = PaddleModel(seed=0)
    starts = []
    engines = {}
    for policy in ("forward", "eager"):
        t0 = time.perf_counter()
        engine = Engine(EngineConfig(model=model, policy=policy))
        await engine.start()
        starts.append(time.perf_counter() - t0)
        engines[policy] = engine
    print(
        f"engine start to ready (1 worker): first {starts[0]:.2f} s (forkserver imports paddle), "
        f"second {starts[1]:.2f} s (fork from the preloaded forkserver)\n"
    )
    print("| prompt tokens | forward req/s | eager req/s | forward / eager (median of ratios) |")
    print("| --- | --- | --- | --- |")
    try:
        for length in (16, 128):
            prompts = [rng.integers(0, 32000, length) for _ in range(64)]
            for engine in engines.values():
                await burst(engine, prompts)  # warm-up
            rates: dict[str, list[float]] = {p: [] for p in engines}
            for _ in range(args.repeats):
                for policy, engine in engines.items():
                    rates[policy].append(await burst(engine, prompts))
            ratios = [f / e for f, e in zip(rates["forward"], rates["eager"], strict=True)]
            print(
                f"| {length} | {statistics.median(rates['forward']):.0f} | "
                f"{statistics.median(rates['eager']):.0f} | {statistics.median(ratios):.2f}x "
                f"({', '.join(f'{r:.2f}' for r in ratios)}) |"
            )
    finally:
        for engine in engines.values():
            await engine.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    uvloop.run(main(parser.parse_args()))
