"""What bf16 attention would cost a bf16 worker in accuracy (issue 35's next-token gap: vLLM
runs attention in bf16, aioprefill in float32, ~8% of a 4 x 280 forward at the float32 peak):
the shipped runner with attention's inputs rounded to bf16 before its float32 products (the
same sums as bf16 products with float32 accumulation, up to float32 rounding), against float64
on the 64 x 280 prompts of benchmarks/bench_bf16.py and real12.

`--mode`, `+`-joined:
  qk    q.k^T on bf16-rounded q and k
  qkS   the same, except `--dims` head dims per KV head kept float32 (the dims of largest
        sum q^2 * sum k^2 in each call: in sample, what a calibration could at best pick);
        as a product: [q_hi, q_rest, q_hi] . [k_hi, k_hi, k_rest] on those dims, 64 + 2S inputs
  pv    p.v on bf16-rounded probabilities and values
  pvS   p rounded except key 0 (the attention sink, where most probability sits), v rounded
        except `--dims` head dims per KV head (largest energy) kept float32

    OMP_NUM_THREADS=1 python benchmarks/studies/bf16/attention_bf16.py --mode qkS+pvS [--dims 8]
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
from aioprefill.workers.paddle import attention
from aioprefill.workers.paddle.ops import round_bf16_
from aioprefill.workers.paddle.runner import PaddleRunner
from tests.hf.smollm2 import gguf_path


def round_bf16(a: np.ndarray) -> None:
    """float32 values rounded to bf16 (nearest even: the worker's `round_bf16_`), in place."""
    a[...] = np.from_dlpack(round_bf16_(paddle.to_tensor(a)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", default="qkS+pvS")
    p.add_argument("--dims", type=int, default=8)
    args = p.parse_args()
    mode, s = set(args.mode.split("+")), args.dims
    softmax, tiles = attention.causal_softmax_rows_, attention._Tiles.__call__

    def rounded_softmax(s3: np.ndarray, *a) -> None:  # s3 [heads, rows, keys] in place
        softmax(s3, *a)
        if "pvS" in mode:
            sink = s3[:, :, 0].copy()
            round_bf16(s3)
            s3[:, :, 0] = sink
        elif "pv" in mode:
            round_bf16(s3)

    def rounded_tiles(self, q, keys, values, dst) -> None:  # q [kv, group, rows, dim]
        kn, vn = np.from_dlpack(keys), np.from_dlpack(values)  # [kv, total, dim]
        if mode & {"qk", "qkS"}:
            qq, kk = q.copy(), kn.copy()
            round_bf16(qq)
            round_bf16(kk)
            if "qkS" in mode:
                eq = (q.astype(np.float64) ** 2).reshape(q.shape[0], -1, q.shape[-1]).sum(1)
                ek = (kn.astype(np.float64) ** 2).sum(1)
                for h, cols in enumerate(np.argsort(-(eq * ek), axis=1)[:, :s]):
                    qq[h][..., cols] = q[h][..., cols]
                    kk[h][:, cols] = kn[h][:, cols]
            q, keys = qq, paddle.to_tensor(kk)
        if mode & {"pv", "pvS"}:
            vv = vn.copy()
            round_bf16(vv)
            if "pvS" in mode:
                ev = (vn.astype(np.float64) ** 2).sum(1)
                for h, cols in enumerate(np.argsort(-ev, axis=1)[:, :s]):
                    vv[h][:, cols] = vn[h][:, cols]
            values = paddle.to_tensor(vv)
        tiles(self, q, keys, values, dst)

    attention.causal_softmax_rows_ = rounded_softmax
    attention._Tiles.__call__ = rounded_tiles
    r = PaddleRunner(PaddleModel.from_pretrained(str(gguf_path()), device="cpu", dtype="bfloat16"))
    ref = np.load(B.REFERENCE)
    for wl, per in (("64x280", 16), ("real12", 4)):
        outs = [r.forward(b) for b in B.batches(B.workloads([wl])[wl], per, True)]
        lps = np.concatenate([o.logprobs for o in outs])
        toks = np.concatenate([o.tokens for o in outs])
        d = np.abs(lps - ref[wl + "_1"])
        plp = np.concatenate([o.prompt_logprobs for o in outs]).astype(np.float64)
        pd = np.abs(plp - ref[wl + "_2"])
        greedy = f"{(toks == ref[wl + '_0']).sum()}/{len(toks)}"
        print(f"{args.mode} dims {s} | {wl} | next max {d.max():.4f} p90 {np.quantile(d, 0.9):.4f}"
              f" mean {d.mean():.4f} | greedy {greedy} | prompt p99 {np.quantile(pd, 0.99):.4f}"
              f" mean {pd.mean():.4f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
