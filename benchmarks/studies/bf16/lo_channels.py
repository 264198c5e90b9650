"""Which input channels of a bf16 worker's products to carry as bf16x2, and how many
(`aioprefill.workers.paddle.lo_channels`): accuracy against float64 of the 64 x 280 prompts of
benchmarks/bench_bf16.py (or real12) for rules of the form "layers:products:s".

The study runs one bf16 runner with every product of every layer on bf16x2 (`_x2` set to all
layers; the shipped extension undone), records each product's input channel energy (sum of x^2)
on a calibration prompt (`--calibration` seed: 256 random ids, or `in`: the workload's last 16
prompts, in sample), then for each rule zeroes the bf16x2 rest outside the chosen channels (the
same sums as an extended product's, up to float32 rounding) and prints next-token |d| max / p90
/ mean, greedy agreement and prompt-logprob |d| p99 / mean, with the rule's extra product FLOPs
(SmolLM2's per-layer MACs). A rule: `first-last:products:s`, products `all` or `+`-joined
names (qkv, o, gate_up, down), s = 0 for every channel; rules of a config joined by `,`, configs
by `;`; a product no rule names runs on bf16 alone. `--select`: `energy_weights` (the shipped
score: energy times the weight column's energy), `energy`, or `weights` (no calibration: the
column energy times the RMSNorm gain squared).

    OMP_NUM_THREADS=1 python benchmarks/studies/bf16/lo_channels.py \\
        --configs "0-0:all:0,1-3:qkv:0;0-29:all:16;0-29:all:8" [--workload real12]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository
import bench_bf16 as B

from aioprefill.config import PaddleModel
from aioprefill.workers.paddle import onednn
from aioprefill.workers.paddle import runner as runner_module
from aioprefill.workers.paddle.lo_channels import calibration_batch
from tests.hf.smollm2 import gguf_path

NAMES = ("qkv", "o", "gate_up", "down")
MACS = {"qkv": 0.553, "o": 0.332, "gate_up": 1.769, "down": 0.885}  # SmolLM2, millions a token


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--configs", default="0-0:all:0,1-3:qkv:0;0-29:all:16;0-29:all:8")
    p.add_argument("--workload", default="64x280", choices=["64x280", "real12"])
    p.add_argument("--calibration", default="7", help="a seed, or `in` (in sample)")
    p.add_argument(
        "--select", default="energy_weights", choices=["energy_weights", "energy", "weights"]
    )
    args = p.parse_args()

    keep = runner_module.extend_runner
    runner_module.extend_runner = lambda r, head: r._x2  # no extension: the study's own bf16x2
    r = runner_module.PaddleRunner(
        PaddleModel.from_pretrained(str(gguf_path()), device="cpu", dtype="bfloat16")
    )
    runner_module.extend_runner = keep
    r._x2 = (len(r._layers),) * 2
    names = {
        int(getattr(layer, n).data_ptr()): (i, n)
        for i, layer in enumerate(r._layers)
        for n in NAMES
    }
    energy: dict[int, np.ndarray] = {}
    masks: dict[int, np.ndarray] = {}
    current: list = [None]
    split = onednn.Bf16Cast.split

    def observe(x, w) -> None:  # every bf16x2 product, before its split
        current[0] = int(w.data_ptr())
        if masks is None or not masks:
            e = (np.from_dlpack(x).astype(np.float64) ** 2).sum(axis=0)
            energy[current[0]] = energy.get(current[0], 0.0) + e

    def masked_split(cast, x):
        hi, lo = split(cast, x)
        m = masks.get(current[0])
        if m is not None:
            v = np.from_dlpack(x)
            cast._bufs["lo"][: v.size].reshape(v.shape)[:, ~m] = 0  # the rest on m's channels only
        return hi, lo

    r._mm.observe = observe
    onednn.Bf16Cast.split = masked_split
    prompts = B.workloads([args.workload])[args.workload]
    if args.calibration == "in":
        for b in B.batches(prompts[-16:], 16, True):
            r.forward(b)
    else:
        from aioprefill.workers.paddle import lo_channels

        lo_channels._SEED = int(args.calibration)
        r.forward(calibration_batch(r.spec.vocab_size))
    ref = np.load(B.REFERENCE)
    per = 16 if args.workload == "64x280" else 4
    layers_macs = sum(MACS.values()) * len(r._layers)
    print(f"# {args.workload}, calibration {args.calibration}, select {args.select}")
    for config in args.configs.split(";"):
        masks.clear()
        extra = 0.0
        for key, e in energy.items():
            i, name = names[key]
            s = None
            for rule in config.split(","):
                span, products, n = rule.split(":")
                lo, hi = map(int, span.split("-"))
                if lo <= i <= hi and (products == "all" or name in products.split("+")):
                    s = int(n)
            w = getattr(r._layers[i], name)
            k = int(w.shape[1])
            m = np.zeros(k, bool)
            if s == 0:
                m[:] = True
                s = k
            elif s:
                a = w.astype("float32").numpy().astype(np.float64) ** 2
                col = a.sum(axis=(0, 2)) if a.ndim == 3 else a.sum(axis=0)
                gain = {"qkv": r._layers[i].in_norm, "gate_up": r._layers[i].post_norm}.get(name)
                score = {
                    "energy_weights": e * col,
                    "energy": e,
                    "weights": col
                    * (1.0 if gain is None else gain.numpy().astype(np.float64) ** 2),
                }[args.select]
                m[np.argsort(-score, kind="stable")[:s]] = True
            masks[key] = m
            extra += MACS[name] * (s or 0) / k
        outs = [r.forward(b) for b in B.batches(prompts, per, True)]
        lps = np.concatenate([o.logprobs for o in outs])
        toks = np.concatenate([o.tokens for o in outs])
        d = np.abs(lps - ref[f"{args.workload}_1"])
        plp = np.concatenate([o.prompt_logprobs for o in outs]).astype(np.float64)
        pd = np.abs(plp - ref[f"{args.workload}_2"])
        agree = int((toks == ref[f"{args.workload}_0"]).sum())
        print(
            f"{config:34s} +{100 * extra / layers_macs:5.2f}% FLOPs  next max {d.max():.4f} "
            f"p90 {np.quantile(d, 0.9):.4f} mean {d.mean():.4f} greedy {agree}/{len(toks)} | "
            f"prompt p99 {np.quantile(pd, 0.99):.4f} mean {pd.mean():.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
