"""Long texts cut where their tokenization provably does not cross, so a thread can hand the ids
back to Python a piece at a time.

Why: `tokenizers` releases the GIL while it tokenizes, but holds it while it builds the Python
list of ids: ~10-50 ns an id, 5-25 ms for the 500k ids of a 1 MB text, during which the event
loop cannot run. Tokenized as pieces of ~16 KiB, each piece's list takes well under a
millisecond, and the thread yields the GIL between pieces (the pieces are also tokenized in
parallel by the library's own threads).

Where it is exact: a cut at a space between two letters (`word| next`). The tokenizer must be a
BPE model whose merges stay inside pre-tokenized pieces, with no normalizer or only NFC (which
composes a letter with the marks after it, never across a space), a pre-tokenizer made of GPT-2's
byte-level split (`ByteLevel(use_regex=True)`), the Llama 3 or Qwen2 split (`Split`, isolated),
`Digits` and a byte-level mapping, and no added token that holds a space or strips the spaces
around it. Every such split ends a
piece at a letter followed by a space (no pattern puts a letter and the space after it in one
piece) and starts the next piece at that space, and none looks back past it: so the pieces, and
their tokens, are the same with the text cut there. The special tokens the post-processor adds
(a BOS) are added once, around the whole. Any other tokenizer, or a text with no such space,
is tokenized whole.
"""

from __future__ import annotations

import json
from typing import Any

from aioprefill.text.gguf_vocab import KNOWN_SPLITS

__all__ = ["PIECE_CHARS", "Wrap", "cut", "wrap_if_local"]

PIECE_CHARS = 16 * 1024
# The special ids a post-processor puts before and after a text.
Wrap = tuple[list[int], list[int]]


def wrap_if_local(backend: Any) -> Wrap | None:
    """The special ids `backend` adds around a text, when its tokenization is local at
    letter-space-letter (see the module docstring); None when it may not be."""
    if type(backend.model).__name__ != "BPE":
        return None
    normalizer = backend.normalizer
    if normalizer is not None and _state(normalizer) != {"type": "NFC"}:
        return None
    pre = backend.pre_tokenizer
    if pre is None or not _local_pre_tokenizer(_state(pre)):
        return None
    for token in backend.get_added_tokens_decoder().values():
        if " " in token.content or token.lstrip or token.rstrip:  # may match across a cut
            return None
    bare = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    for i in range(len(full) - len(bare) + 1):
        if full[i : i + len(bare)] == bare:
            return full[:i], full[i + len(bare) :]
    return None


def _state(component: Any) -> Any:
    return json.loads(component.__getstate__())


def _local_pre_tokenizer(state: dict[str, Any]) -> bool:
    parts = state["pretokenizers"] if state.get("type") == "Sequence" else [state]
    splits = 0
    for part in parts:
        kind = part.get("type")
        if kind == "ByteLevel":
            splits += bool(part.get("use_regex"))
        elif kind == "Split":
            pattern = part.get("pattern", {}).get("Regex")
            if pattern not in KNOWN_SPLITS or part.get("behavior") != "Isolated":
                return False
            if part.get("invert"):
                return False
            splits += 1
        elif kind != "Digits":
            return False
    return splits > 0  # something must split the text: without it merges may span spaces


def cut(text: str, size: int = PIECE_CHARS) -> list[str]:
    """`text` in pieces of about `size` characters, each cut just before a space that sits
    between two letters; a piece grows until it finds one."""
    pieces, start = [], 0
    at = size
    while at < len(text):
        space = text.find(" ", at, len(text) - 1)
        if space < 0:
            break
        if text[space - 1].isalpha() and text[space + 1].isalpha():  # str.isalpha is \p{L}
            pieces.append(text[start:space])
            start, at = space, space + size
        else:
            at = space + 1
    pieces.append(text[start:])
    return pieces
