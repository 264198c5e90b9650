"""Model weights as NumPy arrays: seeded random weights, and checkpoints (a safetensors file, or
a Hugging Face directory, single-file or sharded) checked against the spec and streamed.

Tensor names are Hugging Face's (`aioprefill.hf.tensors` owns them); the runner's loader
(`paddle.weights`) receives each tensor as `(layer, part, float32 array)` from `iter_weights` and
never sees a name.
`PaddleModel(seed=s)` means `random_weights(spec, s)`, which tests can call too, so a reference
forward shares the weights exactly.

Checkpoints are read by hand rather than with `safetensors.safe_open`: its NumPy side cannot
return bfloat16, and it maps each whole file, so a single-file checkpoint's pages stay resident
until the file closes. Here every file's header is checked first (names, shapes, dtypes, byte
ranges: a bad checkpoint fails before any tensor is read), then tensors are read one at a time
with plain reads in file order, so loading holds one tensor (plus the layer being assembled)
beyond what the device already has, whatever the file or shard sizes.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator

import numpy as np
from safetensors.numpy import save_file

from aioprefill.hf.spec import ModelShape
from aioprefill.hf.tensors import (
    WeightsError,
    check_shapes,
    checkpoint_files,
    expected_shapes,
    is_ignored,
    part_of,
)

__all__ = [
    "WeightsError",
    "check_shapes",
    "check_weights",
    "expected_shapes",
    "iter_weights",
    "load_weights",
    "model_weights",
    "random_weights",
    "save_weights",
]

# safetensors dtype -> how its bytes read (BF16: the top half of a float32, decoded below).
_DTYPES: dict[str, np.dtype] = {
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "BF16": np.dtype("<u2"),
}
_MAX_HEADER = 100 << 20


def random_weights(spec: ModelShape, seed: int) -> dict[str, np.ndarray]:
    """Seeded float32 weights: matrix entries with mean 0 and std 0.02, norm scales 1 with std
    0.1, biases 0 with std 0.1, all uniformly distributed (6x faster to draw than normals).

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
            if not name.endswith("bias"):  # a norm's scale (decoders: q/k/v_bias are biases)
                w += 1.0
        else:
            w *= 0.02 * np.sqrt(12.0, dtype=np.float32)
        weights[name] = w
    return weights


def iter_weights(spec: ModelShape) -> Iterator[tuple[int | None, str, np.ndarray]]:
    """`(layer, part, float32 array)` for every tensor the spec needs, from its checkpoint
    (checked whole before the first tensor is read) or its seed."""
    if spec.weights is None:
        for name, w in random_weights(spec, spec.seed).items():
            yield (*part_of(name), w)
        return
    if spec.weights.endswith(".gguf"):
        from aioprefill.hf.gguf_weights import iter_gguf

        yield from iter_gguf(spec)
        return
    for source, header, names in _plan(spec.weights, spec):
        with open(source, "rb") as f:
            for name in names:
                yield (*part_of(name), _read(f, source, name, header))


def load_weights(path: str | os.PathLike[str], spec: ModelShape) -> dict[str, np.ndarray]:
    """A checkpoint (file or directory) as float32 arrays by Hugging Face name, in the order of
    `expected_shapes`. F32, F16, F64 and BF16 tensors are accepted. Raises `WeightsError`
    naming the file and the offending tensor."""
    plan = _plan(path, spec)
    weights = {}
    for source, header, names in plan:
        with open(source, "rb") as f:
            for name in names:
                weights[name] = _read(f, source, name, header)
    return {name: weights[name] for name in expected_shapes(spec)}


def check_checkpoint(path: str | os.PathLike[str], spec: ModelShape) -> None:
    """Raise `WeightsError` unless the checkpoint holds the spec's tensors (headers only)."""
    _plan(path, spec)


def model_weights(spec: ModelShape) -> dict[str, np.ndarray]:
    """The weights a spec stands for: its checkpoint when `weights=` is set, else its seed's."""
    if spec.weights is not None and spec.weights.endswith(".gguf"):
        by_part = {(layer, part): w for layer, part, w in iter_weights(spec)}
        return {name: by_part[part_of(name)] for name in expected_shapes(spec)}
    if spec.weights is not None:
        return load_weights(spec.weights, spec)
    return random_weights(spec, spec.seed)


def check_weights(weights: dict[str, np.ndarray], spec: ModelShape, source: str) -> None:
    """Raise `WeightsError` unless `weights` holds exactly the spec's tensors with its shapes."""
    check_shapes({name: tuple(w.shape) for name, w in weights.items()}, spec, source)


def save_weights(path: str | os.PathLike[str], weights: dict[str, np.ndarray]) -> None:
    """Write `weights` (name -> array) as a safetensors file, arrays made contiguous."""
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, os.fspath(path))


# ---------------------------------------------------------------------- internals

_Header = dict[str, dict]


def _plan(path: str | os.PathLike[str], spec: ModelShape) -> list[tuple[str, _Header, list[str]]]:
    """Per file: its header and the tensors to read from it, in file order; all checked."""
    source = os.fspath(path)
    plan: list[tuple[str, _Header, list[str]]] = []
    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, str] = {}
    for file, assigned in checkpoint_files(source):
        header = _header(file)
        names = list(header) if assigned is None else assigned
        for name in names:
            if name not in header:
                raise WeightsError(f"{file}: the shard index puts {name!r} here; it is not")
            if name in where:
                raise WeightsError(f"{source}: tensor {name!r} is in {where[name]} and {file}")
            where[name] = file
            shapes[name] = tuple(header[name]["shape"])
        wanted = [n for n in names if not is_ignored(n, spec)]
        wanted.sort(key=lambda n: header[n]["data_offsets"][0])
        plan.append((file, header, wanted))
    check_shapes(shapes, spec, source)
    for file, header, names in plan:
        for name in names:
            if header[name]["dtype"] not in _DTYPES:
                raise WeightsError(
                    f"{file}: tensor {name!r} has dtype {header[name]['dtype']}, need a float type"
                )
    return plan


def _header(file: str) -> _Header:
    """A safetensors header: 8-byte little-endian length, then JSON {name: {dtype, shape,
    data_offsets}} (offsets relative to the data after it). Checked against the file size."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if not 2 <= length <= min(_MAX_HEADER, size - 8):
                raise ValueError(f"header length {length} does not fit a {size}-byte file")
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            width = _DTYPES[entry["dtype"]].itemsize if entry["dtype"] in _DTYPES else None
            count = int(np.prod(entry["shape"], dtype=np.int64))
            if not 0 <= begin <= end <= size - 8 - length:
                raise ValueError(f"tensor {name!r} lies outside the file")
            if width is not None and end - begin != count * width:
                raise ValueError(f"tensor {name!r}: {end - begin} bytes for {count} values")
            entry["data_offsets"] = [8 + length + begin, 8 + length + end]
        return header
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise WeightsError(f"{file}: not a readable safetensors file ({exc})") from exc


def _read(f, source: str, name: str, header: _Header) -> np.ndarray:
    """One tensor as a float32 array, read with a plain positioned read."""
    entry = header[name]
    begin, _ = entry["data_offsets"]
    raw = np.empty(entry["shape"], dtype=_DTYPES[entry["dtype"]])
    f.seek(begin)
    if f.readinto(raw.reshape(-1).view(np.uint8)) != raw.nbytes:
        raise WeightsError(f"{source}: tensor {name!r} is truncated")
    if entry["dtype"] == "BF16":  # NumPy has no bfloat16: its bits are a float32's top half
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw if raw.dtype == np.float32 else raw.astype(np.float32)
