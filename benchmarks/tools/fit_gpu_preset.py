"""Fit the GPU-class `SimModel` preset: prefill cost of a Llama-3-8B-shaped model on one GPU.

Measures the forward time (bf16, random weights, eager PyTorch, causal SDPA over equal-length
sequences so no padding is involved) for a grid of batch shapes, then fits
`fixed + per_token * tokens + attn * sum(len^2)` by least squares. This is how the numbers of the
`gpu-8b` preset in `aioprefill/bench/presets.py` were obtained (on the H200 lent to this project;
PyTorch was used because the GPU machine has no paddlepaddle-gpu wheel).

    python benchmarks/tools/fit_gpu_preset.py --json out.json     # needs torch with CUDA
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
import torch
import torch.nn.functional as F

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 4096, 32, 8, 128, 14336, 128256, 32


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + 1e-5)).to(x.dtype) * w


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Llama8B:
    def __init__(self, device: str) -> None:
        g = torch.Generator(device=device).manual_seed(0)
        dt = torch.bfloat16

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g, device=device, dtype=dt) * 0.02

        self.embed = w(VOCAB, HIDDEN)
        self.lm_head = w(VOCAB, HIDDEN)
        self.norm = torch.ones(HIDDEN, device=device, dtype=dt)
        self.layers = [
            dict(
                qkv=w((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
                o=w(HIDDEN, HEADS * HEAD_DIM),
                gate_up=w(2 * FFN, HIDDEN),
                down=w(HIDDEN, FFN),
                n1=torch.ones(HIDDEN, device=device, dtype=dt),
                n2=torch.ones(HIDDEN, device=device, dtype=dt),
            )
            for _ in range(LAYERS)
        ]
        inv = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM))
        pos = torch.arange(32768, device=device).float()
        freqs = torch.outer(pos, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(dt), emb.sin().to(dt)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, n = ids.shape
        x = self.embed[ids]
        cos, sin = self.cos[:n][None, None], self.sin[:n][None, None]
        for layer in self.layers:
            h = rms_norm(x, layer["n1"])
            qkv = h @ layer["qkv"].T
            q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
            q = rope(q.view(b, n, HEADS, HEAD_DIM).transpose(1, 2), cos, sin)
            k = rope(k.view(b, n, KV_HEADS, HEAD_DIM).transpose(1, 2), cos, sin)
            v = v.view(b, n, KV_HEADS, HEAD_DIM).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(b, n, HIDDEN) @ layer["o"].T
            h = rms_norm(x, layer["n2"])
            gate, up = (h @ layer["gate_up"].T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["down"].T
        last = rms_norm(x[:, -1], self.norm)
        logp = torch.log_softmax((last @ self.lm_head.T).float(), dim=-1)
        return logp.max(dim=-1)


SHAPES = [
    (1, 16),
    (1, 128),
    (8, 128),
    (32, 128),
    (64, 128),
    (128, 128),
    (1, 512),
    (4, 512),
    (16, 512),
    (32, 512),
    (1, 2048),
    (2, 2048),
    (4, 2048),
    (8, 2048),
    (1, 4096),
    (2, 4096),
    (1, 8192),
    (2, 8192),
    (1, 16384),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    model = Llama8B("cuda")
    rows = []
    for b, n in SHAPES:
        ids = torch.randint(0, VOCAB, (b, n), device="cuda")
        for _ in range(2):
            model.forward(ids)
        torch.cuda.synchronize()
        times = []
        for _ in range(args.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model.forward(ids)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        ms = statistics.median(times)
        rows.append({"batch": b, "seq_len": n, "tokens": b * n, "sum_sq": b * n * n, "ms": ms})
        print(f"{b:4d} x {n:6d}: {ms:8.3f} ms", flush=True)
    a = np.array([[1.0, r["tokens"], r["sum_sq"]] for r in rows])
    y = np.array([r["ms"] for r in rows])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    fit = {"fixed_ms": coef[0], "per_token_us": coef[1] * 1e3, "attn_ns": coef[2] * 1e6}
    pred = a @ coef
    fit["max_rel_error"] = float(np.max(np.abs(pred - y) / y))
    print(json.dumps(fit, indent=2))
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rows": rows,
        "fit": fit,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
