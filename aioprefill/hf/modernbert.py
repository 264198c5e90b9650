"""ModernBERT (`ModernBertModel`, `ModernBertForSequenceClassification`, `ModernBertForMaskedLM`):
`config.json` -> `PaddleModel` fields, and the checkpoint's tensor names (`hf.encoder` dispatches
here).

What the forward implements, as transformers 5.24's modeling_modernbert.py computes it: token
embeddings then a LayerNorm without bias (no positions table: RoPE on queries and keys), pre-norm
layers (layer 0 has no attention norm), a fused `Wqkv`, a GeGLU MLP (`Wi` -> split -> gelu(input)
* gate -> `Wo`), a final norm; layer i attends globally where i % global_attn_every_n_layers
== 0 (RoPE theta `global_rope_theta`), else within a window (a token sees the keys at most
local_attention // 2 positions away; RoPE theta `local_rope_theta`). The classifier pools the
last hidden states (`classifier_pooling`: first token or mean), then dense -> gelu ->
LayerNorm -> classifier (with bias).

Configs come in two shapes: the Hub's (`global_attn_every_n_layers`, `global_rope_theta`,
`local_rope_theta`) and what transformers 5 saves (`layer_types`, `rope_parameters` per layer
type). Both are read; the biases (`attention_bias`, `mlp_bias`, `norm_bias`,
`classifier_bias`), activations other than exact GELU, RoPE scaling and any unknown key raise
`InvalidConfig` naming the key.
"""

from __future__ import annotations

from typing import Any

from aioprefill.errors import InvalidConfig
from aioprefill.hf.config_keys import COMMON
from aioprefill.hf.spec import SHAPE_KEYS, ModelShape

__all__ = [
    "MODERNBERT",
    "modernbert_fields",
    "modernbert_shapes",
    "num_labels",
    "refuse",
    "refuse_unknown",
]

# HF class -> (model_type, base-model prefix of its tensor names, classifier head kind or "").
MODERNBERT: dict[str, tuple[str, str, str]] = {
    "ModernBertModel": ("modernbert", "", ""),
    "ModernBertForSequenceClassification": ("modernbert", "model.", "modernbert"),
    # the base checkpoints' class (answerdotai/ModernBERT-*): its base model; `head.*` and
    # `decoder.*` (the masked-LM head) are not read (hf.encoder.encoder_ignored)
    "ModernBertForMaskedLM": ("modernbert", "model.", ""),
}
# ModernBertConfig's defaults for the keys read here.
_DEFAULTS: dict[str, Any] = {
    "hidden_activation": "gelu",
    "classifier_activation": "gelu",
    "norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "local_attention": 128,
    "global_attn_every_n_layers": 3,
    "global_rope_theta": 160000.0,
    "local_rope_theta": 10000.0,
    "classifier_pooling": "cls",
}
_COPIED = SHAPE_KEYS  # ModernBERT copies no more
_NO_BIAS = ("attention_bias", "mlp_bias", "norm_bias", "classifier_bias")
_GELU = ("gelu", "gelu_python")
_LAYER_TYPES = ("full_attention", "sliding_attention")
# Keys that do not change the forward of these two classes: dropouts, init, the masked-LM
# head's (decoder_bias, sparse_*), attention-kernel choices (flash's determinism, compile,
# unpadding), special token ids, tied embeddings (no LM head here), the loss; and two keys the
# Hub's configs carry from BERT that ModernBERT's code never reads (layer_norm_eps: its norms
# read norm_eps; position_embedding_type: its positions are always RoPE).
_INERT = frozenset(
    {
        "attention_dropout",
        "embedding_dropout",
        "mlp_dropout",
        "classifier_dropout",
        "initializer_range",
        "initializer_cutoff_factor",
        "decoder_bias",
        "sparse_prediction",
        "sparse_pred_ignore_index",
        "deterministic_flash_attn",
        "reference_compile",
        "repad_logits_with_grad",
        "gradient_checkpointing",
        "use_cache",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "cls_token_id",
        "sep_token_id",
        "tie_word_embeddings",
        "problem_type",
        "layer_norm_eps",
        "position_embedding_type",
    }
)


def refuse(key: str, why: str) -> InvalidConfig:
    """A checkpoint's config.json key this reader will not take (the encoders' one error)."""
    return InvalidConfig(f"config.json: {key}: {why}")


def refuse_unknown(config: dict[str, Any], known: set[str] | frozenset[str], arch: str) -> None:
    """Raise `refuse` for the first key of `config` that is neither `known` (read or inert for
    this architecture) nor common to every config.json (`hf.config_keys.COMMON`)."""
    for key in config:
        if key not in known and key not in COMMON:
            raise refuse(key, f"not implemented for {arch} (it may change the forward)")


def modernbert_fields(config: dict[str, Any], arch: str) -> dict[str, Any]:
    """`PaddleModel` keyword arguments for a ModernBERT `config.json` (`arch` one of
    `MODERNBERT`), or `InvalidConfig` naming the first key whose setting is not implemented."""
    model_type, _, head = MODERNBERT[arch]
    if config.get("model_type", model_type) != model_type:
        raise refuse("model_type", f"{config['model_type']!r} does not match {arch}")
    c = {**_DEFAULTS, **config}
    if "quantization_config" in c:
        raise refuse("quantization_config", "quantized checkpoints are not supported")
    for key in _NO_BIAS:
        if c.get(key, False) is not False:
            raise refuse(key, f"{c[key]!r} is not supported (only false: no biases)")
    for key in ("hidden_activation", "classifier_activation"):
        if c[key] not in _GELU:
            raise refuse(key, f"{c[key]!r} is not supported (only exact 'gelu')")
    fields: dict[str, Any] = {"architecture": arch}
    for field, key in _COPIED.items():
        if key not in c:
            raise refuse(key, "missing")
        fields[field] = c[key]
    fields["num_kv_heads"] = fields["num_heads"]
    head_dim = c.get("head_dim")
    if head_dim is not None and head_dim * fields["num_heads"] != fields["hidden_size"]:
        raise refuse("head_dim", f"{head_dim} is not hidden_size // num_attention_heads")
    fields["max_position_embeddings"] = c["max_position_embeddings"]
    fields["layer_norm_eps"] = c["norm_eps"]
    fields["type_vocab_size"] = 1  # no token types: a pair's type ids are not read
    window = c["local_attention"]
    if not isinstance(window, int) or isinstance(window, bool) or window < 2:
        raise refuse("local_attention", f"must be an int >= 2, got {window!r}")
    fields["local_attention"] = window
    fields["global_attn_every_n_layers"] = _every_n(c, fields["num_layers"])
    fields["rope_theta"], fields["local_rope_theta"] = _thetas(c)
    used = {
        "architectures", "model_type", "hidden_activation", "classifier_activation", "head_dim",
        "max_position_embeddings", "norm_eps", "local_attention", "global_attn_every_n_layers",
        "layer_types", "rope_parameters", "rope_scaling", "global_rope_theta", "local_rope_theta",
        "classifier_pooling", *_COPIED.values(), *_NO_BIAS,
    }  # fmt: skip
    if head:
        fields["num_labels"] = num_labels(c)
        pooling = c["classifier_pooling"]
        if pooling not in ("cls", "mean"):
            raise refuse("classifier_pooling", f"{pooling!r} is not 'cls' or 'mean'")
        fields["classifier_pooling"] = pooling
        used |= {"id2label", "label2id", "num_labels"}
    refuse_unknown(config, used | _INERT, arch)
    return fields


def _every_n(c: dict[str, Any], layers: int) -> int:
    """Every how many layers one attends globally: `global_attn_every_n_layers`, or the period of
    `layer_types` (what transformers 5 saves) when it has one."""
    n = c["global_attn_every_n_layers"]
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise refuse("global_attn_every_n_layers", f"must be a positive int, got {n!r}")
    types = c.get("layer_types")
    if types is None:
        return n
    if not isinstance(types, list) or len(types) != layers or not set(types) <= set(_LAYER_TYPES):
        raise refuse("layer_types", f"must list {layers} of {_LAYER_TYPES}, got {types!r}")

    def pattern(k: int) -> list[str]:
        return [_LAYER_TYPES[bool(i % k)] for i in range(layers)]

    for k in (n, *range(1, layers + 1)):
        if types == pattern(k):
            return k
    raise refuse("layer_types", "only a global layer every n layers (from layer 0) is implemented")


def _thetas(c: dict[str, Any]) -> tuple[float, float]:
    """(global, local) RoPE theta: `rope_parameters` per layer type where given (transformers
    5), else `global_rope_theta` / `local_rope_theta` (a null local theta: the global one, as
    transformers 4 read it)."""
    if c.get("rope_scaling") is not None:
        raise refuse("rope_scaling", f"{c['rope_scaling']!r}: RoPE scaling is not implemented")
    glob, local = c["global_rope_theta"], c["local_rope_theta"]
    if local is None:
        local = glob
    params = c.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or not set(params) <= set(_LAYER_TYPES):
            raise refuse("rope_parameters", f"must map {_LAYER_TYPES} to parameters: {params!r}")
        found = []
        for kind, default in zip(_LAYER_TYPES, (glob, local), strict=True):
            p = params.get(kind) or {}
            if not isinstance(p, dict) or not set(p) <= {"rope_type", "rope_theta"}:
                raise refuse("rope_parameters", f"{kind}: only rope_theta is implemented: {p!r}")
            if p.get("rope_type", "default") != "default":
                raise refuse("rope_parameters", f"{kind}: rope_type {p['rope_type']!r}")
            found.append(p.get("rope_theta", default))
        glob, local = found
    for key, theta in (("global_rope_theta", glob), ("local_rope_theta", local)):
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
            raise refuse(key, f"must be a positive number, got {theta!r}")
    return float(glob), float(local)


def num_labels(c: dict[str, Any]) -> int:
    """transformers' rule: `id2label`'s size when given, else `num_labels`, else 2."""
    if isinstance(c.get("id2label"), dict):
        return len(c["id2label"])
    labels = c.get("num_labels", 2)
    if not isinstance(labels, int) or isinstance(labels, bool) or labels < 1:
        raise refuse("num_labels", f"must be a positive int, got {labels!r}")
    return labels


def modernbert_shapes(spec: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every tensor a ModernBERT spec needs, by Hugging Face name (linear weights [out, in];
    no biases but the classifier's)."""
    _, base, head = MODERNBERT[spec.architecture]
    h, ffn = spec.hidden_size, spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        f"{base}embeddings.tok_embeddings.weight": (spec.vocab_size, h),
        f"{base}embeddings.norm.weight": (h,),
        f"{base}final_norm.weight": (h,),
    }
    for i in range(spec.num_layers):
        p = f"{base}layers.{i}."
        shapes[p + "attn.Wqkv.weight"] = (3 * h, h)
        shapes[p + "attn.Wo.weight"] = (h, h)
        if i:  # layer 0 reads the embeddings' norm instead
            shapes[p + "attn_norm.weight"] = (h,)
        shapes[p + "mlp_norm.weight"] = (h,)
        shapes[p + "mlp.Wi.weight"] = (2 * ffn, h)
        shapes[p + "mlp.Wo.weight"] = (h, ffn)
    if head:
        shapes["head.dense.weight"] = (h, h)
        shapes["head.norm.weight"] = (h,)
        shapes["classifier.weight"] = (spec.num_labels, h)
        shapes["classifier.bias"] = (spec.num_labels,)
    return shapes
