"""How a burst is spread over data-parallel workers: policy `forward` (each worker free takes
its fair share, `aioprefill/sched/policies/share.py`) against `forward-greedy` (the worker
free first takes everything waiting), on SimModel workers (sleeps: the machine's load moves it
little).

The burst is the real12 prompt lengths of `bench_vs_ctranslate2.py` (12 to 900 tokens, 3,356 in
all) submitted at once; it prints each policy's wall time per round and which worker ran which
tokens.

    python benchmarks/studies/ctranslate2/bench_burst_split.py [--workers 2] [--fixed-ms 5] \
        [--per-token-us 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter

from aioprefill import Engine, EngineConfig, SimModel

LENGTHS = (12, 24, 40, 64, 96, 140, 200, 280, 380, 520, 700, 900)


async def run(policy: str, args: argparse.Namespace) -> None:
    model = SimModel(fixed_ms=args.fixed_ms, per_token_us=args.per_token_us)
    config = EngineConfig(
        model=model, num_workers=args.workers, policy=policy, prefix_cache_bytes=0
    )
    async with Engine(config) as engine:
        await engine.prefill([1] * 280)
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *(engine.prefill([i + 1] * n) for i, n in enumerate(LENGTHS))
            )
            wall = time.perf_counter() - t0
            tokens: Counter[int] = Counter()
            for r in results:
                tokens[r.worker] += r.num_tokens
            print(f"{policy:15} {wall:6.2f} s  tokens per worker {dict(sorted(tokens.items()))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--fixed-ms", type=float, default=5.0)
    parser.add_argument("--per-token-us", type=float, default=1000.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for policy in ("forward", "forward-greedy"):
        asyncio.run(run(policy, args))


if __name__ == "__main__":
    main()
