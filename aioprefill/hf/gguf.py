"""GGUF (llama.cpp's file format) to a `PaddleModel`: the config from the file's metadata, and
llama.cpp's tensor names mapped to Hugging Face's, checked from the header alone.

Only the Llama architecture (`general.architecture == "llama"`, dense) is read. As for
`config.json`, every metadata key is accounted for: `general.*` (names, licence, file type,
alignment), `tokenizer.*` (the tokenizer's) and `quantize.*` (how the file was quantized) do not
touch the forward; `llama.*` keys either set a field or are checked to hold the one value the
forward implements; any other key, a mixture of experts, a tensor this mapping does not know
(e.g. llama.cpp's `rope_freqs.weight` for Llama 3 RoPE) or a tensor type nothing here can
dequantize raises `InvalidConfig` naming it.

The weights are dequantized once, in the worker, at load (`workers/gguf_weights.py`): a Q4 file
grows about 8x in float32 (`dequantized_bytes`, logged by `from_pretrained`).
"""

from __future__ import annotations

import logging
import re
from functools import cache
from typing import Any

import numpy as np

from aioprefill.errors import InvalidConfig
from aioprefill.hf.gguf_file import GGUFHeader, read_header, type_name
from aioprefill.hf.spec import ModelShape
from aioprefill.hf.tensors import check_shapes

__all__ = [
    "FLOAT_TYPES",
    "check_tensors",
    "dequantized_bytes",
    "gguf_spec_fields",
    "hf_name",
    "log_size",
    "read_header",
    "readable_types",
    "unpermute",
]

log = logging.getLogger("aioprefill.hf")

# ggml types read without the `gguf` package: F32, F16, BF16, F64.
FLOAT_TYPES: dict[int, np.dtype] = {
    0: np.dtype("<f4"),
    1: np.dtype("<f2"),
    30: np.dtype("<u2"),
    28: np.dtype("<f8"),
}
_INERT_PREFIXES = ("general.", "tokenizer.", "quantize.")
# llama.* metadata -> PaddleModel field (required unless in _OPTIONAL).
_FIELDS = {
    "block_count": "num_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_heads",
    "attention.head_count_kv": "num_kv_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "context_length": "max_position_embeddings",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
    "attention.key_length": "head_dim",
}
_OPTIONAL = {"attention.head_count_kv", "rope.freq_base", "vocab_size", "attention.key_length"}
# llama.* keys checked rather than copied (value_length must equal the head dim, rope
# dimension_count too; the others must be absent or hold the value that means "off").
_CHECKED = {
    "attention.value_length",
    "rope.dimension_count",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",
    "rope.scaling.finetuned",  # a note about training; no effect on the forward
    "expert_count",
    "expert_used_count",
    "use_parallel_residual",
}
_OFF = {"expert_count": 0, "use_parallel_residual": False}

_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(.+)")


def _refuse(path: str, key: str, why: str) -> InvalidConfig:
    return InvalidConfig(f"{path}: {key}: {why}")


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name (None: not one this mapping knows)."""
    if name in _TOP:
        return _TOP[name]
    m = _BLOCK_NAME.fullmatch(name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"
    return None


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py's `LlamaModel.permute`).

    llama.cpp rotates pairs of adjacent dims (GPT-J style); Hugging Face rotates the two halves
    of each head. The converter reorders each head's rows from [half 0 | half 1] to interleaved
    pairs; this puts them back: `[heads, dim/2, 2, in] -> [heads, 2, dim/2, in]`."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@cache
def readable_types() -> dict[int, str]:
    """ggml type -> name for every type the loader can read: the float types, plus every type
    `gguf.quants.dequantize` implements (probed on one zero block; empty without `gguf`)."""
    readable = {t: type_name(t) for t in FLOAT_TYPES}
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize
    except ImportError:
        return readable
    for qtype, (_, width) in GGML_QUANT_SIZES.items():
        if int(qtype) in readable or qtype.name.startswith("I"):  # I8..I64: integers, not weights
            continue
        try:
            dequantize(np.zeros((1, width), dtype=np.uint8), GGMLQuantizationType(qtype))
        except (NotImplementedError, ValueError, KeyError):
            continue
        readable[int(qtype)] = qtype.name
    return readable


def gguf_spec_fields(header: GGUFHeader) -> dict[str, Any]:
    """`PaddleModel` keyword arguments (weights included) from a GGUF header, every tensor
    checked for name, shape and type; `InvalidConfig` naming the key, tensor or type."""
    md, path = header.metadata, header.path
    arch = md.get("general.architecture")
    if arch != "llama":
        raise _refuse(path, "general.architecture", f"{arch!r} is not supported; supported: llama")
    if int(md.get("split.count", 1)) != 1:
        raise _refuse(path, "split.count", "split GGUF files are not supported (merge them)")
    for key in md:
        rest = key.removeprefix("llama.")
        if key.startswith(_INERT_PREFIXES) or key in ("split.count", "split.no"):
            continue
        if rest == key or (rest not in _FIELDS and rest not in _CHECKED):
            raise _refuse(path, key, "not implemented for llama (it may change the forward)")
    for rest, off in _OFF.items():
        if md.get("llama." + rest, off) != off:
            raise _refuse(path, "llama." + rest, f"{md['llama.' + rest]!r} is not supported")
    fields: dict[str, Any] = {"architecture": "LlamaForCausalLM", "weights": path}
    for rest, field in _FIELDS.items():
        if "llama." + rest in md:
            value = md["llama." + rest]
            fields[field] = float(value) if isinstance(value, float) else int(value)
        elif rest not in _OPTIONAL:
            raise _refuse(path, "llama." + rest, "missing")
    fields.setdefault("num_kv_heads", fields["num_heads"])  # llama.cpp's default too
    fields["rms_norm_eps"] = float(fields["rms_norm_eps"])
    fields["rope_theta"] = float(fields.get("rope_theta", 10000.0))
    embed = header.tensors.get("token_embd.weight")
    if "vocab_size" not in fields and embed is not None:
        fields["vocab_size"] = embed.shape[0]
    head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_heads"]
    for rest in ("attention.value_length", "rope.dimension_count"):
        if md.get("llama." + rest, head_dim) != head_dim:
            raise _refuse(path, "llama." + rest, f"{md['llama.' + rest]} != head dim {head_dim}")
    fields.update(_rope_scaling(md, path))
    fields["tie_word_embeddings"] = "output.weight" not in header.tensors
    return fields


def _rope_scaling(md: dict[str, Any], path: str) -> dict[str, Any]:
    kind = md.get("llama.rope.scaling.type", "none")
    factor = float(md.get("llama.rope.scaling.factor", 1.0))
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return {"rope_type": "default"}
    if kind != "linear":
        raise _refuse(path, "llama.rope.scaling.type", f"{kind!r} is not supported (linear)")
    return {"rope_type": "linear", "rope_factor": factor}


def check_tensors(header: GGUFHeader, spec: ModelShape) -> None:
    """Raise `InvalidConfig` unless the file holds exactly the spec's tensors, each of a type the
    loader reads (naming the extra to install when only `gguf` is missing)."""
    shapes: dict[str, tuple[int, ...]] = {}
    readable = readable_types()
    for t in header.tensors.values():
        name = hf_name(t.name)
        if name is None:
            raise _refuse(header.path, t.name, "a tensor the llama mapping does not know")
        if t.ggml_type not in readable:
            hint = "" if len(readable) > len(FLOAT_TYPES) else "; pip install 'aioprefill[gguf]'"
            raise _refuse(header.path, t.name, f"tensor type {t.type_name} is not readable{hint}")
        shapes[name] = t.shape
    check_shapes(shapes, spec, header.path)


def dequantized_bytes(header: GGUFHeader, dtype: str) -> int:
    """Bytes the model's weights take once dequantized into `dtype` (as loaded on a device)."""
    width = np.dtype("float32" if dtype == "float32" else "float16").itemsize
    return sum(int(np.prod(t.shape)) for t in header.tensors.values()) * width


def log_size(header: GGUFHeader, dtype: str) -> None:
    size = sum(t.nbytes for t in header.tensors.values())
    full = dequantized_bytes(header, dtype)
    log.info(
        "%s: %.1f MiB of weights in the file, %.1f MiB dequantized to %s (%.1fx)",
        header.path,
        size / 2**20,
        full / 2**20,
        dtype,
        full / max(size, 1),
    )
