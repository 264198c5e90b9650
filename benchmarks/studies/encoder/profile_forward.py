"""Where the fused encoder forward's CPU time goes (all-MiniLM-L6-v2, `EncoderRunner` in this
process, 1 thread): 300 prompts of 8-256 random ids (seeded), packed into batches of at most
8,192 tokens as the engine packs them, after two warm batches; the thread time of
`FusedEncoder._product` (the sgemm products), `_attend` (attention), `fused.bias_` (the
epilogues: bias, GELU, residual) and `fused.layer_norm_`, and the rest. Repeated `--repeats`
times; the median total is the figure to compare.

    OMP_NUM_THREADS=1 python benchmarks/studies/encoder/profile_forward.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: common.py
import common  # noqa: F401  (the repository on sys.path)

import aioprefill.workers.paddle.encoder_fused as ef
from aioprefill import PaddleModel
from aioprefill.workers.paddle.encoder import EncoderRunner
from tests.encoder_models import minilm_dir, runner_embeddings

TIMES: collections.Counter[str] = collections.Counter()


def timed(owner: object, name: str, key: str) -> None:
    """Wraps owner.name so its thread time adds up under `key`."""
    f = getattr(owner, name)

    def g(*a: object, **k: object) -> object:
        t = time.thread_time()
        out = f(*a, **k)
        TIMES[key] += time.thread_time() - t
        return out

    setattr(owner, name, g)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    runner = EncoderRunner(PaddleModel.from_pretrained(minilm_dir()))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1000, 30000, n).astype(np.int32) for n in rng.integers(8, 257, 300)]
    batches: list[list[np.ndarray]] = [[]]
    for x in prompts:
        if sum(len(y) for y in batches[-1]) + len(x) > 8192:
            batches.append([])
        batches[-1].append(x)
    timed(ef.FusedEncoder, "_product", "products")
    timed(ef.FusedEncoder, "_attend", "attention")
    timed(ef, "bias_", "epilogues")
    timed(ef, "layer_norm_", "layernorm")
    for b in batches[:2]:
        runner_embeddings(runner, b)
    totals = []
    print(f"# {len(prompts)} prompts, {sum(map(len, prompts))} tokens, {len(batches)} batches")
    for _ in range(args.repeats):
        TIMES.clear()
        t = time.thread_time()
        for b in batches:
            runner_embeddings(runner, b)
        total = time.thread_time() - t
        totals.append(total)
        parts = " ".join(f"{k} {v:.2f}" for k, v in TIMES.most_common())
        print(f"total {total:.2f} CPU-s: {parts} other {total - sum(TIMES.values()):.2f}")
    print(f"median total {statistics.median(totals):.2f} CPU-s")


if __name__ == "__main__":
    main()
