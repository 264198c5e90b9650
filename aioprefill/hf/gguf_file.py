"""A GGUF file's header: its metadata and its tensors' names, types, shapes and byte ranges.

Read with plain `struct` from the first bytes of the file (the tensor data is never touched),
so the engine process can check a GGUF model without NumPy's memmap of ~100k vocabulary
strings that `gguf.GGUFReader` builds, and without the optional `gguf` package at all for
float files.

Layout (GGUF v2/v3, little-endian; https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):
`b"GGUF"`, u32 version, u64 tensor count, u64 metadata count; each metadata entry a string key,
a u32 value type and the value (strings are a u64 length then UTF-8 bytes; arrays a u32 element
type, a u64 count, the elements); each tensor a string name, a u32 dimension count, that many
u64 dimensions (innermost first: `[in_features, out_features]` for a linear weight), a u32
ggml type and a u64 offset into the data section, which starts at the next multiple of
`general.alignment` (default 32) after the header.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from aioprefill.errors import InvalidConfig

__all__ = ["GGML_TYPES", "GGUFHeader", "GGUFTensor", "read_header", "type_name"]

_MAGIC = b"GGUF"
# Metadata value types: struct format of the scalars (8 STRING and 9 ARRAY are handled apart).
_SCALARS = {
    **{0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?"},
    **{10: "Q", 11: "q", 12: "d"},
}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
# ggml tensor types: name, elements per block, bytes per block. The list is ggml's
# (ggml.h, `enum ggml_type`; the same as `gguf.GGMLQuantizationType` / `GGML_QUANT_SIZES`);
# which of them can be read is decided by the loader (float types, and whatever
# `gguf.quants.dequantize` implements).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
}
_MAX_COUNT = 1 << 28  # larger than any real vocabulary: a corrupt count fails fast


def type_name(ggml_type: int) -> str:
    """`Q4_1` for 3; `type 99` for a type this table does not know."""
    return GGML_TYPES[ggml_type][0] if ggml_type in GGML_TYPES else f"type {ggml_type}"


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor's entry: `shape` in NumPy order (outermost first: `[out, in]` for a linear
    weight, as Hugging Face stores it), `begin` its absolute byte offset in the file."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    begin: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    path: str
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]


class _Short(Exception):
    """The header runs past the bytes read so far."""


class _Cursor:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise _Short

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        self.need(size)
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        self.need(n)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="surrogateescape")

    def strings(self, count: int) -> list[str]:
        """`count` strings (a vocabulary: ~50k), in one tight loop."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        length = _U64.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise _Short
            (n,) = length(buf, pos)
            pos += 8
            if pos + n > end:
                raise _Short
            out.append(buf[pos : pos + n].decode("utf-8", errors="surrogateescape"))
            pos += n
        self.pos = pos
        return out

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("I"), self.take("Q")
            if count > _MAX_COUNT:
                raise ValueError(f"an array of {count} elements")
            if item in _SCALARS and item != 7:  # numbers: one NumPy view, not count objects
                dtype = np.dtype("<" + _SCALARS[item])
                self.need(dtype.itemsize * count)
                out = np.frombuffer(self.buf, dtype, count, self.pos).copy()
                self.pos += dtype.itemsize * count
                return out
            if item == _STRING:
                return self.strings(count)
            return [self.value(item) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {kind}")


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """The header of a GGUF file, checked against the file's size; `InvalidConfig` naming the
    file when it is not a readable GGUF file. The file is mapped, so only the header's pages
    are read. Kept for the file's (mtime, size): `from_pretrained` and `EngineConfig` both
    read it, and parsing a 50k-token vocabulary costs ~0.2 s. Do not modify the result."""
    source = os.fspath(path)
    try:
        st = os.stat(source)
    except OSError as exc:
        raise InvalidConfig(f"{source}: not a readable GGUF file ({exc})") from exc
    return _read(source, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _read(source: str, mtime_ns: int, size: int) -> GGUFHeader:
    try:
        with open(source, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != _MAGIC:
                raise ValueError("no GGUF magic")
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (big-endian or unknown)")
            try:
                return _parse(source, buf, version, n_tensors, n_kv)
            except _Short:
                raise ValueError("the header runs past the end of the file") from None
    except (OSError, ValueError, UnicodeError, TypeError, struct.error) as exc:
        raise InvalidConfig(f"{source}: not a readable GGUF file ({exc})") from exc


def _parse(source: str, buf: mmap.mmap, version: int, n_tensors: int, n_kv: int) -> GGUFHeader:
    size = len(buf)
    c = _Cursor(buf)
    c.pos = 24
    if n_kv > _MAX_COUNT or n_tensors > _MAX_COUNT:
        raise ValueError(f"{n_kv} metadata entries, {n_tensors} tensors")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        metadata[key] = c.value(c.take("I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = [c.take("Q") for _ in range(c.take("I"))]
        infos.append((name, dims, c.take("I"), c.take("Q")))
    alignment = int(metadata.get("general.alignment", 32))
    if alignment < 1:
        raise ValueError(f"general.alignment {alignment}")
    start = -(-c.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, kind, offset in infos:
        if name in tensors:
            raise ValueError(f"tensor {name!r} appears twice")
        count = int(np.prod(dims, dtype=np.int64))
        if kind in GGML_TYPES:
            _, block, width = GGML_TYPES[kind]
            if not dims or dims[0] % block:
                raise ValueError(f"tensor {name!r}: rows of {dims[:1]} values, blocks of {block}")
            nbytes = count // block * width
        else:
            nbytes = 0  # unknown type: refused by name by the loader, never read
        begin = start + offset
        if begin + nbytes > size:
            raise ValueError(f"tensor {name!r} lies outside the file")
        tensors[name] = GGUFTensor(name, kind, tuple(reversed(dims)), begin, nbytes)
    return GGUFHeader(source, version, metadata, tensors)
