"""Where the fused encoder forward's CPU time goes (all-MiniLM-L6-v2, `EncoderRunner` in this
process, 1 thread): 300 prompts of 8-256 random ids (seeded), packed into batches of at most
8,192 tokens as the engine packs them, after two warm batches; the thread time of
`FusedEncoder._product` (the sgemm products), `_attend` (attention), `fused.bias_` (the
epilogues: bias, GELU, residual) and `fused.layer_norm_`, and the rest. Repeated `--repeats`
times; the median total is the figure to compare.

`--lengths LO-HI` and `--prompts N` draw other prompts (short texts: `--lengths 8-48 --prompts
1000`). `--compare` runs every repeat twice, alternating: attention with every prompt on the
per-head sgemm path (`fused.SHORT_PROMPT = 0`, the forward before short prompts had their
batched path) and as shipped; printed side by side with each one's median and the ratio.

    OMP_NUM_THREADS=1 python benchmarks/studies/encoder/profile_forward.py [--repeats 3]
        [--lengths 8-256] [--prompts 300] [--compare]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: common.py
import common  # noqa: F401  (the repository on sys.path)

import aioprefill.workers.paddle.encoder_fused as ef
import aioprefill.workers.paddle.fused as fused
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
    p.add_argument("--lengths", default="8-256", help="LO-HI tokens a prompt (uniform)")
    p.add_argument("--prompts", type=int, default=300)
    p.add_argument("--compare", action="store_true", help="per-head attention vs as shipped")
    args = p.parse_args()
    lo, hi = (int(x) for x in args.lengths.split("-"))
    runner = EncoderRunner(PaddleModel.from_pretrained(minilm_dir()))
    rng = np.random.default_rng(0)
    prompts = [
        rng.integers(1000, 30000, n).astype(np.int32)
        for n in rng.integers(lo, hi + 1, args.prompts)
    ]
    batches: list[list[np.ndarray]] = [[]]
    for x in prompts:
        if sum(len(y) for y in batches[-1]) + len(x) > 8192:
            batches.append([])
        batches[-1].append(x)
    timed(ef.FusedEncoder, "_product", "products")
    timed(ef.FusedEncoder, "_attend", "attention")
    timed(ef, "bias_", "epilogues")
    timed(ef, "layer_norm_", "layernorm")
    shipped = fused.SHORT_PROMPT
    modes = {"per-head": 0, "shipped": shipped} if args.compare else {"shipped": shipped}
    for limit in modes.values():  # warm: every primitive made, the buffers grown
        fused.SHORT_PROMPT = limit
        for b in batches[:2]:
            runner_embeddings(runner, b)
    totals: dict[str, list[float]] = {m: [] for m in modes}
    parts: dict[str, list[float]] = {m: [] for m in modes}
    print(
        f"# {len(prompts)} prompts of {args.lengths} tokens, {sum(map(len, prompts))} tokens, "
        f"{len(batches)} batches; fused.SHORT_PROMPT {shipped}; load {os.getloadavg()[0]:.1f}"
    )
    for _ in range(args.repeats):
        for mode, limit in modes.items():
            fused.SHORT_PROMPT = limit
            TIMES.clear()
            t = time.thread_time()
            for b in batches:
                runner_embeddings(runner, b)
            total = time.thread_time() - t
            totals[mode].append(total)
            parts[mode].append(TIMES["attention"])
            split = " ".join(f"{k} {v:.2f}" for k, v in TIMES.most_common())
            other = total - sum(TIMES.values())
            print(f"{mode:8s} total {total:.2f} CPU-s: {split} other {other:.2f}")
    fused.SHORT_PROMPT = shipped
    for mode in modes:
        med, att = statistics.median(totals[mode]), statistics.median(parts[mode])
        print(f"{mode:8s} median total {med:.2f} CPU-s (attention {att:.2f})")
    if args.compare:
        a, b = (statistics.median(totals[m]) for m in ("per-head", "shipped"))
        print(f"shipped / per-head: x{b / a:.3f} the forward's CPU time ({a / b:.3f}x faster)")


if __name__ == "__main__":
    main()
