"""How to multiply a bf16 worker's LM head (`aioprefill.workers.paddle.lo_channels._extend_head`):
accuracy against float64 of the 64 x 280 prompts of benchmarks/bench_bf16.py and of real12, with
the head's products replaced by variants computed in NumPy (float32 sums of bf16-rounded values,
the same sums as oneDNN's bf16 product up to float32 rounding).

Variants: `f32` (the float32 head: what a worker ran before), `bf16` (x and the head rounded to
bf16), `sN` (bf16, plus on the N input channels of highest score x's rest against the head's
rounding and x's rounding against the head's rest: what the shipped head does with N = 16), and
`sN+last` (the same on the next-token rows too, which the shipped worker keeps float32). The
score of a channel: its energy in the final norm's output (sum of x^2 over the head's rows of a
seeded 256-id prompt, as the worker calibrates) times the head column's (sum of w^2).

    OMP_NUM_THREADS=1 python benchmarks/studies/bf16/head_channels.py [--variants f32,bf16,s16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository
import bench_bf16 as B
import paddle

from aioprefill.config import PaddleModel
from aioprefill.workers.paddle.lo_channels import calibration_batch
from aioprefill.workers.paddle.ops import round_bf16_
from aioprefill.workers.paddle.runner import PaddleRunner
from tests.hf.smollm2 import gguf_path


def rounded(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 (nearest even: the worker's `round_bf16_`), as float32."""
    return np.from_dlpack(round_bf16_(paddle.to_tensor(np.ascontiguousarray(a, np.float32))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variants", default="f32,bf16,s8,s16,s32,s64,s16+last")
    args = p.parse_args()
    r = PaddleRunner(PaddleModel.from_pretrained(str(gguf_path()), device="cpu", dtype="bfloat16"))
    head = r._outputs
    f32_head = head._lm_head
    head.prompt_head = f32_head  # the study's own variants on the float32 head
    w = np.from_dlpack(f32_head)
    base, row_bytes = f32_head.data_ptr(), w.shape[1] * 4
    w_hi = rounded(w)
    w_lo = rounded(w - w_hi)
    float32_product, float32_last = head._product, head._product_last
    energy = np.zeros(w.shape[1])

    def observe(x: paddle.Tensor, wt: paddle.Tensor) -> paddle.Tensor:
        nonlocal energy
        if wt.data_ptr() == base:  # each tile's first vocabulary slice: its rows once
            energy += (np.from_dlpack(x).astype(np.float64) ** 2).sum(axis=0)
        return float32_product(x, wt)

    head._product = observe
    r.forward(calibration_batch(r.spec.vocab_size))
    head._product = float32_product
    score = energy * (w.astype(np.float64) ** 2).sum(axis=0)
    order = np.argsort(-score, kind="stable")
    share = np.cumsum(score[order]) / score.sum()
    print("# the head's input channels by score:", order[:16].tolist())
    print("# share of the score in the top 8 / 16 / 32 / 64:",
          " / ".join(f"{share[n - 1]:.3f}" for n in (8, 16, 32, 64)))  # fmt: skip

    def variant(s: int):
        cols = order[:s]

        def product(x: paddle.Tensor, wt: paddle.Tensor) -> paddle.Tensor:
            lo = (wt.data_ptr() - base) // row_bytes
            hi, low = w_hi[lo : lo + wt.shape[0]], w_lo[lo : lo + wt.shape[0]]
            xv = np.from_dlpack(x)
            xh = rounded(xv)
            out = xh @ hi.T
            if s:
                out += rounded(xv[:, cols] - xh[:, cols]) @ hi[:, cols].T
                out += xh[:, cols] @ low[:, cols].T
            return paddle.to_tensor(out.astype(np.float32))

        return product

    ref = np.load(B.REFERENCE)
    print("workload | head | next max | p90 | mean | greedy | prompt p99 | mean")
    for wl, per in (("64x280", 16), ("real12", 4)):
        prompts = B.workloads([wl])[wl]
        for name in args.variants.split(","):
            s = None if name == "f32" else 0 if name == "bf16" else int(name[1:].split("+")[0])
            head._product = float32_product if s is None else variant(s)
            head._product_last = variant(s) if s is not None and "+last" in name else float32_last
            outs = [r.forward(b) for b in B.batches(prompts, per, True)]
            lps = np.concatenate([o.logprobs for o in outs])
            toks = np.concatenate([o.tokens for o in outs])
            d = np.abs(lps - ref[wl + "_1"])
            plp = np.concatenate([o.prompt_logprobs for o in outs]).astype(np.float64)
            pd = np.abs(plp - ref[wl + "_2"])
            print(f"{wl} | {name} | {d.max():.4f} | {np.quantile(d, 0.9):.4f} | {d.mean():.4f} | "
                  f"{(toks == ref[wl + '_0']).sum()}/{len(toks)} | {np.quantile(pd, 0.99):.4f} | "
                  f"{pd.mean():.4f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
