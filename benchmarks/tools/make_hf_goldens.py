"""Build the Hugging Face golden checkpoints under tests/data/hf/ (run by hand, not in CI).

Needs torch (CPU) and transformers, which aioprefill never depends on; use a separate venv:

    python3 -m venv /work/hfref-venv
    /work/hfref-venv/bin/pip install torch transformers safetensors numpy
    /work/hfref-venv/bin/python benchmarks/tools/make_hf_goldens.py            # every case
    /work/hfref-venv/bin/python benchmarks/tools/make_hf_goldens.py mixtral_moe  # just one

(`pip install torch==2.13.0` on the build machines; the goldens were made with transformers
5.24.0.) Regenerate only the case you add: the weights, configs and prompts come out
bit-identical, but HF's "float64" forward runs its RMSNorm and attention softmax in float32, so
the recorded logprobs move by ~2e-7 from one machine to another (the same on one machine),
far inside the tests' 1e-4. `--out DIR` writes elsewhere, to compare.

For each supported architecture and setting it builds a tiny random model with `transformers`
(hidden 64, 2 layers, vocab 1000: well under 1 MB each), saves it with `save_pretrained` (one
sharded with a small `max_shard_size`, one in bfloat16, some configs rewritten to the older
spellings real checkpoints use), loads it back with `AutoModelForCausalLM.from_pretrained` in
float64, and writes `expected.json` beside it: fixed prompts, HF's greedy next token and its
log-probability. tests/hf/test_goldens.py checks aioprefill against these without torch.

Random weights are made harder to match than HF's init: norm scales and biases carry noise,
and q/k projections are scaled up so attention is sharp (RoPE errors then change results);
Mixtral's router is scaled up too, so routing is decisive. Prompts whose top-2 logits lie within
1e-3 are skipped: a near-tie is no test of the token. So are, for Mixtral, prompts where some
token's k-th and (k+1)-th expert probabilities lie within 1e-4 in some layer: float32 could route
that token differently (and torch.topk breaks exact ties as its kernel happens to).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen3Config,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import ROOT

OUT = ROOT / "tests" / "data" / "hf"
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
            elif pname.endswith("mlp.gate.weight"):  # Mixtral's router: decisive routing
                p.mul_(5.0)
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


def router_margin(model, ids) -> float | None:
    """A MoE model's smallest gap, over every token and layer, between the probabilities of the
    last expert kept and the first dropped (None for a dense model). Routing decided by a gap
    this small could go either way in float32."""
    k = getattr(model.config, "num_experts_per_tok", None)
    if k is None:
        return None
    with torch.no_grad():
        logits = model(ids[None], output_router_logits=True).router_logits
    gaps = []
    for layer in logits:
        probs = torch.softmax(layer.double(), dim=-1).sort(dim=-1, descending=True).values
        if probs.shape[-1] > k:
            gaps.append(float((probs[:, k - 1] - probs[:, k]).min()))
    return min(gaps, default=1.0)


def record(path: Path, max_len: int = 120) -> None:
    """HF's greedy token and logprob (float64) for NUM_PROMPTS prompts, into expected.json
    (for a MoE model also each prompt's smallest router gap, `router_margin`)."""
    moe = json.loads((path / "config.json").read_text()).get("num_local_experts")
    # The experts' reference loop (MixtralExperts.forward), not a grouped-matmul kernel.
    extra = {"experts_implementation": "eager"} if moe else {}
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float64, attn_implementation="eager", **extra
    ).eval()
    gen = torch.Generator().manual_seed(1234)
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, max_len]
    prompts, tokens, logprobs, margins, routers = [], [], [], [], []
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
        router = router_margin(model, ids)
        if router is not None and router < 1e-4:
            continue
        prompts.append(ids.tolist())
        tokens.append(int(top2.indices[0]))
        logprobs.append(float(logp[top2.indices[0]]))
        margins.append(margin)
        routers.append(router)
    expected = {"prompts": prompts, "tokens": tokens, "logprobs": logprobs, "margins": margins}
    if moe:
        expected["router_margins"] = routers
    (path / "expected.json").write_text(json.dumps(expected) + "\n")
    print(f"{path.name}: min margin {min(margins):.4f}, tokens {tokens}")
    if moe:
        print(f"{path.name}: min router margin {min(routers):.2e}")


def _llama_theta_eps() -> None:
    # Llama, theta 500000 and eps 1e-5 (defaults would change the results), new rope spelling.
    _, p = build("llama_theta_eps", LlamaConfig, 1, rope_theta=500000.0, rms_norm_eps=1e-5)
    record(p)


def _llama3_rope() -> None:
    # Llama 3.1-style RoPE scaling, in the older spelling Llama 3.1/3.2 files use.
    _, p = build("llama3_rope", LlamaConfig, 2, rope_parameters={"rope_theta": 500000.0, **LLAMA3})
    edit_config(p, drop=("rope_parameters",), rope_theta=500000.0, rope_scaling=LLAMA3)
    record(p)


def _llama_linear_sharded() -> None:
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


def _llama_head_dim_tied() -> None:
    # Explicit head_dim (32, not 64 / 4), tied embeddings with lm_head.weight stored anyway.
    _, p = build("llama_head_dim_tied", LlamaConfig, 4, head_dim=32, tie_word_embeddings=True)
    tensors = load_file(p / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, p / "model.safetensors", metadata={"format": "pt"})
    record(p)


def _llama_bf16() -> None:
    # A bfloat16 checkpoint (the golden is HF's float64 forward of the bf16 weights).
    model, p = build("llama_bf16", LlamaConfig, 5)
    model.to(torch.bfloat16).save_pretrained(p)
    record(p)


def _mistral_window() -> None:
    # Mistral with a sliding window longer than every golden prompt.
    _, p = build("mistral_window", MistralConfig, 6, sliding_window=128)
    record(p)


def _qwen2_bias() -> None:
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


def _qwen3_qk_norm() -> None:
    # Qwen3 (q/k RMSNorm), explicit head_dim, tied embeddings.
    _, p = build("qwen3_qk_norm", Qwen3Config, 8, head_dim=32, tie_word_embeddings=True)
    record(p)


def _mixtral_moe() -> None:
    # Mixtral: 4 experts, top-2, GQA, FFN 32 per expert (the file stays under 1 MB), the
    # router scaled up so routing is decisive, sharded so a layer's experts straddle files;
    # config.json written like Mixtral-8x7B's (old rope spelling, window null, the
    # training-only router keys set).
    _, p = build(
        "mixtral_moe",
        MixtralConfig,
        9,
        save={"max_shard_size": "300KB"},
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters={"rope_theta": 1e6},
        rms_norm_eps=1e-5,
    )
    assert (p / "model.safetensors.index.json").is_file(), "expected a sharded checkpoint"
    edit_config(
        p,
        drop=("rope_parameters",),
        rope_theta=1e6,
        sliding_window=None,
        router_aux_loss_coef=0.02,
        router_jitter_noise=0.1,
        output_router_logits=False,
    )
    record(p)


CASES = {
    "llama_theta_eps": _llama_theta_eps,
    "llama3_rope": _llama3_rope,
    "llama_linear_sharded": _llama_linear_sharded,
    "llama_head_dim_tied": _llama_head_dim_tied,
    "llama_bf16": _llama_bf16,
    "mistral_window": _mistral_window,
    "qwen2_bias": _qwen2_bias,
    "qwen3_qk_norm": _qwen3_qk_norm,
    "mixtral_moe": _mixtral_moe,
}


def main() -> None:
    global OUT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help=f"default: all of {', '.join(CASES)}")
    parser.add_argument("--out", type=Path, default=OUT, help=f"default: {OUT}")
    args = parser.parse_args()
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    OUT = args.out
    OUT.mkdir(parents=True, exist_ok=True)
    for name in args.cases or CASES:
        CASES[name]()


if __name__ == "__main__":
    main()
