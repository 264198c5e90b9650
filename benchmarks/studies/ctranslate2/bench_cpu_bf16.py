"""Reduced precision on the CPU, measured only (it does not ship): the worker's products with
bfloat16 inputs (oneDNN's `dnnl_gemm_bf16bf16f32`, float32 accumulation and output; weights
converted once, activations per product) against its float32 products, runner level (no engine),
1 thread, on SmolLM2-135M-Instruct.

Answers: the 12 real prompts of bench_vs_ctranslate2.py with prompt log-probabilities, bf16 for
the layers only and for the layers plus the LM head: greedy tokens that agree with float32, and
|delta logprob| over every prompt position (the issue's bar to ship: greedy agreement >= 99% and
|delta| <= 0.05). Speed: 8 prompts of 280 ids, tokens per CPU-second, alternating, best of 3.
oneDNN's fast bf16 kernels need a CPU with avx512_bf16 (or AMX).

    python benchmarks/studies/ctranslate2/bench_cpu_bf16.py
"""

from __future__ import annotations

import ctypes
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: common.py


def main() -> None:
    from bench_vs_ctranslate2 import real_prompts

    from aioprefill.models import PaddleModel
    from aioprefill.wire import protocol
    from aioprefill.workers.paddle import runner as paddle_runner
    from aioprefill.workers.paddle.env import paddle_libs
    from aioprefill.workers.runner import ForwardBatch
    from tests.hf.smollm2 import gguf_path

    paddle = paddle_runner.paddle
    spec = PaddleModel.from_pretrained(gguf_path(), device="cpu", num_threads=1)
    runner = paddle_runner.PaddleRunner(spec)
    libs = paddle_libs()
    assert libs is not None
    gemm = ctypes.CDLL(str(libs / "libdnnl.so.3")).dnnl_gemm_bf16bf16f32
    size, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    gemm.restype = ctypes.c_int
    gemm.argtypes = [ctypes.c_char, ctypes.c_char, size, size, size, f32, ptr, size, ptr, size]
    gemm.argtypes += [f32, ptr, size]
    weights: dict[int, Any] = {}

    def bf16(w: Any) -> Any:
        if id(w) not in weights:
            weights[id(w)] = (w, w.astype("bfloat16"))  # keeps w alive: ids stay unique
        return weights[id(w)][1]

    def xw(x: Any, w: Any, in_out: bool = False) -> Any:
        """x @ w ([in, out] weights) or x @ w.T (HF's [out, in], and the LM head)."""
        xb, wb = x.contiguous().astype("bfloat16"), bf16(w)
        (m, k), n = x.shape, w.shape[1 if in_out else 0]
        out = paddle.empty([m, n], "float32")
        status = gemm(b"N", b"N" if in_out else b"T", m, n, k, 1.0, xb.data_ptr(), k,
                      wb.data_ptr(), n if in_out else k, 0.0, out.data_ptr(), n)  # fmt: skip
        assert status == 0
        return out

    def linear(x: Any, w: Any) -> Any:  # as the runner laid the weights out (weights_in_out)
        return xw(x, w, runner._mm.in_out)

    def project(x: Any, w: Any) -> Any:
        xb, wb = x.contiguous().astype("bfloat16"), bf16(w)
        (m, k), (heads, _, d) = x.shape, w.shape
        out = paddle.empty([heads, m, d], "float32")
        for h in range(heads):
            status = gemm(b"N", b"N", m, d, k, 1.0, xb.data_ptr(), k,
                          wb.data_ptr() + h * k * d * 2, d, 0.0,
                          out.data_ptr() + h * m * d * 4, d)  # fmt: skip
            assert status == 0
        return out

    products = runner._mm
    float32 = (products.linear, products.project, runner._outputs._product)

    def use(kind: str, head_too: bool) -> None:
        if kind == "bf16":
            products.linear, products.project = linear, project  # type: ignore[method-assign]
            runner._outputs._product = xw if head_too else float32[2]
        else:
            products.linear, products.project, runner._outputs._product = float32  # type: ignore[method-assign]

    def batch(prompts: list[np.ndarray], options: int = 0) -> ForwardBatch:
        offsets = np.zeros(len(prompts) + 1, np.int32)
        offsets[1:] = np.cumsum([len(p) for p in prompts])
        n = len(prompts)
        return ForwardBatch(
            np.arange(n, dtype=np.int64),
            offsets,
            np.concatenate(prompts).astype(np.int32),
            np.zeros(n, np.int32),
            np.ones(n, bool),
            options=np.full(n, options, np.uint8) if options else None,
        )

    print("$ python benchmarks/studies/ctranslate2/bench_cpu_bf16.py")
    real = [np.array(p, np.int32) for p in real_prompts(gguf_path())]
    outs = {}
    for kind, head_too in (("float32", False), ("bf16", False), ("bf16", True)):
        use(kind, head_too)
        outs[kind, head_too] = runner.forward(batch(real, protocol.OPT_PROMPT_LOGPROBS))
    base = outs["float32", False]
    for (kind, head_too), o in outs.items():
        if kind == "float32":
            continue
        same = int((o.tokens == base.tokens).sum())
        d = np.abs(o.prompt_logprobs - base.prompt_logprobs)
        print(
            f"bf16 layers{' + LM head' if head_too else ''}: greedy same {same}/{len(o.tokens)}, "
            f"next-token |d| max {np.abs(o.logprobs - base.logprobs).max():.4f}; {d.size} prompt "
            f"logprobs |d| mean {d.mean():.4f} p99 {np.quantile(d, 0.99):.4f} max {d.max():.4f}"
        )
    rng = np.random.default_rng(0)
    timed = batch([rng.integers(1, spec.vocab_size, 280).astype(np.int32) for _ in range(8)])
    times: dict[str, list[float]] = {"float32": [], "bf16": []}
    for _ in range(4):
        for kind in times:
            use(kind, True)
            t0 = time.process_time()
            runner.forward(timed)
            times[kind].append(time.process_time() - t0)
    best = {k: min(v[1:]) for k, v in times.items()}  # the first round warms up
    for kind, t in best.items():
        print(f"{kind}: {8 * 280 / t:.0f} tokens per CPU-second (8 x 280, 1 thread)")
    print(f"bf16 / float32: {best['float32'] / best['bf16']:.2f}x")


if __name__ == "__main__":
    main()
