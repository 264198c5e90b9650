"""A `tokenizers.Tokenizer` built from a GGUF file's tokenizer metadata, as transformers builds it.

GGUF (llama.cpp's format) stores the vocabulary as metadata: `tokenizer.ggml.model` (its kind),
`.tokens`, `.token_type`, `.merges`, `.bos_token_id`, `.eos_token_id`, `.add_bos_token`...
Only the metadata is read, with plain `struct` (the tensors are never touched, and `gguf`'s
`GGUFReader` takes seconds building a memmap per vocabulary string).

Kind "gpt2" (byte-level BPE: SmolLM2, Llama 3, Qwen2...) is built the way transformers' GGUF
loader (`GGUFLlamaConverter`) does it: BPE over tokens and merges, control tokens (type 3) as
special added tokens, user-defined ones (type 4) as added tokens, a byte-level pre-tokenizer and
decoder, and `[BOS] $A` when `add_bos_token` (absent: True, `LlamaTokenizerFast`'s default).
`tokenizer.ggml.pre` (llama.cpp's name for the pre-tokenizer, which transformers ignores) is
followed where it only splits digits one by one ("smollm", "starcoder"...): that is how such a
vocabulary was trained, and as it holds no merge across digits the ids equal transformers'.
Kind "llama" (SentencePiece) and others are refused by name.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

from aioprefill.errors import InvalidConfig

__all__ = ["NoTokenizerInFile", "gguf_tokenizer", "read_metadata"]

_MAGIC = b"GGUF"
# Metadata value types (gguf.md): struct formats of the scalars; 8 is STRING, 9 is ARRAY.
_SCALARS = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True))
_STRING, _ARRAY = 8, 9
_CONTROL, _USER_DEFINED = 3, 4
# llama.cpp pre-tokenizers that split digits one at a time before the GPT-2 regex.
_DIGITS_FIRST = frozenset({"smollm", "starcoder", "codeshell", "refact"})


class NoTokenizerInFile(InvalidConfig):
    """The GGUF file holds weights but no vocabulary (no `tokenizer.ggml.model`)."""


def read_metadata(path: Path) -> dict[str, Any]:
    """Every metadata key of a GGUF (v2/v3, little-endian) file; arrays as lists."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != _MAGIC:
            raise InvalidConfig(f"{path}: not a GGUF file (no GGUF magic)")
        version, _n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise InvalidConfig(f"{path}: GGUF version {version} is not supported (2 or 3)")
        reader = _Reader(buf, 24)
        try:
            out = {}
            for _ in range(n_kv):
                key = reader.string()
                out[key] = reader.value(reader.take("I"))
            return out
        except (struct.error, UnicodeDecodeError, ValueError) as exc:
            raise InvalidConfig(f"{path}: malformed GGUF metadata ({exc})") from None


class _Reader:
    """A cursor over the metadata section."""

    def __init__(self, buf: mmap.mmap, pos: int) -> None:
        self.buf, self.pos = buf, pos

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        s = self.buf[self.pos : self.pos + n].decode("utf-8")
        self.pos += n
        return s

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            inner, count = self.take("I"), self.take("Q")
            if count > len(self.buf):
                raise ValueError(f"an array claims {count} elements")
            if inner in _SCALARS:  # one unpack for the whole array
                fmt = f"<{count}{_SCALARS[inner]}"
                values = list(struct.unpack_from(fmt, self.buf, self.pos))
                self.pos += struct.calcsize(fmt)
                return values
            return [self.value(inner) for _ in range(count)]
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        raise ValueError(f"unknown metadata value type {kind}")


def gguf_tokenizer(path: Path) -> tuple[Any, dict[str, Any]]:
    """The backend tokenizer of a GGUF file and the `Tokenizer` keyword fields (bos/eos ids,
    decode clean-up) that go with it."""
    from aioprefill.tokenizer import bos_eos_template, import_optional

    tk = import_optional("tokenizers", "tokenizer")
    meta = read_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise NoTokenizerInFile(
            f"{path}: the GGUF file holds no tokenizer (no tokenizer.ggml.model)"
        )
    if kind != "gpt2":
        raise InvalidConfig(
            f"{path}: GGUF tokenizer model {kind!r} is not supported (only 'gpt2', byte-level "
            "BPE); load the tokenizer from a checkpoint directory's tokenizer.json instead"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    model = tk.models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True)
    backend = tk.Tokenizer(model)
    backend.add_special_tokens(
        [
            tk.AddedToken(t, normalized=False, special=True)
            for t, k in zip(tokens, types, strict=True)
            if k == _CONTROL
        ]
    )
    backend.add_tokens(
        [
            tk.AddedToken(t, normalized=False, special=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _USER_DEFINED
        ]
    )
    byte_level = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False)
    if meta.get("tokenizer.ggml.pre") in _DIGITS_FIRST:
        digits = tk.pre_tokenizers.Digits(individual_digits=True)
        backend.pre_tokenizer = tk.pre_tokenizers.Sequence([digits, byte_level])
    else:
        backend.pre_tokenizer = byte_level
    d = tk.decoders
    backend.decoder = d.Sequence(
        [d.ByteFallback(), d.Fuse(), d.Replace("\u2581", " "), d.ByteLevel()]
    )
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    bos = tokens[bos_id] if bos_id is not None and bos_id < len(tokens) else None
    eos = tokens[eos_id] if eos_id is not None and eos_id < len(tokens) else None
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = bos_eos_template(tk, (bos, bos_id, add_bos), (eos, eos_id, add_eos))
    # transformers' GGUF loader turns clean_up_tokenization_spaces on for byte-level vocabularies.
    info = {"bos_token_id": bos_id, "eos_token_id": eos_id, "clean_up_tokenization_spaces": True}
    return backend, info
