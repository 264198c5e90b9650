"""Two facts about Intel MKL's sgemm as Paddle's CPU wheel ships it, per layer shape of a real
model (read from tests/data/hf_configs), for whoever next works on the CPU worker's products:

1. **Row invariance by row count.** For x @ w.T with x the last M rows of a 1,050-row matrix:
   is each row's result bitwise the one it gets in the 1,050-row product? MKL takes another
   kernel below some M, and a row's rounding then moves (a prefix-cache hit's suffix, a
   short chunk, a small batch). Printed: the row counts that differ, per thread count, for
   each product path of `--gemm` (MKL: Paddle's matmul; oneDNN: `paddle.gemm`'s dnnl_sgemm).
2. **Packed weights** (`cblas_sgemm_pack` once, `cblas_sgemm_compute` per product, both in
   the wheel's libmklml_intel.so): GFLOP/s against plain `cblas_sgemm` on the same tensors
   (alternating, the median of `--repeats`, CPU time of this thread), whether the results are
   bitwise those of plain sgemm, and the packed buffer's size against the weight's.

    python benchmarks/studies/ctranslate2/bench_mkl_rows.py [--model smollm2_gguf] [--threads 1,2,4]
        [--repeats 7] [--gemm mkl,onednn] [--rows-only]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: common.py

ROWS = (1, 8, 16, 32, 48, 50, 52, 55, 56, 63, 64, 100, 128, 280, 512)
ROW_MAJOR, NO_TRANS, TRANS, PACKED, B_MATRIX = 101, 111, 112, 151, 162


def products(model: str) -> dict[str, tuple[int, int]]:
    """name -> (n, k) of x @ w.T for each product of one layer and the head."""
    from bench_gemm import shapes

    out = {}
    for name, (n, k, heads) in shapes(model).items():
        out[name] = (n * heads, k) if heads else (n, k)
    return out


def row_invariance(model: str, threads: int, gemm: str) -> None:
    import os

    import paddle

    os.environ["AIOPREFILL_CPU_GEMM"] = gemm
    from aioprefill.workers.paddle.gemm import Products

    paddle.set_device("cpu")
    paddle.base.core.set_num_threads(threads)
    mm = Products("cpu", threads, None)
    assert mm.uses_onednn == (gemm == "onednn")
    rng = np.random.default_rng(0)
    for name, (n, k) in products(model).items():
        w = paddle.to_tensor((rng.standard_normal((n, k)) * 0.05).astype(np.float32))
        x = rng.standard_normal((1050, k)).astype(np.float32)
        whole = np.from_dlpack(mm.product(paddle.to_tensor(x), w)).copy()
        moved = []
        for m in ROWS:
            part = np.from_dlpack(mm.product(paddle.to_tensor(x[-m:]), w))
            if not np.array_equal(part, whole[-m:]):
                moved.append(m)
        print(
            f"  {gemm:6s} {threads} thread(s) {name:8s} rows whose results move: {moved or 'none'}"
        )


def packed(model: str, repeats: int) -> None:
    import paddle

    paddle.set_device("cpu")
    paddle.base.core.set_num_threads(1)
    mkl = ctypes.CDLL(str(Path(paddle.__file__).parent / "libs" / "libmklml_intel.so"))
    i32, ptr, f32 = ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    mkl.cblas_sgemm_pack_get_size.restype = ctypes.c_size_t
    mkl.cblas_sgemm_pack_get_size.argtypes = [i32] * 4
    mkl.cblas_sgemm_pack.argtypes = [i32] * 6 + [f32, ptr, i32, ptr]
    mkl.cblas_sgemm_compute.argtypes = [i32] * 6 + [ptr, i32, ptr, i32, f32, ptr, i32]
    mkl.cblas_sgemm.argtypes = [i32] * 6 + [f32, ptr, i32, ptr, i32, f32, ptr, i32]
    rng = np.random.default_rng(0)
    print("product  rows   plain  packed  (GFLOP/s, 1 thread)  bitwise  packed/weight bytes")
    for name, (n, k) in products(model).items():
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        size = mkl.cblas_sgemm_pack_get_size(B_MATRIX, 64, n, k)
        buf = np.empty(size // 4 + 16, np.float32)
        mkl.cblas_sgemm_pack(
            ROW_MAJOR, B_MATRIX, TRANS, 64, n, k, 1.0, w.ctypes.data, k, buf.ctypes.data
        )
        for m in (16, 64, 280, 2240):
            x = rng.standard_normal((m, k)).astype(np.float32)
            c1, c2 = np.empty((m, n), np.float32), np.empty((m, n), np.float32)
            calls = {
                "plain": functools.partial(
                    mkl.cblas_sgemm, ROW_MAJOR, NO_TRANS, TRANS, m, n, k, 1.0,
                    x.ctypes.data, k, w.ctypes.data, k, 0.0, c1.ctypes.data, n,
                ),
                "packed": functools.partial(
                    mkl.cblas_sgemm_compute, ROW_MAJOR, NO_TRANS, PACKED, m, n, k,
                    x.ctypes.data, k, buf.ctypes.data, k, 0.0, c2.ctypes.data, n,
                ),
            }  # fmt: skip
            times: dict[str, list[float]] = {label: [] for label in calls}
            for _ in range(repeats):
                for label, call in calls.items():
                    t = time.thread_time()
                    call()
                    times[label].append(time.thread_time() - t)
            flops = 2 * m * n * k
            rate = {label: flops / max(np.median(ts), 1e-9) / 1e9 for label, ts in times.items()}
            print(
                f"{name:8s} {m:5d}  {rate['plain']:6.1f}  {rate['packed']:6.1f}"
                f"  {'':20s} {np.array_equal(c1, c2)!s:7s}  {size / w.nbytes:.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2_gguf")
    parser.add_argument("--threads", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--gemm", default="mkl", help="part 1's product paths: mkl,onednn")
    parser.add_argument("--rows-only", action="store_true", help="part 1 only")
    parser.add_argument("--part", choices=("rows", "packed"), help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    from aioprefill.workers.paddle.env import configure_math_libraries, keep_freed_memory

    configure_math_libraries()  # as a worker: MKL's AVX2 kernels on AMD, freed memory kept
    keep_freed_memory()
    if args.part == "rows":
        return row_invariance(args.model, args.n, args.gemm)
    if args.part == "packed":
        return packed(args.model, args.repeats)
    from aioprefill.workers.paddle.env import library_versions

    print(f"{args.model}: {library_versions()}")
    print(f"1. row counts (of {ROWS}) whose rows differ from the same rows in a 1,050-row product")
    for gemm in args.gemm.split(","):
        for n in args.threads.split(","):  # a process per thread count: MKL keeps its first
            cmd = [sys.executable, __file__, "--model", args.model, "--part", "rows", "--n", n]
            subprocess.run([*cmd, "--gemm", gemm], check=True)
    if args.rows_only:
        return
    print("2. packed weights against plain sgemm")
    cmd = [sys.executable, __file__, "--model", args.model, "--part", "packed"]
    subprocess.run([*cmd, "--repeats", str(args.repeats)], check=True)


if __name__ == "__main__":
    main()
