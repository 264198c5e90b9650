"""`EncoderText`: text to an encoder's input ids as sentence-transformers makes them.

An encoder (BERT, XLM-RoBERTa) reads its own special tokens around the text ([CLS] ... [SEP],
<s> ... </s>; a pair: [CLS] a [SEP] b [SEP] with token type 1 on b's part, or <s> a </s></s> b
</s>), which the directory's tokenizer.json post-processor adds. sentence-transformers
truncates to `max_seq_length` tokens counting those special tokens (transformers' tokenizer
with `truncation="longest_first", max_length=max_seq_length`: the ids are cut, the special
tokens kept; a pair is cut from its longer side first); `EncoderText` does the same with the
`tokenizers` library's own truncation, on a copy of the `Tokenizer`'s backend (whose `encode`
never truncates). The server uses `encode_pair` for rerank / score requests:
`engine.prefill(ids, token_type_ids=types)`.
"""

from __future__ import annotations

from typing import Any

from aioprefill.errors import InvalidConfig, InvalidRequestType
from aioprefill.optional import import_optional
from aioprefill.text.tokenizer import Tokenizer

__all__ = ["EncoderText"]


class EncoderText:
    """Truncating text to ids (and token type ids) for an encoder of `max_length` tokens."""

    __slots__ = ("_backend", "max_length", "tokenizer")

    def __init__(self, tokenizer: Tokenizer, max_length: int) -> None:
        if not isinstance(max_length, int) or max_length < 2:
            raise InvalidConfig(f"EncoderText.max_length must be an int >= 2, got {max_length!r}")
        tk = import_optional("tokenizers", "tokenizer")
        backend = tk.Tokenizer.from_str(tokenizer._backend.to_str())
        backend.no_padding()
        backend.enable_truncation(max_length, strategy="longest_first")
        self._backend = backend
        self.tokenizer = tokenizer
        self.max_length = max_length

    @classmethod
    def for_model(cls, tokenizer: Tokenizer, model: Any) -> EncoderText:
        """For an encoder `PaddleModel`: its `max_prompt_tokens` (sentence-transformers'
        max_seq_length within its position table)."""
        return cls(tokenizer, model.max_prompt_tokens)

    def encode(self, text: str) -> list[int]:
        """`text`'s ids with the model's special tokens, cut to `max_length`."""
        return list(self._backend.encode(_text(text)).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text (in parallel threads of the `tokenizers` library)."""
        return [list(e.ids) for e in self._backend.encode_batch([_text(t) for t in texts])]

    def encode_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """A (query, document) pair's ids and token type ids (0 on the first text's part and
        its special tokens, 1 on the second's where the model has token types), cut to
        `max_length` from the longer text first."""
        e = self._backend.encode(_text(first), _text(second))
        return list(e.ids), list(e.type_ids)

    def encode_pairs(self, pairs: list[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
        """`encode_pair` of each pair, in the library's threads."""
        done = self._backend.encode_batch([(_text(a), _text(b)) for a, b in pairs])
        return [(list(e.ids), list(e.type_ids)) for e in done]


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise InvalidRequestType(f"text must be a str, got {type(value).__name__}")
    return value
