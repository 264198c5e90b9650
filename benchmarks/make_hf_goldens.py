"""Build the Hugging Face golden checkpoints under tests/data/hf/ (run by hand, not in CI).

Needs torch (CPU) and transformers, which aioprefill never depends on; use a separate venv:

    python3 -m venv /work/hfref-venv
    /work/hfref-venv/bin/pip install torch transformers safetensors numpy
    /work/hfref-venv/bin/python benchmarks/make_hf_goldens.py

For each supported architecture and setting it builds a tiny random model with `transformers`
(hidden 64, 2 layers, vocab 1000: well under 1 MB each), saves it with `save_pretrained` (one
sharded with a small `max_shard_size`, one in bfloat16, some configs rewritten to the older
spellings real checkpoints use), loads it back with `AutoModelForCausalLM.from_pretrained` in
float64, and writes `expected.json` beside it: fixed prompts, HF's greedy next token and its
log-probability. tests/hf/test_goldens.py checks aioprefill against these without torch.

Random weights are made harder to match than HF's init: norm scales and biases carry noise,
and q/k projections are scaled up so attention is sharp (RoPE errors then change results).
Prompts whose top-2 logits lie within 1e-3 are skipped: a near-tie is no test of the token.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "hf"
VOCAB = 1000
NUM_PROMPTS = 12
BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    initializer_range=0.05,
    tie_word_embeddings=False,
)
LLAMA3 = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)


def build(name: str, config_cls, seed: int, save: dict | None = None, **kw):
    torch.manual_seed(seed)
    config = config_cls(**{**BASE, **kw})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * (torch.rand_like(p) - 0.5))
            elif pname.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
            elif pname.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(3.0)
    path = OUT / name
    shutil.rmtree(path, ignore_errors=True)
    model.save_pretrained(path, **(save or {}))
    return model, path


def edit_config(path: Path, drop: tuple[str, ...] = (), **set_) -> None:
    file = path / "config.json"
    config = json.loads(file.read_text())
    for key in drop:
        config.pop(key, None)
    config.update(set_)
    file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def record(path: Path, max_len: int = 120) -> None:
    """HF's greedy token and logprob (float64) for NUM_PROMPTS prompts, into expected.json."""
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float64, attn_implementation="eager"
    ).eval()
    gen = torch.Generator().manual_seed(1234)
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, max_len]
    prompts, tokens, logprobs, margins = [], [], [], []
    while len(prompts) < NUM_PROMPTS:
        n = lengths[len(prompts)] if len(prompts) < len(lengths) else 1 + len(prompts) * 7
        ids = torch.randint(0, VOCAB, (n,), generator=gen)
        with torch.no_grad():
            logits = model(ids[None]).logits[0, -1].double()
        logp = torch.log_softmax(logits, dim=-1)
        top2 = torch.topk(logits, 2)
        margin = float(top2.values[0] - top2.values[1])
        if margin < 1e-3:
            continue
        prompts.append(ids.tolist())
        tokens.append(int(top2.indices[0]))
        logprobs.append(float(logp[top2.indices[0]]))
        margins.append(margin)
    expected = {"prompts": prompts, "tokens": tokens, "logprobs": logprobs, "margins": margins}
    (path / "expected.json").write_text(json.dumps(expected) + "\n")
    print(f"{path.name}: min margin {min(margins):.4f}, tokens {tokens}")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    # Llama, theta 500000 and eps 1e-5 (defaults would change the results), new rope spelling.
    _, p = build("llama_theta_eps", LlamaConfig, 1, rope_theta=500000.0, rms_norm_eps=1e-5)
    record(p)
    # Llama 3.1-style RoPE scaling, in the older spelling Llama 3.1/3.2 files use.
    _, p = build("llama3_rope", LlamaConfig, 2, rope_parameters={"rope_theta": 500000.0, **LLAMA3})
    edit_config(p, drop=("rope_parameters",), rope_theta=500000.0, rope_scaling=LLAMA3)
    record(p)
    # Linear RoPE scaling, saved sharded with a small max_shard_size.
    _, p = build(
        "llama_linear_sharded",
        LlamaConfig,
        3,
        save={"max_shard_size": "150KB"},
        rope_parameters={"rope_theta": 10000.0, "rope_type": "linear", "factor": 4.0},
    )
    assert (p / "model.safetensors.index.json").is_file(), "expected a sharded checkpoint"
    record(p)
    # Explicit head_dim (32, not 64 / 4), tied embeddings with lm_head.weight stored anyway.
    model, p = build("llama_head_dim_tied", LlamaConfig, 4, head_dim=32, tie_word_embeddings=True)
    tensors = load_file(p / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, p / "model.safetensors", metadata={"format": "pt"})
    record(p)
    # A bfloat16 checkpoint (the golden is HF's float64 forward of the bf16 weights).
    model, p = build("llama_bf16", LlamaConfig, 5)
    model.to(torch.bfloat16).save_pretrained(p)
    record(p)
    # Mistral with a sliding window longer than every golden prompt.
    _, p = build("mistral_window", MistralConfig, 6, sliding_window=128)
    record(p)
    # Qwen2 (q/k/v bias), written like a Qwen2.5 file: old rope spelling, window key unused.
    _, p = build("qwen2_bias", Qwen2Config, 7, rope_parameters={"rope_theta": 1e6})
    edit_config(
        p,
        drop=("rope_parameters", "layer_types"),
        rope_theta=1e6,
        rope_scaling=None,
        sliding_window=4096,
        use_sliding_window=False,
        max_window_layers=21,
    )
    record(p)
    # Qwen3 (q/k RMSNorm), explicit head_dim, tied embeddings.
    _, p = build("qwen3_qk_norm", Qwen3Config, 8, head_dim=32, tie_word_embeddings=True)
    record(p)


if __name__ == "__main__":
    main()
