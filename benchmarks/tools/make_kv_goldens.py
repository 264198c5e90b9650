"""Build tests/data/hf/llama_theta_eps/kv_golden.npz: transformers' own KV cache and decode step
for the prompts tests/transfer/test_decode_paddle.py pulls (run by hand, not in CI).

Needs torch (CPU) and transformers, which aioprefill never depends on; use the goldens venv
(benchmarks/tools/make_hf_goldens.py says how to make one):

    /work/goldens-venv/bin/python benchmarks/tools/make_kv_goldens.py

It loads the golden checkpoint with `AutoModelForCausalLM.from_pretrained` in float64 and, for
each prompt p (the 3rd, the 6th and the longest of its expected.json), runs p with
`use_cache=True` and stores `past_key_values` (per layer [kv_heads, len(p), head_dim], keys after
RoPE), HF's greedy next token t, and the logits of one decode step that feeds only t with that
cache: what a decode node computes from the pulled KV. Keys `keys_{i}`, `values_{i}` (float64
[layers, kv_heads, n, head_dim]), `token_{i}`, `logits_{i}` (float64 [vocab]).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import ROOT

CASE = ROOT / "tests" / "data" / "hf" / "llama_theta_eps"


def prompts() -> list[list[int]]:
    ps = json.loads((CASE / "expected.json").read_text())["prompts"]
    return [ps[2], ps[5], max(ps, key=len)]


def main() -> None:
    model = AutoModelForCausalLM.from_pretrained(CASE, dtype=torch.float64).eval()
    out: dict[str, np.ndarray] = {}
    with torch.no_grad():
        for i, p in enumerate(prompts()):
            first = model(torch.tensor([p]), use_cache=True)
            cache = first.past_key_values
            layers = range(model.config.num_hidden_layers)
            keys = np.stack([cache.layers[j].keys[0].numpy() for j in layers])
            values = np.stack([cache.layers[j].values[0].numpy() for j in layers])
            token = int(first.logits[0, -1].argmax())
            step = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            out[f"keys_{i}"], out[f"values_{i}"] = keys, values
            out[f"token_{i}"] = np.array(token)
            out[f"logits_{i}"] = step.logits[0, -1].numpy()
    np.savez(CASE / "kv_golden.npz", **out)
    print({k: v.shape for k, v in out.items()})


if __name__ == "__main__":
    main()
