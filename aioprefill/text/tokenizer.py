"""`Tokenizer`: text to token ids and back, the ids transformers' tokenizer gives.

Built on Hugging Face `tokenizers` (the Rust library behind transformers' fast tokenizers), an
optional extra (`pip install 'aioprefill[tokenizer]'`). Two sources:

- a checkpoint directory: `tokenizer.json`, plus `tokenizer_config.json` (or
  `special_tokens_map.json`) for the BOS/EOS tokens. As in transformers 5, tokenizer.json's own
  post-processor decides which special tokens `encode` adds (`add_bos_token` in the config is
  ignored when a tokenizer.json exists), and `clean_up_tokenization_spaces` applies to
  non-BPE vocabularies only;
- a `.gguf` file's tokenizer metadata (`aioprefill.text.gguf_vocab`).

Long texts are tokenized off the event loop (`encode_async`, `encode_with_offsets_async`): the
library releases the GIL while it tokenizes, and the text is cut into pieces (`text.chunks`)
so the GIL is held for one piece's ids at a time (benchmarks/bench_tokenizer.py measures the
loop's lag).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aioprefill.errors import InvalidConfig, InvalidRequestType
from aioprefill.optional import import_optional
from aioprefill.text.chunks import PIECE_CHARS, cut, wrap_if_local

if TYPE_CHECKING:
    import tokenizers

__all__ = ["OFF_LOOP_CHARS", "TOKENIZER_EXTRA_HINT", "Tokenizer"]

TOKENIZER_EXTRA_HINT = "pip install 'aioprefill[tokenizer]'"
# Texts longer than this (in characters) are encoded in a thread by `encode_async`: ~16 KiB of
# text takes about a millisecond to encode, so shorter ones cost the loop less than the hand-off.
OFF_LOOP_CHARS = 16 * 1024


class Tokenizer:
    """Text to token ids and back (`Tokenizer.from_pretrained(dir_or_gguf)`).

    `vocab_size` counts every id the tokenizer can produce, added tokens included (transformers'
    `len(tokenizer)`). `name_or_path` is the absolute local path it was loaded from.
    """

    __slots__ = (
        "_backend",
        "_clean_up",
        "_wrap",
        "bos_token_id",
        "chat_template",
        "eos_token_id",
        "name_or_path",
        "special_tokens",
    )

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        name_or_path: str,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        clean_up_tokenization_spaces: bool = False,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        # transformers truncates and pads only when asked: a tokenizer.json's settings are not
        # applied by `encode`
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        self._wrap = wrap_if_local(backend)  # None: long texts are tokenized whole
        self.name_or_path = name_or_path
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self._clean_up = clean_up_tokenization_spaces
        # the model's chat template (None: it has none) and the special tokens' texts it may
        # use (`bos_token`, `eos_token`, `unk_token`, `pad_token`), as transformers passes them
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load from a checkpoint directory (its `tokenizer.json`) or a `.gguf` file.

        Raises `InvalidConfig` for a missing file, an unsupported tokenizer kind (named), or a
        missing optional dependency (naming the extra).
        """
        p = Path(path).expanduser().resolve()
        if p.is_file() and p.suffix == ".gguf":
            from aioprefill.text.gguf_vocab import gguf_tokenizer

            backend, info = gguf_tokenizer(p)
            return cls(backend, name_or_path=str(p), **info)
        if p.is_file() and p.name == "tokenizer.json":
            p = p.parent
        if not p.is_dir():
            raise InvalidConfig(
                f"Tokenizer.from_pretrained: {path!s} is neither a directory nor a .gguf file"
            )
        return cls._from_dir(p)

    @classmethod
    def _from_dir(cls, d: Path) -> Tokenizer:
        tk = import_optional("tokenizers", "tokenizer")
        file = d / "tokenizer.json"
        if not file.is_file():
            why = (
                " (only a sentencepiece tokenizer.model: not supported)"
                * (d / "tokenizer.model").is_file()
            )
            raise InvalidConfig(f"Tokenizer.from_pretrained: {d} has no tokenizer.json{why}")
        backend = tk.Tokenizer.from_file(str(file))
        config = _read_json(d / "tokenizer_config.json")
        special = _read_json(d / "special_tokens_map.json")
        bos = _token_text(config.get("bos_token", special.get("bos_token")))
        eos = _token_text(config.get("eos_token", special.get("eos_token")))
        bos_id = backend.token_to_id(bos) if bos is not None else None
        eos_id = backend.token_to_id(eos) if eos is not None else None
        special_texts = {
            f"{name}_token": text
            for name in ("bos", "eos", "unk", "pad")
            if (text := _token_text(config.get(f"{name}_token", special.get(f"{name}_token"))))
        }
        # transformers 5 decodes BPE vocabularies without its clean-up whatever the config says
        clean_up = bool(config.get("clean_up_tokenization_spaces")) and (
            type(backend.model).__name__ != "BPE"
        )
        return cls(
            backend,
            name_or_path=str(d),
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            clean_up_tokenization_spaces=clean_up,
            chat_template=_dir_chat_template(d, config),
            special_tokens=special_texts,
        )

    # ---- encoding ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, special tokens (e.g. a BOS) added as the tokenizer's config
        says unless `add_special_tokens=False`."""
        _check_text(text)
        ids: list[int] = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of each text (the library spreads them over its own threads)."""
        for text in texts:
            _check_text(text)
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def encode_with_offsets(
        self, text: str, add_special_tokens: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and each token's (start, end) character offsets into `text`; an added
        special token (BOS) spans (0, 0)."""
        _check_text(text)
        enc = self._backend.encode(text, add_special_tokens=add_special_tokens)
        return enc.ids, [(int(a), int(b)) for a, b in enc.offsets]

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode`, in a thread when `text` is longer than `OFF_LOOP_CHARS`, so the event loop
        never stalls for the whole tokenization of a long text."""
        _check_text(text)
        if len(text) <= OFF_LOOP_CHARS:
            return self.encode(text, add_special_tokens)
        return await asyncio.to_thread(self.encode_released, text, add_special_tokens)

    def encode_released(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode` for a worker thread, holding the GIL as little as it can.

        `encode_batch_fast` (tokenizers >= 0.20.1; else `encode_batch`) releases the GIL while
        it tokenizes (`encode` holds it throughout, `encode_batch` while it computes offsets);
        building the Python list of ids needs it, ~10-50 ns an id. So a long text is cut into
        ~16 KiB pieces where its tokens provably do not cross (`text.chunks`), tokenized
        one after the other, and the GIL is yielded between pieces."""
        _check_text(text)
        batch = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
        if self._wrap is None or len(text) <= 2 * PIECE_CHARS:
            ids: list[int] = batch([text], add_special_tokens=add_special_tokens)[0].ids
            return ids
        head, tail = self._wrap if add_special_tokens else ([], [])
        ids = list(head)
        for piece in cut(text):  # one at a time: one core, as a text tokenized whole takes
            ids += batch([piece], add_special_tokens=False)[0].ids
            time.sleep(0)  # a waiting event loop takes the GIL now, not after the 5 ms switch
        ids += tail
        return ids

    async def encode_with_offsets_async(
        self, text: str, add_special_tokens: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode_with_offsets`, in a thread (pieces as in `encode_released`) when `text` is
        longer than `OFF_LOOP_CHARS`: computing a 1 MB text's offsets holds the GIL ~0.2 s."""
        _check_text(text)
        if len(text) <= OFF_LOOP_CHARS:
            return self.encode_with_offsets(text, add_special_tokens)
        return await asyncio.to_thread(self._offsets_released, text, add_special_tokens)

    def _offsets_released(
        self, text: str, add_special_tokens: bool
    ) -> tuple[list[int], list[tuple[int, int]]]:
        wrap = self._wrap
        whole = wrap is None or len(text) <= 2 * PIECE_CHARS
        pieces = [text] if whole else cut(text)
        head, tail = wrap if wrap is not None and add_special_tokens and not whole else ([], [])
        ids, offsets = list(head), [(0, 0)] * len(head)
        start = 0
        for piece in pieces:
            enc = self._backend.encode_batch(
                [piece], add_special_tokens=whole and add_special_tokens
            )[0]
            ids += enc.ids
            offsets += [(start + a, start + b) for a, b in enc.offsets]
            start += len(piece)
            time.sleep(0)  # as in encode_released
        return ids + tail, offsets + [(0, 0)] * len(tail)  # as the post-processor gives them

    # ---- decoding ----------------------------------------------------------------------

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids` (transformers' `decode` with the tokenizer's own settings)."""
        text = str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))
        return _clean_up_spaces(text) if self._clean_up else text

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each token's own decoded text, as OpenAI's logprobs `tokens` show it (" Paris"); a
        token holding part of a UTF-8 character decodes to U+FFFD."""
        return [str(s) for s in self._backend.decode_batch([[int(i)] for i in ids], False)]

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size})"


def _check_text(text: object) -> None:
    if not isinstance(text, str):
        raise InvalidRequestType(f"text must be a str, got {type(text).__name__}")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_text(token: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a str or an AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _dir_chat_template(d: Path, config: dict[str, Any]) -> str | None:
    """A checkpoint's chat template as transformers finds it: `chat_template.jinja` first, then
    tokenizer_config.json's `chat_template` (a string, or named templates: the "default")."""
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    found = config.get("chat_template")
    if isinstance(found, list):
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        found = named.get("default")
    return found if isinstance(found, str) else None


def _clean_up_spaces(text: str) -> str:
    """transformers' `clean_up_tokenization`: drop the space before punctuation and English
    contractions."""
    for before, after in (
        (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
        (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
    ):  # fmt: skip
        text = text.replace(before, after)
    return text
