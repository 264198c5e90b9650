"""q/k/v of a bfloat16 CPU worker: every head in one oneDNN matmul primitive
(`paddle.onednn.heads_product`, what `Products.project` runs) against one
`dnnl_gemm_bf16bf16f32` call per head per 256-row block (what it ran before, and still runs for
tiles and bf16x2), on SmolLM2-135M's shapes (hidden 576, 9 + 3 + 3 heads of 64), 1 thread, CPU
time, best of `--repeats`; then whether a row keeps its bits at every row count tried.

    OMP_NUM_THREADS=1 python benchmarks/studies/bf16/bench_heads_product.py [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
K, DIM, HEADS = 576, 64, 15
BLOCK = 256


def bf16_bits(a: np.ndarray) -> np.ndarray:
    u = a.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def best(f, repeats: int) -> float:
    f()
    times = []
    for _ in range(repeats):
        t = time.process_time()
        f()
        times.append(time.process_time() - t)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    import paddle  # noqa: F401  (loads the wheel's oneDNN)

    from aioprefill.workers.paddle.onednn import heads_product as _heads_product
    from aioprefill.workers.paddle.onednn import load_gemm_bf16, set_openmp_threads

    set_openmp_threads(args.threads)
    gemm = load_gemm_bf16()
    rng = np.random.default_rng(0)
    w = bf16_bits(rng.standard_normal((HEADS, K, DIM)) * 0.05)
    x_all = bf16_bits(rng.standard_normal((2240, K)))

    def per_head(x: np.ndarray) -> np.ndarray:
        rows = x.shape[0]
        c = np.empty((HEADS, rows, DIM), np.float32)
        for lo in range(0, rows, BLOCK):
            m = min(BLOCK, rows - lo)
            for h in range(HEADS):
                gemm(b"N", b"N", m, DIM, K, 1.0, x.ctypes.data + lo * K * 2, K,
                     w.ctypes.data + h * K * DIM * 2, DIM, 0.0,
                     c.ctypes.data + (h * rows + lo) * DIM * 4, DIM)  # fmt: skip
        return c

    def primitive(x: np.ndarray) -> np.ndarray:
        c = np.empty((HEADS, x.shape[0], DIM), np.float32)
        _heads_product(x.shape[0], K, HEADS, DIM)(x.ctypes.data, w.ctypes.data, c.ctypes.data)
        return c

    print(f"# threads {args.threads}; CPU ms, best of {args.repeats}")
    for rows in (16, 64, 280, 1120, 2240):
        x = np.ascontiguousarray(x_all[:rows])
        a = best(lambda x=x: per_head(x), args.repeats)
        b = best(lambda x=x: primitive(x), args.repeats)
        d = float(np.abs(per_head(x) - primitive(x)).max())
        print(f"rows {rows:5d}: per-head gemm {a * 1e3:7.3f} ms, one primitive {b * 1e3:7.3f} ms,"
              f" x{a / b:.2f}; max |d| {d:.1e}")  # fmt: skip
    whole = primitive(x_all)
    moved = []
    for m in (1, 2, 3, 7, 16, 17, 31, 64, 100, 255, 256, 280, 513, 1000):
        for lo in (0, 5, 2240 - m):
            part = primitive(np.ascontiguousarray(x_all[lo : lo + m]))
            if not np.array_equal(part, whole[:, lo : lo + m]):
                moved.append((m, lo))
    print(f"rows that moved against a 2,240-row product (row count, first row): {moved or 'none'}")


if __name__ == "__main__":
    main()
