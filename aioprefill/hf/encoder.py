"""Encoders (BERT, RoBERTa / XLM-RoBERTa; ModernBERT's own parts in `hf.modernbert`) from Hugging
Face and sentence-transformers directories: `config.json` -> `PaddleModel` fields, the directory's
sentence-transformers modules (Pooling, Normalize, max_seq_length), and the checkpoint's tensor
names.

As for decoders (`hf.config`), every config.json key sets a field, is checked to hold the one
value the forward implements, or is known not to touch the forward; any other key raises
`InvalidConfig` naming it. Tensor names are transformers' own: the base model's under `bert.` /
`roberta.` in the *ForSequenceClassification and *ForMaskedLM checkpoints, unprefixed in the
base models (and in sentence-transformers directories); a base model's `pooler.*`, a masked-LM
head and the `embeddings.position_ids` buffer are accepted and never read (a *ForMaskedLM
checkpoint is its base model: an embedding model, as sentence-transformers loads it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from aioprefill.errors import InvalidConfig
from aioprefill.hf.modernbert import (
    MODERNBERT,
    modernbert_fields,
    modernbert_shapes,
    num_labels,
    refuse,
    refuse_unknown,
)
from aioprefill.hf.spec import SHAPE_KEYS, ModelShape

__all__ = [
    "ENCODERS",
    "encoder_fields",
    "encoder_ignored",
    "encoder_shapes",
    "sentence_transformers_fields",
    "sentence_transformers_prompts",
]

log = logging.getLogger("aioprefill.hf")

# HF class -> (model_type, base-model prefix of its tensor names, classifier head kind or "").
# A *ForMaskedLM checkpoint loads as its base model (an embedding model, as
# sentence-transformers' AutoModel reads it): the masked-LM head's tensors are not read.
# RoBERTa is XLM-R's forward (transformers' XLMRoberta* classes are copies of Roberta*).
ENCODERS: dict[str, tuple[str, str, str]] = {
    "BertModel": ("bert", "", ""),
    "BertForSequenceClassification": ("bert", "bert.", "bert"),
    "BertForMaskedLM": ("bert", "bert.", ""),
    "XLMRobertaModel": ("xlm-roberta", "", ""),
    "XLMRobertaForSequenceClassification": ("xlm-roberta", "roberta.", "roberta"),
    "XLMRobertaForMaskedLM": ("xlm-roberta", "roberta.", ""),
    "RobertaModel": ("roberta", "", ""),
    "RobertaForSequenceClassification": ("roberta", "roberta.", "roberta"),
    "RobertaForMaskedLM": ("roberta", "roberta.", ""),
    **MODERNBERT,  # hf.modernbert
}
# A masked-LM checkpoint's head, by its tensor names' first part: not read.
_MLM_HEADS = ("cls.predictions.", "lm_head.", "head.", "decoder.")
# transformers' BertConfig / XLMRobertaConfig defaults for absent keys.
_DEFAULTS: dict[str, Any] = {
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-12,
    "type_vocab_size": 2,
    "max_position_embeddings": 512,
    "position_embedding_type": "absolute",
    "pad_token_id": 0,
}
_COPIED = {
    **SHAPE_KEYS,
    "max_position_embeddings": "max_position_embeddings",
    "layer_norm_eps": "layer_norm_eps",
    "type_vocab_size": "type_vocab_size",
}
# Keys that must hold this value (else the forward differs): exact GELU, absolute positions.
_FIXED: dict[str, Any] = {"position_embedding_type": "absolute", "pruned_heads": {}}
_GELU = ("gelu", "gelu_python")
# Keys that do not change an inference forward: dropouts (training only), init range, caching
# and cross-attention flags of the decoder use (the encoder use reads neither), labels' names,
# the classifier's dropout, problem_type (the loss), tied embeddings (no LM head here).
_INERT = frozenset(
    {
        "attention_probs_dropout_prob",
        "hidden_dropout_prob",
        "classifier_dropout",
        "initializer_range",
        "use_cache",
        "gradient_checkpointing",
        "is_decoder",
        "add_cross_attention",
        "problem_type",
        "tie_word_embeddings",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "sep_token_id",
    }
)
_POOLING_KEYS = {"cls_token": "cls", "mean_tokens": "mean", "lasttoken": "last"}
_OTHER_POOLINGS = ("max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens")


def encoder_fields(config: dict[str, Any], arch: str) -> dict[str, Any]:
    """`PaddleModel` keyword arguments for an encoder's parsed `config.json` (`arch` one of
    `ENCODERS`), or `InvalidConfig` naming the first key whose setting is not implemented."""
    model_type, _, head = ENCODERS[arch]
    if model_type == "modernbert":
        return modernbert_fields(config, arch)
    if config.get("model_type", model_type) != model_type:
        raise refuse("model_type", f"{config['model_type']!r} does not match {arch}")
    c = {**_DEFAULTS, **config}
    if "quantization_config" in c:
        raise refuse("quantization_config", "quantized checkpoints are not supported")
    for key, value in _FIXED.items():
        if key in c and c[key] != value:
            raise refuse(key, f"{c[key]!r} is not supported (only {value!r})")
    if c["hidden_act"] not in _GELU:
        raise refuse("hidden_act", f"{c['hidden_act']!r} is not supported (only exact 'gelu')")
    fields: dict[str, Any] = {"architecture": arch}
    for field, key in _COPIED.items():
        if key not in c:
            raise refuse(key, "missing")
        fields[field] = c[key]
    fields["num_kv_heads"] = fields["num_heads"]
    if model_type in ("xlm-roberta", "roberta"):  # positions count from padding_idx + 1
        pad = c["pad_token_id"]
        if not isinstance(pad, int) or isinstance(pad, bool) or pad < 0:
            raise refuse("pad_token_id", f"must be a non-negative int, got {pad!r}")
        fields["position_offset"] = pad + 1
    used = {"architectures", "model_type", "hidden_act", *_COPIED.values(), *_FIXED}
    if head:
        labels = num_labels(c)
        fields["num_labels"] = labels
        used |= {"id2label", "label2id", "num_labels"}
    refuse_unknown(config, used | _INERT, arch)
    return fields


def sentence_transformers_fields(directory: Path) -> dict[str, Any]:
    """A sentence-transformers directory's settings (`modules.json`: the Pooling module's mode,
    a Normalize module, the Transformer's `sentence_bert_config.json` max_seq_length); for a
    plain Hugging Face directory the first token's state, un-normalised (what transformers'
    own pooler reads, and TEI's default). A module the forward does not implement (Dense, a pooling
    mode other than cls/mean/last token) raises `InvalidConfig` naming it."""
    modules_file = directory / "modules.json"
    if not modules_file.is_file():
        return {"pooling": "cls", "normalize": False}
    modules = _json(modules_file)
    if not isinstance(modules, list):
        raise InvalidConfig(f"{modules_file}: not a JSON list")
    fields: dict[str, Any] = {"pooling": "cls", "normalize": False}
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1] if isinstance(module, dict) else ""
        path = directory / str(module.get("path", "")) if isinstance(module, dict) else directory
        if kind == "Transformer":
            st_config = path / "sentence_bert_config.json"
            if not st_config.is_file():
                st_config = directory / "sentence_bert_config.json"
            if st_config.is_file():
                length = _json(st_config).get("max_seq_length")
                if length is not None:
                    fields["max_seq_length"] = int(length)
        elif kind == "Pooling":
            fields["pooling"] = _pooling(path / "config.json")
        elif kind == "Normalize":
            fields["normalize"] = True
        else:
            raise InvalidConfig(f"{modules_file}: module {kind or module!r} is not supported")
    return fields


def sentence_transformers_prompts(directory: Path) -> tuple[dict[str, str], str | None]:
    """A sentence-transformers directory's named prompts and its default prompt's name
    (`config_sentence_transformers.json`: `prompts`, `default_prompt_name`): the text that
    `SentenceTransformer.encode(prompt_name=...)` puts before each input before tokenizing it
    (E5's "query: ", Qwen3-Embedding's instruction). ({}, None) where the directory has none."""
    file = directory / "config_sentence_transformers.json"
    if not file.is_file():
        return {}, None
    config = _json(file)
    if not isinstance(config, dict):
        raise InvalidConfig(f"{file}: not a JSON object")
    prompts = config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()
    ):
        raise InvalidConfig(f"{file}: prompts must map names to strings")
    default = config.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise InvalidConfig(
            f"{file}: default_prompt_name {default!r} is not one of its prompts {sorted(prompts)}"
        )
    return dict(prompts), default


def _pooling(file: Path) -> str:
    config = _json(file)
    modes = [k for k in (*_POOLING_KEYS, *_OTHER_POOLINGS) if config.get(f"pooling_mode_{k}")]
    if len(modes) != 1 or modes[0] not in _POOLING_KEYS:
        raise InvalidConfig(
            f"{file}: pooling modes {modes}: exactly one of cls_token, mean_tokens, lasttoken "
            "is supported"
        )
    if config.get("include_prompt", True) is not True:
        raise InvalidConfig(f"{file}: include_prompt false is not supported")
    return _POOLING_KEYS[modes[0]]


def _json(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidConfig(f"{file}: not readable JSON ({exc})") from exc


def encoder_shapes(spec: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every tensor an encoder spec needs, by Hugging Face name (linear weights [out, in])."""
    model_type, base, head = ENCODERS[spec.architecture]
    if model_type == "modernbert":
        return modernbert_shapes(spec)
    h, ffn = spec.hidden_size, spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        f"{base}embeddings.word_embeddings.weight": (spec.vocab_size, h),
        f"{base}embeddings.position_embeddings.weight": (spec.max_position_embeddings, h),
        f"{base}embeddings.token_type_embeddings.weight": (spec.type_vocab_size, h),
        f"{base}embeddings.LayerNorm.weight": (h,),
        f"{base}embeddings.LayerNorm.bias": (h,),
    }
    layer = {
        "attention.self.query": (h, h),
        "attention.self.key": (h, h),
        "attention.self.value": (h, h),
        "attention.output.dense": (h, h),
        "attention.output.LayerNorm": None,
        "intermediate.dense": (ffn, h),
        "output.dense": (h, ffn),
        "output.LayerNorm": None,
    }
    for i in range(spec.num_layers):
        for name, shape in layer.items():
            p = f"{base}encoder.layer.{i}.{name}"
            shapes[f"{p}.weight"] = (h,) if shape is None else shape
            shapes[f"{p}.bias"] = (h,) if shape is None else (shape[0],)
    if head == "bert":  # pooler (first token, dense + tanh), then the classifier
        shapes.update({f"{base}pooler.dense.weight": (h, h), f"{base}pooler.dense.bias": (h,)})
        shapes.update({"classifier.weight": (spec.num_labels, h)})
        shapes["classifier.bias"] = (spec.num_labels,)
    elif head == "roberta":  # classifier.dense + tanh, then out_proj
        shapes.update({"classifier.dense.weight": (h, h), "classifier.dense.bias": (h,)})
        shapes["classifier.out_proj.weight"] = (spec.num_labels, h)
        shapes["classifier.out_proj.bias"] = (spec.num_labels,)
    return shapes


def encoder_ignored(name: str, spec: ModelShape) -> bool:
    """Stored tensors an encoder does not read: the position ids buffer, a base model's pooler,
    a masked-LM checkpoint's head."""
    model_type, base, head = ENCODERS[spec.architecture]
    if spec.architecture.endswith("ForMaskedLM") and name.startswith(_MLM_HEADS):
        return True
    if model_type == "modernbert":  # every other stored tensor is read
        return False
    return name.endswith("embeddings.position_ids") or (
        not head and name.startswith(f"{base}pooler.")
    )
