"""A `tokenizers.Tokenizer` built from a GGUF file's tokenizer metadata, as transformers builds it.

GGUF (llama.cpp's format) stores the vocabulary as metadata: `tokenizer.ggml.model` (its kind),
`.tokens`, `.token_type`, `.merges`, `.bos_token_id`, `.eos_token_id`, `.add_bos_token`...
Only the header is read, by `hf.gguf_file` with plain `struct` (the tensors are never touched,
and `gguf`'s `GGUFReader` takes seconds building a memmap per vocabulary string).

Kind "gpt2" (byte-level BPE: SmolLM2, Llama 3, Qwen2...) is built the way transformers' GGUF
loader builds it (`integrations/gguf`, transformers 5): `GPT2Tokenizer`'s BPE over the tokens
(respelled in the byte alphabet where a file stores plain text) and merges, control tokens
(type 3) as special added tokens, user-defined ones (type 4) as plain added tokens, the byte-level
pre-tokenizer with the text split `tokenizer.ggml.pre` names, and `[BOS] $A [EOS]` as
`add_bos_token` / `add_eos_token` say (absent: neither). Kind "llama" (SentencePiece BPE: Llama 2,
Mistral) is built as transformers builds it from the tokens' scores; other kinds are refused by
name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from aioprefill.errors import InvalidConfig
from aioprefill.hf.gguf_file import read_header
from aioprefill.optional import import_optional

__all__ = ["KNOWN_SPLITS", "NoTokenizerInFile", "gguf_tokenizer", "read_metadata"]

# token_type values (gguf.md)
_CONTROL, _USER_DEFINED = 3, 4
# The text splits of llama.cpp's pre-tokenizer names (`tokenizer.ggml.pre`), as transformers'
# GGUF loader maps them (integrations/gguf/gguf_tokenizer_mapping.py; the patterns are the ones
# in these models' own tokenizer.json). Any other name: GPT-2's split, as there.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2),
}
KNOWN_SPLITS = frozenset(_SPLITS.values())


class NoTokenizerInFile(InvalidConfig):
    """The GGUF file holds weights but no vocabulary (no `tokenizer.ggml.model`)."""


def read_metadata(path: Path) -> dict[str, Any]:
    """Every metadata key of a GGUF file (`hf.gguf_file`'s header, parsed once and cached, so the
    weights' loader and the tokenizer read the file once); number arrays as lists."""
    meta = read_header(path).metadata
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in meta.items()}


def gguf_tokenizer(path: Path) -> tuple[Any, dict[str, Any]]:
    """The backend tokenizer of a GGUF file and the `Tokenizer` keyword fields (bos/eos ids)
    that go with it."""

    tk = import_optional("tokenizers", "tokenizer")
    meta = read_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in meta:
        raise NoTokenizerInFile(
            f"{path}: the GGUF file holds no tokenizer (no tokenizer.ggml.model or .tokens)"
        )
    if kind not in ("gpt2", "llama"):
        raise InvalidConfig(
            f"{path}: GGUF tokenizer model {kind!r} is not supported (only 'gpt2', byte-level "
            "BPE, and 'llama', SentencePiece BPE); load the tokenizer from a checkpoint "
            "directory's tokenizer.json instead"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type", [])
    backend = (_byte_level if kind == "gpt2" else _sentencepiece)(tk, meta, tokens)
    vocab = backend.get_vocab(with_added_tokens=False)
    # Control tokens stay whole, as special tokens (in a byte-level vocabulary, not one spelled
    # outside the byte alphabet: a llama.cpp mislabel, adding it would grow the vocabulary); so
    # do the bos/eos/unk/pad tokens the file names; user-defined ones as plain added tokens.
    keys = (f"tokenizer.ggml.{k}_token_id" for k in ("bos", "eos", "unknown", "padding"))
    named: list[int] = sorted({meta[k] for k in keys if k in meta})
    special = [
        t
        for t, k in zip(tokens, types, strict=False)
        if k == _CONTROL and (kind != "gpt2" or set(t) <= _ALPHABET)
    ]
    special += [tokens[i] for i in named if i < len(tokens)]
    backend.add_special_tokens([tk.AddedToken(t, normalized=False, special=True) for t in special])
    backend.add_tokens(
        [
            tk.AddedToken(t, normalized=False, special=False)
            for t, k in zip(tokens, types, strict=False)
            if k == _USER_DEFINED and t in vocab
        ]
    )
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    bos = tokens[bos_id] if bos_id is not None and bos_id < len(tokens) else None
    eos = tokens[eos_id] if eos_id is not None and eos_id < len(tokens) else None
    # absent: a BOS for SentencePiece vocabularies (llama.cpp's default), none for byte-level
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    backend.post_processor = bos_eos_template(tk, (bos, bos_id, add_bos), (eos, eos_id, add_eos))
    texts = {
        f"{name}_token": tokens[i]
        for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))
        if isinstance(i := meta.get(f"tokenizer.ggml.{key}_token_id"), int) and i < len(tokens)
    }
    template = meta.get("tokenizer.chat_template")
    return backend, {
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "chat_template": template if isinstance(template, str) else None,
        "special_tokens": texts,
    }


def _byte_level(tk: Any, meta: dict[str, Any], tokens: list[str]) -> Any:
    """transformers' `GPT2Tokenizer` over the file's vocabulary and merges, with the text split
    `tokenizer.ggml.pre` names."""
    vocab = {_byte_level_spelling(t): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = tk.Tokenizer(tk.models.BPE(vocab, merges, fuse_unk=False))
    split = _SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    byte_level = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    if split is not None:
        regex = tk.pre_tokenizers.Split(tk.Regex(split), behavior="isolated")
        backend.pre_tokenizer = tk.pre_tokenizers.Sequence([regex, byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = tk.decoders.ByteLevel()
    return backend


def _sentencepiece(tk: Any, meta: dict[str, Any], tokens: list[str]) -> Any:
    """transformers' `LlamaTokenizer` (legacy=False): BPE with byte fallback over the file's
    vocabulary, its merges given or recovered from the scores, "▁" for spaces, prepended
    once at the start unless `add_space_prefix` is false."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    else:
        scores = dict(zip(tokens, meta["tokenizer.ggml.scores"], strict=True))
        merges = _merges_from_scores(vocab, scores)
    model = tk.models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True)
    backend = tk.Tokenizer(model)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = tk.pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    d = tk.decoders
    steps = [d.Replace("▁", " "), d.ByteFallback(), d.Fuse()]
    backend.decoder = d.Sequence([*steps, d.Strip(content=" ", left=1)] if prefix else steps)
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies (transformers' `generate_merges`): every
    split of a token into two tokens, the token's score deciding the order, best first."""
    found: list[tuple[str, str, float]] = []
    for token, score in scores.items():
        local = [
            (token[:i], token[i:], score)
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found += local
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the others (space, control
    characters...) for the code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(moved)}}


_BYTE_CHARS = _bytes_to_unicode()
_ALPHABET = frozenset(_BYTE_CHARS.values())


def _byte_level_spelling(token: str) -> str:
    """A token as the byte-level model looks it up: some files store a token in plain text
    (a space, a newline) instead of in the byte alphabet."""
    if set(token) <= _ALPHABET:
        return token
    return "".join(_BYTE_CHARS[b] for b in token.encode("utf-8"))


def bos_eos_template(
    tk: Any, bos: tuple[str | None, int | None, bool], eos: tuple[str | None, int | None, bool]
) -> Any:
    """The post-processor transformers' Llama-style tokenizers build: `[BOS] $A [EOS]` with
    each of BOS/EOS present when its flag is set."""
    single, pair, special = "$A:0", "$B:1", []
    for (text, token_id, on), at_start in ((bos, True), (eos, False)):
        if not on:
            continue
        if text is None or token_id is None:
            which = "bos" if at_start else "eos"
            raise InvalidConfig(f"add_{which}_token is set but the tokenizer has no {which} token")
        special.append((text, token_id))
        if at_start:
            single, pair = f"{text}:0 {single}", f"{text}:1 {pair}"
        else:
            single, pair = f"{single} {text}:0", f"{pair} {text}:1"
    return tk.processors.TemplateProcessing(
        single=single, pair=f"{single} {pair}", special_tokens=special
    )
