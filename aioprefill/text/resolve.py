"""Text prompts: which tokenizer an engine uses (`EngineConfig(tokenizer=)`, resolved once at
construction) and a `str` prompt turned into token ids before the usual validation.

By default a `PaddleModel` whose `weights` is a checkpoint directory with a `tokenizer.json`, or
a `.gguf` file with tokenizer metadata, brings its tokenizer: what `PaddleModel.from_pretrained`
returns. Without the `tokenizers` package that default is simply absent (token ids need no
tokenizer); `prefill(str)` then says which extra to install.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import time
from pathlib import Path

import numpy as np

from aioprefill.errors import InvalidConfig, InvalidRequest
from aioprefill.models import ModelSpec, PaddleModel
from aioprefill.text.gguf_vocab import NoTokenizerInFile
from aioprefill.text.tokenizer import OFF_LOOP_CHARS, TOKENIZER_EXTRA_HINT, Tokenizer

__all__ = ["encode_text", "no_tokenizer", "resolve_tokenizer"]

log = logging.getLogger("aioprefill.text.resolve")
_SLICE = 1 << 14  # ids converted per GIL hold: ~0.5 ms


def resolve_tokenizer(value: object, model: ModelSpec) -> Tokenizer | None:
    """`EngineConfig.tokenizer` as given (None, a `Tokenizer`, or a path) to the `Tokenizer`
    the engine uses, or None; raises `InvalidConfig` naming the field."""
    if value is None:
        tokenizer = _from_checkpoint(model)
    elif isinstance(value, Tokenizer):
        tokenizer = value
    elif isinstance(value, (str, os.PathLike)):
        try:
            tokenizer = Tokenizer.from_pretrained(value)
        except InvalidConfig as exc:
            raise InvalidConfig(f"EngineConfig.tokenizer: {exc}") from exc
    else:
        raise InvalidConfig(
            "EngineConfig.tokenizer: must be None, a Tokenizer or the path of a checkpoint "
            f"directory or .gguf file; got {type(value).__name__}"
        )
    if tokenizer is not None and tokenizer.vocab_size > model.vocab_size:
        raise InvalidConfig(
            f"EngineConfig.tokenizer: {tokenizer.name_or_path} has {tokenizer.vocab_size} ids, "
            f"more than the model's vocab_size ({model.vocab_size})"
        )
    return tokenizer


def _from_checkpoint(model: ModelSpec) -> Tokenizer | None:
    if not isinstance(model, PaddleModel) or model.weights is None:
        return None
    path = Path(model.weights)
    has_tokenizer = (path / "tokenizer.json").is_file() or (
        path.is_file() and path.suffix == ".gguf"
    )
    if not has_tokenizer:
        return None
    if importlib.util.find_spec("tokenizers") is None:
        log.debug("%s: tokenizer not loaded, the tokenizers package is not installed", path)
        return None
    try:
        return Tokenizer.from_pretrained(path)
    except NoTokenizerInFile:
        return None
    except InvalidConfig as exc:
        raise InvalidConfig(f"EngineConfig.tokenizer: the model's own tokenizer: {exc}") from exc


async def encode_text(tokenizer: Tokenizer | None, text: str) -> list[int] | np.ndarray:
    """The ids of a `str` prompt (long texts tokenized off the loop), or `InvalidRequest`."""
    if tokenizer is None:
        raise no_tokenizer()
    if not text:
        raise InvalidRequest("prompt is an empty string")
    if len(text) <= OFF_LOOP_CHARS:
        return tokenizer.encode(text)
    return await asyncio.to_thread(_int32_ids, tokenizer, text)


def no_tokenizer() -> InvalidRequest:
    """The refusal of a `str` prompt on an engine without a tokenizer."""
    hint = ""
    if importlib.util.find_spec("tokenizers") is None:
        hint = f" (the tokenizers package is not installed: {TOKENIZER_EXTRA_HINT})"
    return InvalidRequest(
        "prompt is a str but this engine has no tokenizer: pass token ids, or "
        "EngineConfig(tokenizer=PATH) (a checkpoint directory with tokenizer.json or a "
        f".gguf file){hint}"
    )


def _int32_ids(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """In the thread: the ids as an int32 array, so that validating ~500k ids on the loop is a
    NumPy min/max (0.4 ms) instead of a scan over Python ints (70 ms). Converted a slice at a
    time, yielding the GIL between slices: one conversion of the whole list would hold it for
    ~20 ms, stalling the loop as long."""
    ids = tokenizer.encode_released(text)
    out = np.empty(len(ids), dtype=np.int32)
    for start in range(0, len(ids), _SLICE):
        out[start : start + _SLICE] = ids[start : start + _SLICE]
        time.sleep(0)  # lets a waiting event loop take the GIL now, not after 5 ms
    return out
