"""Derive, from transformers' own code, which config.json keys never touch the forward, and
write them to aioprefill/hf/config_keys.py (run by hand, not in CI; the output is committed).

    /work/goldens-venv/bin/python benchmarks/tools/make_hf_config_keys.py [--legacy DIR]

`--legacy DIR`: a transformers 4.x tree to survey as well, since most checkpoints on the Hub
were saved by 4.x and carry its keys (`torchscript`, `use_bfloat16`, `torch_dtype`, the
generation defaults it used to keep in the model config...):

    pip install --target DIR --no-deps 'transformers==4.57.1' 'huggingface-hub<1.0' \
        'tokenizers<0.23'

What it records, per transformers version, merged (the output says which versions):

- `COMMON`: every attribute of `PretrainedConfig` itself (its `__init__` parameters, its
  dataclass fields and properties, what a default instance serialises), the generation
  parameters older configs carry (`GenerationConfig`'s defaults, 4.x's
  `_get_global_generation_defaults`), and the keys transformers' GGUF reader writes from a
  file's `general.*` / `tokenizer.*` metadata (`_model_name_or_path`, `unk_token_id`...).
  hf/config.py still refuses, by name, the few of them whose value changes the forward (it
  checks those first).
- `UNREAD[architecture]`: the architecture's own config keys (its config class's attributes,
  plus keys real published configs carry that the class does not define, listed in `PUBLISHED`
  below with where they come from) that its modelling code never reads: not in
  `modeling_<type>.py` nor in the shared modules it calls (`modeling_utils`,
  `modeling_rope_utils`, `masking_utils`, `integrations/sdpa_attention`...), as
  `config.<key>`, `getattr(config, "<key>")` or an `attribute_map` alias.
- `FORWARD`: keys other decoder architectures' modelling code reads from their own config
  (Gemma's soft-capping, Granite's multipliers, Phi-3's partial rotary factor, DeepSeek's
  MoE...): settings that change a forward. tests/hf/test_config_keys.py checks that
  hf/config.py refuses every one of them (by name) on each supported architecture.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import ROOT

OUT = ROOT / "aioprefill" / "hf" / "config_keys.py"
ARCHS = {
    "LlamaForCausalLM": ("llama", "LlamaConfig"),
    "MistralForCausalLM": ("mistral", "MistralConfig"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2Config"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3Config"),
    "MixtralForCausalLM": ("mixtral", "MixtralConfig"),
}
# Keys published configs carry that no transformers config class defines; each is checked below
# to be unread by the modelling code (transformers stores it as a plain attribute and ignores it).
PUBLISHED = {
    # HuggingFaceTB/SmolLM2-135M(-Instruct) and SmolLM2-360M/1.7B config.json (nanotron exports).
    "LlamaForCausalLM": {"is_llama_config", "rope_interleaved"},
}
# Other decoder-only families, surveyed for keys that change their forward (`FORWARD`).
FOREIGN = {
    "gemma2": "Gemma2Config",
    "granite": "GraniteConfig",
    "phi3": "Phi3Config",
    "qwen2_moe": "Qwen2MoeConfig",
    "deepseek_v3": "DeepseekV3Config",
    "olmo2": "Olmo2Config",
    "cohere": "CohereConfig",
    "gpt_neox": "GPTNeoXConfig",
    "starcoder2": "Starcoder2Config",
    "falcon": "FalconConfig",
}
SHARED_MODULES = (
    "transformers.modeling_utils",
    "transformers.modeling_rope_utils",
    "transformers.masking_utils",
    "transformers.integrations.sdpa_attention",
    "transformers.cache_utils",
    "transformers.generation.utils",
)
_READS = (
    re.compile(r"config\.([A-Za-z_]\w*)"),
    re.compile(r"getattr\(\s*[\w.]*config\s*,\s*[\"']([A-Za-z_]\w*)[\"']"),
    re.compile(r"hasattr\(\s*[\w.]*config\s*,\s*[\"']([A-Za-z_]\w*)[\"']"),
    re.compile(r"[\"']([A-Za-z_]\w*)[\"']\s+in\s+[\w.]*config\b"),
)


def _reads(source: str) -> set[str]:
    return {m for pattern in _READS for m in pattern.findall(source)}


def _source(module: str) -> str:
    try:
        return inspect.getsource(importlib.import_module(module))
    except (ImportError, OSError, TypeError):
        return ""


def _attributes(cls) -> set[str]:
    keys = {p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "kwargs")}
    if dataclasses.is_dataclass(cls):
        keys |= {f.name for f in dataclasses.fields(cls)}
    keys |= set(cls().to_dict())
    return keys


def survey() -> dict:
    """What this interpreter's transformers says (run once per version)."""
    import transformers
    from transformers import GenerationConfig, PretrainedConfig

    common = _attributes(PretrainedConfig)
    # Its properties too (`torch_dtype`, 4.x's spelling of `dtype`), except 5.x's
    # heterogeneous-layer machinery (`per_layer_config` overrides layers: it changes the forward).
    common |= {
        name
        for name, _ in inspect.getmembers(PretrainedConfig, lambda m: isinstance(m, property))
        if "per_layer" not in name and "heterogeneous" not in name
    }
    generation = set(GenerationConfig().to_dict())
    legacy = getattr(PretrainedConfig, "_get_global_generation_defaults", None)
    if legacy is not None:
        generation |= set(legacy())
    try:
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

        gguf = set(GGUF_CONFIG_MAPPING["general"].values())
        gguf |= set(GGUF_CONFIG_MAPPING["tokenizer"].values())
    except (ImportError, KeyError):
        gguf = set()
    shared = set().union(*(_reads(_source(m)) for m in SHARED_MODULES))
    archs = {}
    for arch, (model_type, config_name) in ARCHS.items():
        cls = getattr(transformers, config_name)
        keys = _attributes(cls) - common
        source = _source(f"transformers.models.{model_type}.modeling_{model_type}")
        read = _reads(source) | shared
        for alias, real in getattr(cls, "attribute_map", {}).items():
            if alias in read or real in read:
                read |= {alias, real}
        archs[arch] = {"keys": sorted(keys), "read": sorted(read & (keys | common))}
        for key in PUBLISHED.get(arch, ()):
            assert key not in keys, f"{arch}: {key} is a config attribute now; review PUBLISHED"
            assert key not in _reads(source), f"{arch}: the modelling code reads {key}"
    forward: set[str] = set()
    for model_type, config_name in FOREIGN.items():
        cls = getattr(transformers, config_name, None)
        if cls is not None:
            source = _source(f"transformers.models.{model_type}.modeling_{model_type}")
            forward |= (_attributes(cls) - common) & _reads(source)
    return {
        "version": transformers.__version__,
        "common": sorted(common | generation | gguf),
        "archs": archs,
        "forward": sorted(forward),
    }


def merge(surveys: list[dict]) -> dict:
    common = set().union(*(set(s["common"]) for s in surveys))
    unread = {}
    for arch in ARCHS:
        keys = set().union(*(set(s["archs"][arch]["keys"]) for s in surveys)) - common
        reads = set().union(*(set(s["archs"][arch]["read"]) for s in surveys))
        unread[arch] = sorted((keys - reads) | PUBLISHED.get(arch, set()))
    forward = set().union(*(set(s["forward"]) for s in surveys)) - common
    return {
        "versions": [s["version"] for s in surveys],
        "common": sorted(common),
        "unread": unread,
        "forward": sorted(forward),
    }


def _frozen(keys: list[str], indent: str) -> str:
    lines = [f'{indent}    "{k}",' for k in keys]
    return (
        "frozenset(\n"
        + f"{indent}    [\n"
        + "\n".join("    " + x for x in lines)
        + (f"\n{indent}    ]\n{indent})")
    )


def render(data: dict) -> str:
    out = [
        '"""config.json keys, as transformers itself defines and reads them. Generated by',
        f"benchmarks/tools/make_hf_config_keys.py from transformers {', '.join(data['versions'])};",
        "do not edit (rerun the script).",
        "",
        "`COMMON`: `PretrainedConfig`'s own attributes, the generation parameters older configs",
        "carry, and the keys transformers' GGUF reader names from a file's metadata.",
        "`UNREAD[arch]`: the architecture's keys its modelling code never reads.",
        "`FORWARD`: keys other decoder families' modelling code reads (they change a forward).",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        '__all__ = ["COMMON", "FORWARD", "TRANSFORMERS_VERSIONS", "UNREAD"]',
        "",
        f"TRANSFORMERS_VERSIONS = {tuple(data['versions'])!r}",
        "",
        f"COMMON = {_frozen(data['common'], '')}",
    ]
    out.append("UNREAD: dict[str, frozenset[str]] = {")
    for arch, keys in data["unread"].items():
        out.append(f'    "{arch}": {_frozen(keys, "    ")},')
    out.append("}")
    out.append(f"FORWARD = {_frozen(data['forward'], '')}")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--legacy", type=Path, help="a transformers 4.x tree to survey too")
    parser.add_argument("--survey", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.survey:
        print(json.dumps(survey()))
        return
    surveys = [survey()]
    if args.legacy is not None:
        env = dict(os.environ, PYTHONPATH=str(args.legacy.resolve()))
        run = subprocess.run(
            [sys.executable, __file__, "--survey"], env=env, capture_output=True, text=True
        )
        if run.returncode:
            sys.exit(f"--legacy {args.legacy}: the survey failed:\n{run.stderr}")
        surveys.append(json.loads(run.stdout.strip().splitlines()[-1]))
    args.out.write_text(render(merge(surveys)))
    print(f"wrote {args.out} (transformers {', '.join(s['version'] for s in surveys)})")


if __name__ == "__main__":
    main()
