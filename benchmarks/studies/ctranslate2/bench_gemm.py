"""The worker's matrix products per layer shape: Paddle's matmul (Intel MKL, the wheel's BLAS)
against oneDNN's sgemm (`aioprefill.workers.paddle.gemm.Products`, the worker's CPU path), at the
row counts batches have, on real models' shapes (read from tests/data/hf_configs).

Each shape is a `[rows, k] x [k, n]` float32 product as the forward runs it: `qkv` (the
heads-major projection: Paddle's batched matmul against one oneDNN product per head), `o`,
`gate_up`, `down` (x @ w.T) and the LM head. Both sides run alternately `--repeats` times on the
same tensors; the table gives GFLOP/s per CPU-second of this process (the lower quartile of
`time.process_time()`: less disturbed by a shared machine than wall time) and the ratio, so with
T threads a figure is per thread. Also printed: the largest difference between the two sides'
results (float32 rounding).

    python benchmarks/studies/ctranslate2/bench_gemm.py [--threads 1] [--rows 16,64,280,2240,8192]
        [--models smollm2_gguf,llama32_1b] [--repeats 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: common.py
from common import ROOT

CONFIGS = ROOT / "tests" / "data" / "hf_configs"


def shapes(model: str) -> dict[str, tuple[int, int, int]]:
    """name -> (n, k, heads) of each product of one layer and the head (heads 0: x @ w.T)."""
    cfg = json.loads((CONFIGS / model / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    dim = cfg.get("head_dim") or hidden // heads
    inter = cfg["intermediate_size"]
    return {
        "qkv": (dim, hidden, heads + 2 * kv),
        "o": (hidden, heads * dim, 0),
        "gate_up": (2 * inter, hidden, 0),
        "down": (hidden, inter, 0),
        "head": (cfg["vocab_size"], hidden, 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="16,64,280,2240,8192")
    parser.add_argument("--models", default="smollm2_gguf,llama32_1b")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--head-rows", type=int, default=512, help="largest head product")
    args = parser.parse_args()

    from aioprefill.workers.paddle.env import configure_math_libraries, library_versions

    configure_math_libraries()
    import paddle

    from aioprefill.workers.paddle.gemm import Products

    paddle.set_device("cpu")
    paddle.base.core.set_num_threads(args.threads)
    ours = Products("cpu", args.threads, None)
    assert ours.uses_onednn, "this paddle wheel has no oneDNN sgemm"
    print(
        f"$ python benchmarks/studies/ctranslate2/bench_gemm.py --threads {args.threads} "
        f"--rows {args.rows}"
    )
    print(f"libraries: {library_versions()}")
    print(
        f"{'model':14} {'product':8} {'rows':>5} {'n':>6} {'k':>5} {'MKL':>7} {'oneDNN':>7} "
        f"{'ratio':>6} {'max diff':>9}"
    )
    rng = np.random.default_rng(0)
    for model in args.models.split(","):
        for name, (n, k, heads) in shapes(model).items():
            for rows in (int(r) for r in args.rows.split(",")):
                if name == "head" and rows > args.head_rows:
                    continue
                x = paddle.to_tensor(rng.standard_normal((rows, k), dtype=np.float32))
                if heads:
                    w = paddle.to_tensor(
                        (rng.standard_normal((heads, k, n)) / np.sqrt(k)).astype(np.float32)
                    )

                    def mkl(x=x, w=w):  # type: ignore[no-untyped-def]
                        return paddle.matmul(x.unsqueeze(0), w)

                    def dnnl(x=x, w=w):  # type: ignore[no-untyped-def]
                        return ours.project(x, w)
                else:
                    w = paddle.to_tensor(
                        (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
                    )

                    def mkl(x=x, w=w):  # type: ignore[no-untyped-def]
                        return paddle.matmul(x, w, transpose_y=True)

                    def dnnl(x=x, w=w):  # type: ignore[no-untyped-def]
                        return ours.product(x, w)

                diff = float(np.abs(mkl().numpy() - dnnl().numpy()).max())
                times: dict[str, list[float]] = {"mkl": [], "dnnl": []}
                for _ in range(args.repeats):
                    for side, fn in (("mkl", mkl), ("dnnl", dnnl)):
                        t0 = time.process_time()
                        fn()
                        times[side].append(time.process_time() - t0)
                flop = 2 * rows * n * k * max(heads, 1)
                a, b = (sorted(times[s])[len(times[s]) // 4] for s in ("mkl", "dnnl"))
                print(
                    f"{model:14} {name:8} {rows:5d} {n * max(heads, 1):6d} {k:5d} "
                    f"{flop / a / 1e9:7.1f} {flop / b / 1e9:7.1f} {a / b:6.2f} {diff:9.1e}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
