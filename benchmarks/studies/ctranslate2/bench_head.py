"""The LM head over every position (prompt log-probabilities), alone: CPU seconds per row of
`paddle.logits.head_rows` (a vocabulary slice at a time) on tiles of R rows against slices of C
vocabulary rows, and of the rule before it (the whole row's logits per tile, then a float64-
accumulated log-softmax of a shifted copy), on SmolLM2's head shape (49152 x 576, random
weights), one thread, the product path of `--gemm` (`paddle.gemm.Products`). Best of `--repeats`.

    python benchmarks/studies/ctranslate2/bench_head.py [--gemm onednn,mkl] [--tiles 128,256,512]
        [--chunks 8192,49152] [--rows 2048]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: common.py


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gemm", default="onednn,mkl")
    parser.add_argument("--tiles", default="128,256,512")
    parser.add_argument("--chunks", default="8192,49152")
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from aioprefill.workers.paddle.env import configure_math_libraries, keep_freed_memory

    configure_math_libraries()
    import numpy as np
    import paddle

    keep_freed_memory()
    paddle.base.core.set_num_threads(1)
    from aioprefill.workers.paddle.gemm import Products
    from aioprefill.workers.paddle.logits import head_rows

    rng = np.random.default_rng(0)
    vocab, hidden, n = 49152, 576, args.rows
    w = paddle.to_tensor((rng.standard_normal((vocab, hidden)) * 0.05).astype(np.float32))
    x = paddle.to_tensor(rng.standard_normal((n, hidden)).astype(np.float32))
    targets = rng.integers(0, vocab, n).astype(np.int64)

    def before(h: paddle.Tensor, t: np.ndarray, product) -> None:  # the rule before (main)
        lg = np.from_dlpack(product(h, w))
        arg = np.argmax(lg, axis=-1)
        best = np.take_along_axis(lg, arg[:, None], axis=-1)[:, 0]
        shifted = np.exp(lg - best[:, None]).sum(-1, dtype=np.float64)
        _ = best.astype(np.float64) + np.log(shifted)
        _ = np.take_along_axis(lg, t[:, None], axis=-1)[:, 0].astype(np.float64)

    print(f"{n} rows, SmolLM2 head {vocab} x {hidden}, 1 thread; CPU us per row (best of "
          f"{args.repeats}), the product's share")  # fmt: skip
    for gemm in args.gemm.split(","):
        mm = Products("cpu", 1, None, gemm=gemm)
        for tile in (int(t) for t in args.tiles.split(",")):
            cases = [("before: whole rows, float64 sum", None)]
            cases += [(f"head_rows, slices of {c}", int(c)) for c in args.chunks.split(",")]
            for name, chunk in cases:
                best = float("inf")
                for _ in range(args.repeats):
                    t0 = time.process_time()
                    for lo in range(0, n, tile):
                        h, t = x[lo : lo + tile], targets[lo : lo + tile]
                        if chunk is None:
                            before(h, t, mm.product)
                        else:
                            head_rows(h, w, mm.product, 0, t, chunk=chunk)
                    best = min(best, time.process_time() - t0)
                flops = 2 * n * hidden * vocab / best / 1e9
                print(f"{gemm:6s} tiles of {tile:4d}  {name:32s} {1e6 * best / n:6.0f} us/row "
                      f"({flops:.0f} GFLOP/s overall)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
