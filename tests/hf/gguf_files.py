"""Small GGUF files written with the `gguf` package's own writer (what llama.cpp's converter
uses), from Hugging Face-named weights: names mapped, Q/K rows permuted as
convert_hf_to_gguf.py does, tensors quantized to the type asked for."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from aioprefill.config import PaddleModel

_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{_BLOCK[rest]}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `LlamaModel.permute`: each head's [half 0 | half 1] rows
    interleaved into pairs."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def quantized(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """What a reader gets back from `w` stored as `qtype` (float32)."""
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype).astype(np.float32)


def write_gguf(
    path: Path,
    spec: PaddleModel,
    weights: dict[str, np.ndarray],
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    *,
    arch: str = "llama",
    extra: dict[str, object] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """`weights` (HF names) as a llama GGUF file: matrices stored as `qtype`, norms as F32 (as
    llama.cpp does), metadata from `spec` plus `extra` (key -> value)."""
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(spec.num_layers)
    w.add_context_length(spec.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size)
    w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_heads)
    w.add_head_count_kv(spec.num_kv_heads)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_vocab_size(spec.vocab_size)
    w.add_string("general.name", "test model")
    w.add_string("tokenizer.ggml.model", "gpt2")
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_float32(key, float(value))  # type: ignore[arg-type]
    for name, array in weights.items():
        if name.endswith("q_proj.weight"):
            array = permute(array, spec.num_heads)
        elif name.endswith("k_proj.weight"):
            array = permute(array, spec.num_kv_heads)
        if array.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(array, dtype=np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gguf_name(name), array.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    for name, array in (extra_tensors or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
