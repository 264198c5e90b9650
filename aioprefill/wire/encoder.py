"""An encoder model's request options, engine side (`parse_outputs` hands them here).

An encoder (BERT, XLM-RoBERTa: `PaddleModel.is_encoder`) answers every request with its pooled
embedding (the model's own pooling and Normalize unless the request's `embed=` / `normalize=`
say otherwise) and, for a classifier, its logits (`r.scores`); it has no next token (`r.token`
-1, `r.logprob` 0.0). Options that need a next-token distribution or a KV cache are refused
here, naming the option, before anything is queued. `token_type_ids` (BERT's segment ids for a
sentence pair) travel as one uint8 per token.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aioprefill.errors import InvalidRequest, InvalidRequestType
from aioprefill.wire import protocol

__all__ = ["ENCODER_EMBED_BITS", "OPT_EMBED_CLS", "encoder_bits", "token_types_bytes"]

# One more OPT_* bit of `protocol.PrefillBatch.options` (kept with the encoders' wire details):
OPT_EMBED_CLS = 128  # an encoder's last hidden state of the first token ([CLS] / <s>)

ENCODER_EMBED_BITS = {
    "cls": OPT_EMBED_CLS,
    "mean": protocol.OPT_EMBED_MEAN,
    "last": protocol.OPT_EMBED_LAST,
}
_NOT_FOR_ENCODERS = (
    ("prompt_logprobs", "an encoder model has no next-token distribution"),
    ("top_k", "an encoder model has no next-token distribution"),
    ("prompt_top_k", "an encoder model has no next-token distribution"),
    ("return_kv", "an encoder model keeps no KV cache to export"),
)


def encoder_bits(model: Any, embed: object, normalize: object, refused: dict[str, object]) -> int:
    """The OPT_* bits of an encoder request: its pooling and whether to normalise. `refused`
    maps the decoder-only options to their values (any set one raises `InvalidRequest`)."""
    for name, why in _NOT_FOR_ENCODERS:
        value = refused[name]
        if value is not False and value != 0:
            raise InvalidRequest(f"{name}: not available for {model.architecture}: {why}")
    if embed is None:
        embed = model.pooling
    if not isinstance(embed, str) or embed not in ENCODER_EMBED_BITS:
        raise InvalidRequest(f"embed must be None, 'cls', 'mean' or 'last', got {embed!r}")
    if normalize is None:
        normalize = model.normalize
    if not isinstance(normalize, (bool, np.bool_)):
        raise InvalidRequestType(f"normalize must be True, False or None, got {normalize!r}")
    return ENCODER_EMBED_BITS[embed] | (protocol.OPT_NORMALIZE if normalize else 0)


def token_types_bytes(value: object, num_tokens: int, type_vocab_size: int) -> bytes | None:
    """`token_type_ids` as uint8 bytes (None: absent, every token type 0), checked: 1-D
    integers, one per prompt token, each below the model's `type_vocab_size`."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, np.ndarray)):
        raise InvalidRequestType(
            f"token_type_ids must be a list or 1-D array of ints, got {type(value).__name__}"
        )
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestType(f"token_type_ids: not an array of ints ({exc})") from None
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise InvalidRequestType("token_type_ids must be a 1-D list of ints")
    if len(array) != num_tokens:
        raise InvalidRequest(
            f"token_type_ids has {len(array)} entries, the prompt has {num_tokens} tokens"
        )
    if len(array) and (array.min() < 0 or array.max() >= type_vocab_size):
        raise InvalidRequest(
            f"token_type_ids must be in [0, {type_vocab_size}) for this model (its "
            f"type_vocab_size), got {int(array.min())}..{int(array.max())}"
        )
    return array.astype(np.uint8).tobytes()
