"""Hugging Face tensor names and checkpoint files: which tensors a spec needs under which names,
what each name means to the runner, and where a checkpoint's tensors live.

The runner knows a tensor by its *part*: `embed`, `norm`, `lm_head`, and per layer `q`, `k`, `v`,
`o`, `gate`, `up`, `down`, `in_norm`, `post_norm` (plus `q_bias`, `k_bias`, `v_bias` with
`attention_bias`, `q_norm`, `k_norm` with `qk_norm`; a mixture of experts has `router` and
`expert.{e}.w1` / `w2` / `w3` in place of `gate`, `up`, `down`). This module maps those to the
names that Llama, Mistral, Qwen2 and Qwen3 checkpoints share (linear weights
`[out_features, in_features]`), and Mixtral's for the experts.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from aioprefill.errors import InvalidConfig
from aioprefill.hf.encoder import ENCODERS, encoder_ignored, encoder_shapes
from aioprefill.hf.spec import ModelShape

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "WeightsError",
    "check_shapes",
    "checkpoint_files",
    "expected_shapes",
    "is_ignored",
    "layer_parts",
    "part_of",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_GLOBAL = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight"}
_LM_HEAD = "lm_head.weight"
_LAYER = {
    "in_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "post_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}
_BY_SUFFIX = {suffix: part for part, suffix in _LAYER.items()}
_ROUTER = "block_sparse_moe.gate.weight"
_EXPERT = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
_LAYER_PREFIX = "model.layers."
# Older checkpoints store RoPE's inverse frequencies as a buffer; they are recomputed from the
# spec's RoPE settings, so these tensors are accepted and never read.
_IGNORED_SUFFIX = ".self_attn.rotary_emb.inv_freq"


class WeightsError(InvalidConfig):
    """A checkpoint does not fit the model spec: a tensor is missing, unexpected or mis-shaped,
    or the file is unreadable. The message names the file and the tensor."""


def layer_parts(spec: ModelShape) -> tuple[str, ...]:
    """The parts every decoder layer of this spec has."""
    parts: tuple[str, ...] = ("in_norm", "q", "k", "v", "o", "post_norm", "gate", "up", "down")
    if spec.attention_bias:
        parts += ("q_bias", "k_bias", "v_bias")
    if spec.qk_norm:
        parts += ("q_norm", "k_norm")
    if spec.num_experts:  # Mixtral: w1 gate, w3 up, w2 down, per expert
        experts = (f"expert.{e}.{w}" for e in range(spec.num_experts) for w in ("w1", "w2", "w3"))
        parts = (*(p for p in parts if p not in ("gate", "up", "down")), "router", *experts)
    return parts


def _suffix(part: str) -> str:
    if part.startswith("expert."):
        _, e, w = part.split(".")
        return f"block_sparse_moe.experts.{e}.{w}.weight"
    return _ROUTER if part == "router" else _LAYER[part]


def expected_shapes(spec: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every tensor the spec needs, by Hugging Face name, in a fixed order. A tied spec needs no
    `lm_head.weight` (one stored anyway is ignored, as `transformers` ties it to the embedding).
    An encoder's are `hf.encoder`'s."""
    if spec.architecture in ENCODERS:
        return encoder_shapes(spec)
    hidden, ffn, vocab, dim = (
        spec.hidden_size,
        spec.intermediate_size,
        spec.vocab_size,
        spec.head_dim,
    )
    q_out, kv_out = spec.num_heads * dim, spec.num_kv_heads * dim
    layer = {
        "in_norm": (hidden,),
        "q": (q_out, hidden),
        "k": (kv_out, hidden),
        "v": (kv_out, hidden),
        "o": (hidden, q_out),
        "post_norm": (hidden,),
        "gate": (ffn, hidden),
        "up": (ffn, hidden),
        "down": (hidden, ffn),
        "q_bias": (q_out,),
        "k_bias": (kv_out,),
        "v_bias": (kv_out,),
        "q_norm": (dim,),
        "k_norm": (dim,),
        "router": (spec.num_experts, hidden),
    }
    for e in range(spec.num_experts):
        layer.update({f"expert.{e}.w1": (ffn, hidden), f"expert.{e}.w3": (ffn, hidden)})
        layer[f"expert.{e}.w2"] = (hidden, ffn)
    shapes: dict[str, tuple[int, ...]] = {_GLOBAL["embed"]: (vocab, hidden)}
    for i in range(spec.num_layers):
        for part in layer_parts(spec):
            shapes[f"{_LAYER_PREFIX}{i}.{_suffix(part)}"] = layer[part]
    shapes[_GLOBAL["norm"]] = (hidden,)
    if not spec.tie_word_embeddings:
        shapes[_LM_HEAD] = (vocab, hidden)
    return shapes


def is_ignored(name: str, spec: ModelShape) -> bool:
    """A stored tensor the spec does not read: RoPE buffers, and `lm_head.weight` when tied."""
    if spec.architecture in ENCODERS:
        return encoder_ignored(name, spec)
    return name.endswith(_IGNORED_SUFFIX) or (spec.tie_word_embeddings and name == _LM_HEAD)


def part_of(name: str) -> tuple[int | None, str]:
    """`(layer, part)` of a Hugging Face tensor name (layer None for embed / norm / lm_head)."""
    if name == _LM_HEAD:
        return None, "lm_head"
    for part, full in _GLOBAL.items():
        if name == full:
            return None, part
    if name.startswith(_LAYER_PREFIX):
        index, _, suffix = name[len(_LAYER_PREFIX) :].partition(".")
        if index.isdigit() and suffix in _BY_SUFFIX:
            return int(index), _BY_SUFFIX[suffix]
        if index.isdigit() and suffix == _ROUTER:
            return int(index), "router"
        if index.isdigit() and (expert := _EXPERT.fullmatch(suffix)):
            return int(index), f"expert.{expert.group(1)}.{expert.group(2)}"
    raise KeyError(name)


def checkpoint_files(path: str | os.PathLike[str]) -> list[tuple[str, list[str] | None]]:
    """The safetensors files of a checkpoint, each with the tensor names the index assigns it
    (None: all of the file's). `path` is a `.safetensors` file or a directory holding
    `model.safetensors` or `model.safetensors.index.json` plus its shards."""
    source = os.fspath(path)
    p = Path(source)
    if p.is_file():
        return [(source, None)]
    if not p.is_dir():
        raise WeightsError(f"{source}: no such weights file or checkpoint directory")
    if (p / INDEX_FILE).is_file():
        index_path = p / INDEX_FILE
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise WeightsError(f"{index_path}: not a readable shard index ({exc})") from exc
        shards: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(str(shard), []).append(name)
        for shard in shards:
            if Path(shard).name != shard or not (p / shard).is_file():
                raise WeightsError(f"{index_path}: shard {shard!r} is not a file in {source}")
        return [(str(p / shard), names) for shard, names in sorted(shards.items())]
    if (p / SINGLE_FILE).is_file():
        return [(str(p / SINGLE_FILE), None)]
    raise WeightsError(f"{source}: a checkpoint directory needs {SINGLE_FILE} or {INDEX_FILE}")


def check_shapes(shapes: dict[str, tuple[int, ...]], spec: ModelShape, source: str) -> None:
    """Raise `WeightsError` unless `shapes` (Hugging Face name -> shape) are the spec's tensors,
    ignored ones aside."""
    expected = expected_shapes(spec)
    names = {n for n in shapes if not is_ignored(n, spec)}
    missing = [n for n in expected if n not in names]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightsError(f"{source}: missing tensor {missing[0]!r}{more}")
    unexpected = sorted(names - expected.keys())
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise WeightsError(f"{source}: unexpected tensor {unexpected[0]!r}{more}")
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise WeightsError(
                f"{source}: tensor {name!r} has shape {list(shapes[name])}, "
                f"the spec needs {list(shape)}"
            )
