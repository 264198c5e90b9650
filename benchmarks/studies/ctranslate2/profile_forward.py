"""Where a SmolLM2 forward's CPU time goes, runner level (no engine): the linear layers
(`_linear`: o, gate/up, down), the q/k/v projection (`_project`), attention (`attend`) and the
head (`_head`: final norm, LM head, log-softmax), the rest being norms, RoPE, SwiGLU and copies.
Each part is timed with `time.process_time()` around its calls (CPU time: less disturbed by a
shared machine than wall time), summed over `--repeats` forwards of one packed batch of N
prompts of L random ids, after a warm-up. Run it once per product path to compare:

    AIOPREFILL_CPU_GEMM=mkl python benchmarks/studies/ctranslate2/profile_forward.py [--threads 1] \
        [--batch 8x280]
    AIOPREFILL_CPU_GEMM=onednn python benchmarks/studies/ctranslate2/profile_forward.py [--scores]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: common.py


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", default="8x280", help="N prompts x L tokens")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--scores", action="store_true", help="ask for prompt logprobs")
    parser.add_argument("--lengths", help="prompt lengths, comma-separated (instead of --batch)")
    args = parser.parse_args()
    from bench_paddle_model import make_batch

    from aioprefill.models import PaddleModel
    from aioprefill.wire import protocol
    from aioprefill.workers.paddle import runner as paddle_runner
    from aioprefill.workers.paddle.env import library_versions
    from tests.hf.smollm2 import gguf_path

    n, length = (int(x) for x in args.batch.split("x"))
    spec = PaddleModel.from_pretrained(gguf_path(), device="cpu", num_threads=args.threads)
    runner = paddle_runner.PaddleRunner(spec)
    spent: collections.Counter[str] = collections.Counter()

    def timed(owner: Any, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.process_time()
            try:
                return inner(*a, **k)
            finally:
                spent[part] += time.process_time() - t0

        setattr(owner, name, wrapper)

    timed(runner, "_linear", "linear (o, gate_up, down)")
    timed(runner, "_project", "q/k/v projection")
    timed(paddle_runner, "attend", "attention")
    timed(runner, "_outputs", "head")
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else [length] * n
    n, batch = len(lengths), make_batch(lengths, np.random.default_rng(0), spec.vocab_size)
    if args.scores:
        batch = dataclasses.replace(
            batch, options=np.full(n, protocol.OPT_PROMPT_LOGPROBS, np.uint8)
        )
    runner.forward(batch)
    spent.clear()
    t0 = time.process_time()
    for _ in range(args.repeats):
        runner.forward(batch)
    total = (time.process_time() - t0) / args.repeats
    print(f"$ python benchmarks/studies/ctranslate2/profile_forward.py {' '.join(sys.argv[1:])}")
    print(f"{library_versions()}; uses oneDNN: {runner._mm.uses_onednn}")
    print(
        f"{args.lengths or args.batch}, {args.threads} thread(s): {total:.2f} CPU-s per forward, "
        f"{sum(lengths) / total:.0f} tokens per CPU-second"
    )
    for part, t in [*spent.most_common(), ("rest", total * args.repeats - sum(spent.values()))]:
        print(f"  {part:28} {t / args.repeats:6.2f} s  {100 * t / args.repeats / total:5.1f}%")


if __name__ == "__main__":
    main()
