"""Hugging Face `config.json` -> `PaddleModel` fields, refusing whatever the forward would not
compute exactly.

Every key is accounted for: it sets a field, is checked to hold the one value the forward
implements, or is known not to touch the prefill forward (token ids, dropout, cache flags,
generation defaults). Any other key raises `InvalidConfig` naming it: a checkpoint either loads
and computes its own function, or does not load.
"""

from __future__ import annotations

import math
from typing import Any

from aioprefill.errors import InvalidConfig

__all__ = ["spec_fields"]

# HF class -> (model_type, the defaults transformers applies when a key is absent).
_ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "LlamaForCausalLM": ("llama", {"max_position_embeddings": 2048}),
    "MistralForCausalLM": (
        "mistral",
        {"max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    ),
    "Qwen2ForCausalLM": ("qwen2", {"max_position_embeddings": 32768}),
    "Qwen3ForCausalLM": ("qwen3", {"max_position_embeddings": 32768}),
    "MixtralForCausalLM": (
        "mixtral",
        {
            "max_position_embeddings": 4096 * 32,
            "sliding_window": None,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1e6,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
        },
    ),
}
_COMMON_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
# Keys with no effect on the prefill forward (ids, training-only, generation, bookkeeping).
_INERT = frozenset(
    [
        "architectures",
        "model_type",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "_name_or_path",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "initializer_range",
        "attention_dropout",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "pretraining_tp",
        "max_window_layers",
        "tokenizer_class",
        "id2label",
        "label2id",
        "problem_type",
        "task_specific_params",
        "is_encoder_decoder",
        "torchscript",
        "tf_legacy_loss",
        "use_bfloat16",
        "chunk_size_feed_forward",
        "add_cross_attention",
        "tie_encoder_decoder",
        "is_decoder",
        "pruned_heads",
        "finetuning_task",
        "prefix",
        "cross_attention_hidden_size",
        "_attn_implementation_autoset",
        "use_return_dict",
    ]
)
# Mixtral keys that only training reads: the router's jitter noise (applied in training mode
# alone), the load-balancing loss's weight, and whether the router logits are returned for it.
_MOE_TRAINING = frozenset(["router_jitter_noise", "router_aux_loss_coef", "output_router_logits"])
# Keys that must hold exactly this value (anything else changes the forward).
_FIXED = {"hidden_act": "silu", "mlp_bias": False, "partial_rotary_factor": 1.0}
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}


def _refuse(key: str, why: str) -> InvalidConfig:
    return InvalidConfig(f"config.json: {key}: {why}")


def spec_fields(config: dict[str, Any]) -> dict[str, Any]:
    """`PaddleModel` keyword arguments for a parsed `config.json`, or `InvalidConfig` naming the
    first key whose setting is not implemented."""
    archs = config.get("architectures")
    if not (isinstance(archs, list) and len(archs) == 1 and archs[0] in _ARCHITECTURES):
        raise _refuse(
            "architectures",
            f"{archs!r} is not supported; supported: {', '.join(_ARCHITECTURES)}",
        )
    arch = archs[0]
    model_type, defaults = _ARCHITECTURES[arch]
    if config.get("model_type", model_type) != model_type:
        raise _refuse("model_type", f"{config['model_type']!r} does not match {arch}")
    c = {**_COMMON_DEFAULTS, **defaults, **config}
    if "quantization_config" in c:
        raise _refuse("quantization_config", "quantized checkpoints are not supported")
    for key, value in _FIXED.items():
        if key in c and c[key] != value:
            raise _refuse(key, f"{c[key]!r} is not supported (only {value!r})")
    fields: dict[str, Any] = {"architecture": arch}
    for field, key in (
        ("num_layers", "num_hidden_layers"),
        ("hidden_size", "hidden_size"),
        ("num_heads", "num_attention_heads"),
        ("intermediate_size", "intermediate_size"),
        ("vocab_size", "vocab_size"),
        ("max_position_embeddings", "max_position_embeddings"),
        ("rms_norm_eps", "rms_norm_eps"),
        ("tie_word_embeddings", "tie_word_embeddings"),
    ):
        if key not in c:
            raise _refuse(key, "missing")
        fields[field] = c[key]
    fields["num_kv_heads"] = c.get("num_key_value_heads") or c["num_attention_heads"]
    if c.get("head_dim") is not None:
        fields["head_dim"] = c["head_dim"]
    used = {"num_key_value_heads", "head_dim", "quantization_config", *_FIXED, *_COMMON_DEFAULTS}
    used |= {"num_hidden_layers", "num_attention_heads", "architectures"}
    used |= set(fields)
    fields.update(_rope(c))
    used |= {"rope_theta", "rope_scaling", "rope_parameters"}
    fields.update(_attention(arch, c))
    used |= {"attention_bias", "sliding_window", "use_sliding_window", "layer_types"}
    if arch == "MixtralForCausalLM":
        fields.update(_experts(config, c))
        used |= {"num_local_experts", "num_experts", "num_experts_per_tok", *_MOE_TRAINING}
    for key in config:
        if key not in used and key not in _INERT:
            raise _refuse(key, f"not implemented for {arch} (it may change the forward)")
    return fields


def _rope(c: dict[str, Any]) -> dict[str, Any]:
    """RoPE from either spelling: `rope_parameters` (transformers >= 5) or the older top-level
    `rope_theta` + `rope_scaling` (Llama 3.1/3.2 files)."""
    params = c.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params = dict(c.get("rope_scaling") or {})
        key = "rope_scaling"
        params.setdefault("rope_theta", c["rope_theta"])
    if not isinstance(params, dict):
        raise _refuse(key, f"must be an object, got {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise _refuse(key, "per-layer-type RoPE settings are not supported")
    params = dict(params)
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in _ROPE_KEYS:
        raise _refuse(
            f"{key}.rope_type",
            f"{rope_type!r} is not supported; supported: {', '.join(_ROPE_KEYS)}",
        )
    theta = params.pop("rope_theta", c.get("rope_theta"))
    if not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise _refuse(f"{key}.rope_theta", f"must be a positive number, got {theta!r}")
    fields: dict[str, Any] = {"rope_theta": float(theta), "rope_type": rope_type}
    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse(f"{key}.partial_rotary_factor", "partial rotary embeddings are not supported")
    for name in sorted(_ROPE_KEYS[rope_type]):
        if name not in params:
            raise _refuse(f"{key}.{name}", f"missing for rope_type {rope_type!r}")
        value = params.pop(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _refuse(f"{key}.{name}", f"must be a number, got {value!r}")
        fields["rope_" + name] = value if name.startswith("original") else float(value)
    attention_factor = params.pop("attention_factor", None)
    if attention_factor not in (None, 1.0):
        raise _refuse(f"{key}.attention_factor", f"{attention_factor!r} is not supported")
    if params:
        raise _refuse(f"{key}.{sorted(params)[0]}", f"not implemented for rope_type {rope_type!r}")
    return fields


def _experts(config: dict[str, Any], c: dict[str, Any]) -> dict[str, Any]:
    """Mixtral's mixture of experts: `num_local_experts` (transformers also reads the alias
    `num_experts`) experts, `num_experts_per_tok` of them per token."""
    if "num_experts" in config:
        if "num_local_experts" in config and config["num_local_experts"] != config["num_experts"]:
            raise _refuse(
                "num_experts",
                f"{config['num_experts']!r} disagrees with num_local_experts "
                f"{config['num_local_experts']!r}",
            )
        c = {**c, "num_local_experts": config["num_experts"]}
    experts, per_token = c["num_local_experts"], c["num_experts_per_tok"]
    for key, value in (("num_local_experts", experts), ("num_experts_per_tok", per_token)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _refuse(key, f"must be a positive int, got {value!r}")
    if per_token > experts:
        raise _refuse("num_experts_per_tok", f"{per_token} exceeds num_local_experts {experts}")
    return {"num_experts": experts, "num_experts_per_tok": per_token}


def _attention(arch: str, c: dict[str, Any]) -> dict[str, Any]:
    """q/k/v bias, q/k norms and the sliding window, per architecture."""
    fields: dict[str, Any] = {
        "attention_bias": arch == "Qwen2ForCausalLM",  # Qwen2 hard-codes q/k/v bias, no o bias
        "qk_norm": arch == "Qwen3ForCausalLM",
    }
    if c.get("attention_bias", False):
        # Llama / Qwen3: the flag also adds an o_proj bias, which the forward has no place for.
        raise _refuse("attention_bias", f"true is not supported for {arch}")
    window = c.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not c.get("use_sliding_window", False):
        window = None  # transformers ignores the window unless use_sliding_window
    layer_types = c.get("layer_types")
    if layer_types is not None:
        kinds = set(layer_types)
        if not kinds <= {"full_attention", "sliding_attention"}:
            raise _refuse("layer_types", f"{sorted(kinds)} is not supported")
        if "sliding_attention" not in kinds:
            window = None
    if window is not None:
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise _refuse("sliding_window", f"must be a positive int or null, got {window!r}")
        # Prompts up to the window see every earlier token, so full causal attention is the same
        # function; longer prompts are refused (PaddleModel.max_prompt_tokens).
        fields["sliding_window"] = window
    return fields
