"""A/B of a SmolLM2 forward between two checkouts, runner level, alternating processes.

Each round runs one child process per checkout (A, then B; the order flips every round), each
importing `aioprefill` from its own tree: it builds `PaddleRunner` on the shipped SmolLM2-135M
GGUF (float32, or `--dtype bfloat16`; `--threads` threads), runs one warm-up forward of
`--batch` (N prompts x L random ids) and then `--repeats` forwards, and reports the process's
CPU time and wall time.
Prints per checkout the median tokens per CPU-second over the rounds, each round's figures, and
B / A. With `--scores` every prompt asks for its prompt logprobs (the LM head over every
position). CPU time is the figure to read on a shared machine.

    python benchmarks/studies/ctranslate2/bench_forward_ab.py --a /path/to/main --b . [--rounds 5] \
        [--batch 8x280]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: common.py
from common import ROOT


def child(args: argparse.Namespace) -> None:
    """Runs in the checkout under test (its tree first on sys.path)."""
    import numpy as np

    from aioprefill.models import PaddleModel
    from aioprefill.wire import protocol
    from aioprefill.workers.paddle import runner as paddle_runner
    from aioprefill.workers.runner import ForwardBatch
    from tests.hf.smollm2 import gguf_path

    n, length = (int(x) for x in args.batch.split("x"))
    spec = PaddleModel.from_pretrained(
        gguf_path(), device="cpu", num_threads=args.threads, dtype=args.dtype
    )
    runner = paddle_runner.PaddleRunner(spec)
    rng = np.random.default_rng(0)
    offsets = np.arange(n + 1, dtype=np.int32) * length
    batch = ForwardBatch(
        request_ids=np.arange(n, dtype=np.int64),
        offsets=offsets,
        tokens=rng.integers(0, spec.vocab_size, n * length).astype(np.int32),
        start_pos=np.zeros(n, dtype=np.int32),
        is_last=np.ones(n, dtype=bool),
    )
    if args.scores:
        opts = np.full(n, protocol.OPT_PROMPT_LOGPROBS, np.uint8)
        batch = dataclasses.replace(batch, options=opts)
    runner.forward(batch)
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(args.repeats):
        runner.forward(batch)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(json.dumps({"cpu_s": cpu, "wall_s": wall, "tokens": n * length * args.repeats}))


def run_child(tree: str, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", tree]
    cmd += ["--batch", args.batch, "--threads", str(args.threads), "--repeats", str(args.repeats)]
    cmd += ["--scores"] if args.scores else []
    cmd += ["--dtype", args.dtype]
    env = dict(os.environ, PYTHONPATH=tree)
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=tree)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", help="checkout A (the baseline)")
    parser.add_argument("--b", default=str(ROOT), help="checkout B (default: this one)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", default="8x280", help="N prompts x L tokens")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per child")
    parser.add_argument("--scores", action="store_true", help="ask for prompt logprobs")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, args.child)
        child(args)
        return
    if not args.a:
        parser.error("--a is required")
    trees = {"A": str(Path(args.a).resolve()), "B": str(Path(args.b).resolve())}
    rates: dict[str, list[float]] = {"A": [], "B": []}
    print(f"$ python benchmarks/studies/ctranslate2/bench_forward_ab.py {' '.join(sys.argv[1:])}")
    print(f"A = {trees['A']}\nB = {trees['B']}")
    print(f"{args.batch}, {args.threads} thread(s), scores={args.scores}, {args.repeats} forwards")
    for r in range(args.rounds):
        order = ("A", "B") if r % 2 == 0 else ("B", "A")
        for side in order:
            res = run_child(trees[side], args)
            rate = res["tokens"] / res["cpu_s"]
            rates[side].append(rate)
            print(
                f"round {r} {side}: {rate:6.0f} tok/CPU-s  {res['tokens'] / res['wall_s']:6.0f} "
                f"tok/s  (load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    med = {side: statistics.median(v) for side, v in rates.items()}
    print(f"median tok/CPU-s: A {med['A']:.0f}, B {med['B']:.0f}, B/A {med['B'] / med['A']:.3f}")


if __name__ == "__main__":
    main()
