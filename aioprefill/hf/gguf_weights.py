"""GGUF weights, worker side: each tensor read, dequantized and put into Hugging Face's layout,
one at a time, in file order.

`weights.iter_weights` hands a `.gguf` spec here; what comes out is what a safetensors checkpoint
gives, `(layer, part, float32 array)`, so `paddle.weights` casts it into the spec's dtype and
the rest of the loader never knows the file was quantized. Quantized tensors are dequantized by
`gguf.quants.dequantize` (the code transformers' own GGUF loading uses, so a reference made
with transformers sees the same weights bit for bit), a few MiB of rows at a time into the
tensor's float32 array: loading holds one dequantized tensor beyond what the device already
has, never the whole model twice. llama.cpp's Q/K row permutation is undone here
(`hf.gguf.unpermute`).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import numpy as np

from aioprefill.hf.gguf import (
    FLOAT_TYPES,
    check_tensors,
    hf_name,
    read_header,
    unpermute,
)
from aioprefill.hf.gguf_file import GGML_TYPES, GGUFTensor
from aioprefill.hf.spec import ModelShape
from aioprefill.hf.tensors import WeightsError, is_ignored, part_of

__all__ = ["iter_gguf", "read_tensor"]

log = logging.getLogger("aioprefill.hf")
_CHUNK_BYTES = 4 << 20  # raw bytes dequantized per step: bounds the dequantizer's temporaries


def iter_gguf(spec: ModelShape) -> Iterator[tuple[int | None, str, np.ndarray]]:
    """`(layer, part, float32 array)` for every tensor of the spec's GGUF file, checked whole
    (header) before the first tensor is read."""
    assert spec.weights is not None
    header = read_header(spec.weights)
    check_tensors(header, spec)
    heads = {"q": spec.num_heads, "k": spec.num_kv_heads}
    total = 0
    with open(header.path, "rb") as f:
        for t in sorted(header.tensors.values(), key=lambda t: t.begin):
            name = hf_name(t.name)
            assert name is not None  # check_tensors refused unknown names
            if is_ignored(name, spec):
                continue
            layer, part = part_of(name)
            w = read_tensor(f, header.path, t)
            if part in heads:
                w = unpermute(w, heads[part])
            total += w.size
            yield layer, part, w
    log.info(
        "%s: dequantized %.0f MiB of float32 weights (on the device: %s)",
        header.path,
        total * 4 / 2**20,
        spec.dtype,
    )


def read_tensor(f: io.BufferedReader, source: str, t: GGUFTensor) -> np.ndarray:
    """One GGUF tensor as a float32 array of `t.shape`, read with positioned plain reads."""
    f.seek(t.begin)
    if t.ggml_type in FLOAT_TYPES:
        raw = np.empty(t.shape, dtype=FLOAT_TYPES[t.ggml_type])
        _fill(f, source, t, raw.reshape(-1).view(np.uint8))
        if t.type_name == "BF16":  # NumPy has no bfloat16: its bits are a float32's top half
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return raw if raw.dtype == np.float32 else raw.astype(np.float32)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(t.ggml_type)
    _, block, width = GGML_TYPES[t.ggml_type]
    out = np.empty(t.shape, dtype=np.float32)
    rows = out.reshape(-1, t.shape[-1])
    row_bytes = t.shape[-1] // block * width
    step = max(1, _CHUNK_BYTES // row_bytes)
    raw = np.empty((min(step, len(rows)), row_bytes), dtype=np.uint8)
    for start in range(0, len(rows), step):
        n = min(step, len(rows) - start)
        _fill(f, source, t, raw[:n].reshape(-1))
        rows[start : start + n] = dequantize(raw[:n], qtype)
    return out


def _fill(f: io.BufferedReader, source: str, t: GGUFTensor, buf: np.ndarray) -> None:
    if f.readinto(buf.data) != buf.nbytes:
        raise WeightsError(f"{source}: tensor {t.name!r} is truncated")
