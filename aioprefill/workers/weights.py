"""Llama weights with Hugging Face tensor names: the expected shapes, seeded random weights, and
reading / writing / checking safetensors checkpoints.

Names and layouts are those of `transformers`' `LlamaForCausalLM` (linear weights are
`[out_features, in_features]`), so a real checkpoint of the right size loads as is. Everything
here is NumPy: the worker's runner moves the arrays onto its device. `PaddleModel(seed=s)` means
`random_weights(spec, s)`, which tests can call too, so a reference forward shares the weights
exactly.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from aioprefill.config import PaddleModel
from aioprefill.errors import InvalidConfig

__all__ = [
    "WeightsError",
    "expected_shapes",
    "load_weights",
    "model_weights",
    "random_weights",
    "save_weights",
]

# Older checkpoints store RoPE's inverse frequencies as a buffer; they are recomputed from
# rope_theta, so these tensors are accepted and ignored.
_IGNORED_SUFFIX = ".self_attn.rotary_emb.inv_freq"

_FLOAT_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64}


class WeightsError(InvalidConfig):
    """A checkpoint does not fit the model spec: a tensor is missing, unexpected or mis-shaped,
    or the file is unreadable. The message names the file and the tensor."""


def expected_shapes(spec: PaddleModel) -> dict[str, tuple[int, ...]]:
    """Every tensor the spec needs, by Hugging Face Llama (or, with experts, Mixtral) name, in a
    fixed order."""
    hidden, ffn, vocab = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    dim = spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (spec.num_heads * dim, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (spec.num_kv_heads * dim, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (spec.num_kv_heads * dim, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, spec.num_heads * dim)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        if spec.num_experts:  # Mixtral's names: w1 gate, w3 up, w2 down
            m = p + "block_sparse_moe."
            shapes[m + "gate.weight"] = (spec.num_experts, hidden)
            for e in range(spec.num_experts):
                shapes[f"{m}experts.{e}.w1.weight"] = (ffn, hidden)
                shapes[f"{m}experts.{e}.w2.weight"] = (hidden, ffn)
                shapes[f"{m}experts.{e}.w3.weight"] = (ffn, hidden)
            continue
        shapes[p + "mlp.gate_proj.weight"] = (ffn, hidden)
        shapes[p + "mlp.up_proj.weight"] = (ffn, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, ffn)
    shapes["model.norm.weight"] = (hidden,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def random_weights(spec: PaddleModel, seed: int) -> dict[str, np.ndarray]:
    """Seeded float32 weights: matrix entries with mean 0 and std 0.02, norm scales 1 with std
    0.1, all uniformly distributed (6x faster to draw than normals: ~0.1 s for the tiny model).

    The norm scales carry noise on purpose, so a forward that skipped or misapplied one would
    give different results. The same (spec, seed) always gives the same arrays.
    """
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    for name, shape in expected_shapes(spec).items():
        w = rng.random(shape, dtype=np.float32)  # U[0, 1): std 1/sqrt(12)
        w -= 0.5
        if len(shape) == 1:
            w *= 0.1 * np.sqrt(12.0, dtype=np.float32)
            w += 1.0
        else:
            w *= 0.02 * np.sqrt(12.0, dtype=np.float32)
        weights[name] = w
    return weights


def model_weights(spec: PaddleModel) -> dict[str, np.ndarray]:
    """The weights a spec stands for: its checkpoint when `weights=` is set, else its seed's."""
    if spec.weights is not None:
        return load_weights(spec.weights, spec)
    return random_weights(spec, spec.seed)


def check_weights(weights: dict[str, np.ndarray], spec: PaddleModel, source: str) -> None:
    """Raise `WeightsError` unless `weights` holds exactly the spec's tensors with its shapes."""
    _check_shapes({name: tuple(w.shape) for name, w in weights.items()}, spec, source)


def _check_shapes(shapes: dict[str, tuple[int, ...]], spec: PaddleModel, source: str) -> None:
    expected = expected_shapes(spec)
    names = {n for n in shapes if not n.endswith(_IGNORED_SUFFIX)}
    missing = [n for n in expected if n not in names]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightsError(f"{source}: missing tensor {missing[0]!r}{more}")
    unexpected = sorted(names - expected.keys())
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        hint = (
            "; the spec has tie_word_embeddings=True" if unexpected[0] == "lm_head.weight" else ""
        )
        raise WeightsError(f"{source}: unexpected tensor {unexpected[0]!r}{more}{hint}")
    for name, shape in expected.items():
        got = shapes[name]
        if got != shape:
            raise WeightsError(
                f"{source}: tensor {name!r} has shape {list(got)}, the spec needs {list(shape)}"
            )


def load_weights(path: str | os.PathLike[str], spec: PaddleModel) -> dict[str, np.ndarray]:
    """Read a safetensors checkpoint with Hugging Face Llama names as float32 arrays, checked
    against the spec (names and shapes) before any tensor data is read.

    F32, F16, F64 and BF16 tensors are accepted. Raises `WeightsError` naming the file and the
    offending tensor.
    """
    source = os.fspath(path)
    if not Path(source).is_file():
        raise WeightsError(f"{source}: no such weights file")
    wanted = expected_shapes(spec)
    weights: dict[str, np.ndarray] = {}
    try:
        with safe_open(source, framework="numpy") as f:
            dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
            _check_shapes({k: tuple(f.get_slice(k).get_shape()) for k in dtypes}, spec, source)
            for name in wanted:
                if dtypes[name] not in (*_FLOAT_DTYPES, "BF16"):
                    raise WeightsError(
                        f"{source}: tensor {name!r} has dtype {dtypes[name]}, need a float type"
                    )
                if dtypes[name] != "BF16":
                    weights[name] = np.ascontiguousarray(f.get_tensor(name), dtype=np.float32)
    except WeightsError:
        raise
    except Exception as exc:  # safetensors raises plain exceptions for corrupt files
        raise WeightsError(f"{source}: not a readable safetensors file ({exc})") from exc
    bf16 = [name for name in wanted if dtypes[name] == "BF16"]
    if bf16:
        weights.update(_read_bf16(source, bf16))
    return {name: weights[name] for name in wanted}


def _read_bf16(source: str, names: list[str]) -> dict[str, np.ndarray]:
    """Decode BF16 tensors (NumPy has no bfloat16): their bits are a float32's top half."""
    with open(source, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    data = np.memmap(source, dtype=np.uint8, mode="r", offset=8 + size)
    out = {}
    for name in names:
        begin, end = header[name]["data_offsets"]
        half = data[begin:end].view("<u2").astype(np.uint32) << 16
        out[name] = half.view(np.float32).reshape(header[name]["shape"])
    return out


def save_weights(path: str | os.PathLike[str], weights: dict[str, np.ndarray]) -> None:
    """Write `weights` (name -> array) as a safetensors file, arrays made contiguous."""
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, os.fspath(path))
