"""Output options, engine side: what a request asks for beyond its token, on the wire and back.

`parse_outputs` validates `prefill()`'s keyword options (raising `InvalidRequest` before anything
is queued) into an `Outputs` record that rides on the request. At dispatch `option_columns`
packs the batch's options into PrefillBatch columns (nothing at all when no request in it has
any, so plain traffic pays one scan). When the answer comes back, `ResultColumns` walks the
BatchResult's back-to-back columns chunk by chunk in batch order: prompt log-probabilities
(and, with `prompt_top_k`, the top-k at each prompt position) arrive per chunk and are
assembled across a chunked prompt's forwards; top-k, the label token logprobs, the embedding
and the KV export handle come with its last chunk.

`label_token_ids` (generative scoring: a reranker's "yes"/"no") are 1 to `MAX_LABELS` ids in the
vocabulary, in the caller's order, repeats allowed (each gets its value); they travel in
PrefillBatch.labels on every chunk and come back as float32 logprobs at the last position.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aioprefill.errors import InvalidRequest, InvalidRequestType, ProtocolError
from aioprefill.shm.spill import read_spilled
from aioprefill.wire import protocol
from aioprefill.wire.encoder import OPT_EMBED_CLS, encoder_bits, token_types_bytes
from aioprefill.wire.kv import KVExports, KVTicket
from aioprefill.wire.protocol import (
    OPT_EMBED_MEAN,
    OPT_PROMPT_LOGPROBS,
    OPT_PROMPT_TOP_K,
    BatchResult,
    Spilled,
)

__all__ = [
    "Outputs",
    "ResultColumns",
    "option_columns",
    "parse_outputs",
    "read_outputs",
    "unspill",
]

MAX_LABELS = 32  # label token ids per request
# The options answered from the final hidden row of every prompt position (not the last alone):
# a prefix-cache block read for them must have kept its rows (`sched.prefix.BlockIndex`).
OPTS_OVER_PROMPT = OPT_PROMPT_LOGPROBS | OPT_PROMPT_TOP_K | OPT_EMBED_MEAN
EMBED_MODES = {None: 0, "last": protocol.OPT_EMBED_LAST, "mean": protocol.OPT_EMBED_MEAN}


@dataclass(slots=True, eq=False)
class Outputs:
    """One request's output options, and its prompt log-probabilities received so far."""

    bits: int
    top_k: int
    kv: KVTicket | None = None
    parts: list[np.ndarray] = field(default_factory=list)
    top_parts: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    labels: np.ndarray | None = None  # int32 label token ids (last position logprobs)
    types: bytes | None = None  # an encoder prompt's token type ids, uint8 per token
    num_tokens: int = 0  # (encoders: the prompt's length, for the token types column)


def _flag(value: object, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidRequestType(f"{name} must be True or False, got {value!r}")
    return bool(value)


def parse_outputs(
    *,
    prompt_logprobs: object,
    top_k: object,
    prompt_top_k: object = False,
    embed: object,
    normalize: object,
    return_kv: object,
    vocab_size: int,
    label_token_ids: object = None,
    encoder: tuple[Any, object, int] | None = None,
) -> Outputs | None:
    """Validate `prefill()`'s output options; None when none is asked (the common case).
    `encoder`: (the engine's model spec, `token_type_ids`, the prompt's length); an encoder
    model (`wire.encoder`) always answers with an embedding and takes token type ids."""
    model: Any
    model, token_type_ids, num_tokens = encoder or (None, None, 0)
    if getattr(model, "is_encoder", False):
        if label_token_ids is not None:
            raise InvalidRequest("label_token_ids: only for decoder LMs, not encoder models")
        asked = dict(prompt_logprobs=prompt_logprobs, top_k=top_k, prompt_top_k=prompt_top_k)
        bits = encoder_bits(model, embed, normalize, {**asked, "return_kv": return_kv})
        types = token_types_bytes(token_type_ids, num_tokens, model.type_vocab_size)
        return Outputs(bits=bits, top_k=0, types=types, num_tokens=num_tokens)
    if token_type_ids is not None:
        raise InvalidRequest("token_type_ids: only for encoder models (BERT, XLM-RoBERTa)")
    if normalize is None:  # the model's own choice: a decoder does not normalise
        normalize = False
    if (
        label_token_ids is None
        and prompt_logprobs is False
        and top_k == 0
        and prompt_top_k is False
        and embed is None
        and normalize is False
        and return_kv is False
    ):
        return None
    bits = protocol.OPT_PROMPT_LOGPROBS if _flag(prompt_logprobs, "prompt_logprobs") else 0
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
        raise InvalidRequestType(f"top_k must be an int, got {top_k!r}")
    if not 0 <= top_k <= vocab_size:
        raise InvalidRequest(f"top_k must be in [0, vocab_size={vocab_size}], got {top_k}")
    if not isinstance(embed, (str, type(None))) or embed not in EMBED_MODES:
        raise InvalidRequest(f"embed must be None, 'last' or 'mean', got {embed!r}")
    if _flag(prompt_top_k, "prompt_top_k"):
        if not bits or not top_k:
            raise InvalidRequest(
                "prompt_top_k=True needs prompt_logprobs=True and top_k > 0 (the top_k best "
                "tokens at each position of the prompt logprobs)"
            )
        bits |= protocol.OPT_PROMPT_TOP_K
    bits |= EMBED_MODES[embed]
    if _flag(normalize, "normalize"):
        if embed is None:
            raise InvalidRequest("normalize=True needs embed='last' or embed='mean'")
        bits |= protocol.OPT_NORMALIZE
    if _flag(return_kv, "return_kv"):
        bits |= protocol.OPT_RETURN_KV
    labels = None if label_token_ids is None else parse_labels(label_token_ids, vocab_size)
    return Outputs(bits=bits, top_k=int(top_k), labels=labels)


def parse_labels(label_token_ids: object, vocab_size: int) -> np.ndarray:
    """`label_token_ids` as int32: a list/tuple or 1-D integer array of 1..MAX_LABELS ids in
    [0, vocab_size); InvalidRequest naming the field otherwise."""
    name = "label_token_ids"
    if isinstance(label_token_ids, np.ndarray):
        if label_token_ids.ndim != 1 or label_token_ids.dtype.kind not in "iu":
            raise InvalidRequestType(f"{name} must be a 1-D integer array")
        values = label_token_ids.tolist()
    elif isinstance(label_token_ids, (list, tuple)):
        values = list(label_token_ids)
    else:
        raise InvalidRequestType(f"{name} must be a list of token ids, got {label_token_ids!r}")
    if not 1 <= len(values) <= MAX_LABELS:
        raise InvalidRequest(f"{name} must hold 1 to {MAX_LABELS} ids, got {len(values)}")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise InvalidRequestType(f"{name}[{i}] must be an int, got {v!r}")
        if not 0 <= v < vocab_size:
            raise InvalidRequest(f"{name}[{i}] = {v} is outside the vocabulary [0, {vocab_size})")
    return np.asarray(values, dtype=np.int32)


def option_columns(
    size: int, outputs: list[tuple[int, Outputs]]
) -> tuple[bytes, bytes, list[str], bytes, bytes]:
    """PrefillBatch's (options, top_k, kv_names, labels, token_types) for a batch of `size`
    requests, from the (position, Outputs) of those that have options
    (`batching.Columns.outputs`)."""
    bits = bytearray(size)
    top_k = [0] * size
    names = []
    labels: list[tuple[int, np.ndarray]] = []
    types = False
    for at, out in outputs:
        bits[at] = out.bits
        top_k[at] = out.top_k
        if out.kv is not None:
            names.append(out.kv.name)
        if out.labels is not None:
            labels.append((at, out.labels))
        types = types or out.types is not None
    # Token types (encoders, whose every request has Outputs): all of the batch's, or none.
    type_column = b"".join(o.types or bytes(o.num_tokens) for _, o in outputs) if types else b""
    labels_column = label_column(size, labels)
    return bytes(bits), struct.pack(f"<{size}i", *top_k), names, labels_column, type_column


def label_column(size: int, labels: list[tuple[int, np.ndarray]]) -> bytes:
    """PrefillBatch.labels: int32 offsets[size + 1] into the ids that follow them (b"": none)."""
    if not labels:
        return b""
    counts = np.zeros(size + 1, dtype="<i4")
    for at, ids in labels:
        counts[at + 1] = len(ids)
    ids = np.concatenate([ids for _, ids in labels]).astype("<i4")
    return np.cumsum(counts, dtype="<i4").tobytes() + ids.tobytes()


def unspill(msg: Spilled) -> BatchResult:
    """The BatchResult a worker wrote into a segment because it was too big for the ring."""
    try:
        data = read_spilled(msg.name, msg.size)
    except (OSError, ValueError) as exc:
        raise ProtocolError(f"spilled result {msg.name!r} unreadable: {exc}") from exc
    result = protocol.decode_batch_result(data)
    if result.batch_id != msg.batch_id:
        raise ProtocolError(f"spilled result is batch {result.batch_id}, not {msg.batch_id}")
    return result


class ResultColumns:
    """Reads a BatchResult's output columns, one chunk at a time, in batch order."""

    def __init__(self, msg: BatchResult, ledger: KVExports | None) -> None:
        if len(msg.top_k_ids) != len(msg.top_k_logprobs) or len(msg.top_k_ids) % 4:
            raise ProtocolError("BatchResult top-k columns disagree")
        if len(msg.prompt_top_k_ids) != len(msg.prompt_top_k_logprobs):
            raise ProtocolError("BatchResult prompt top-k columns disagree")
        sizes = (len(msg.prompt_logprobs), len(msg.prompt_top_k_ids), len(msg.embeddings))
        if any(size % 4 for size in (*sizes, len(msg.label_logprobs))) or msg.embed_dim < 0:
            raise ProtocolError("BatchResult output columns are not whole float32 arrays")
        self._ids = np.frombuffer(msg.top_k_ids, dtype="<i4")
        self._k_lps = np.frombuffer(msg.top_k_logprobs, dtype="<f4")
        self._plp = np.frombuffer(msg.prompt_logprobs, dtype="<f4")
        self._emb = np.frombuffer(msg.embeddings, dtype="<f4")
        self._p_ids = np.frombuffer(msg.prompt_top_k_ids, dtype="<i4")
        self._p_lps = np.frombuffer(msg.prompt_top_k_logprobs, dtype="<f4")
        self._label_lps = np.frombuffer(msg.label_logprobs, dtype="<f4")
        self._dim = msg.embed_dim
        results = len(msg.request_ids) // 8
        if len(msg.scores) % (4 * max(results, 1)):
            raise ProtocolError("BatchResult scores are not float32 rows, one per result")
        self._scores = np.frombuffer(msg.scores, dtype="<f4")
        self._labels, self._score_at = len(self._scores) // max(results, 1), 0
        self._at = [0, 0, 0, 0, 0]  # cursors: top-k, prompt logprobs, embeddings, prompt top-k,
        # label logprobs
        self._ledger = ledger

    def _take(self, which: int, array: np.ndarray, n: int) -> np.ndarray:
        at = self._at[which]
        if at + n > len(array):
            raise ProtocolError("BatchResult output columns are shorter than the batch asks")
        self._at[which] = at + n
        return array[at : at + n]

    def chunk(
        self, out: Outputs, start: int, end: int, *, last: bool, alive: bool
    ) -> dict[str, Any]:
        """Consume one chunk's values. For the last chunk returns the PrefillResult fields (a
        KV handle only when `alive`: nobody waits for a cancelled request's export)."""
        if out.bits & protocol.OPT_PROMPT_LOGPROBS:
            if start == 0:
                out.parts, out.top_parts = [], []  # a retried prompt starts over
            rows = end - max(start, 1)
            out.parts.append(self._take(1, self._plp, rows))
            if out.bits & protocol.OPT_PROMPT_TOP_K:
                at = self._at[3]
                ids = self._take(3, self._p_ids, rows * out.top_k).reshape(rows, out.top_k)
                lps = self._p_lps[at : at + rows * out.top_k].reshape(rows, out.top_k)
                out.top_parts.append((ids, lps))
        if not last:
            return {}
        fields: dict[str, Any] = {}
        if out.bits & protocol.OPT_PROMPT_LOGPROBS:
            fields["prompt_logprobs"] = np.concatenate(out.parts) if out.parts else self._plp[:0]
            out.parts = []
        if out.bits & protocol.OPT_PROMPT_TOP_K:
            k, parts = out.top_k, out.top_parts
            fields["prompt_top_k_ids"] = _rows([p[0] for p in parts], self._p_ids, k)
            fields["prompt_top_k_logprobs"] = _rows([p[1] for p in parts], self._p_lps, k)
            out.top_parts = []
        if out.top_k:
            at = self._at[0]
            fields["top_k_ids"] = self._take(0, self._ids, out.top_k)
            fields["top_k_logprobs"] = self._k_lps[at : at + out.top_k]
        if out.labels is not None:
            fields["label_logprobs"] = self._take(4, self._label_lps, len(out.labels))
        if out.bits & (protocol.OPT_EMBED_LAST | protocol.OPT_EMBED_MEAN | OPT_EMBED_CLS):
            if self._dim <= 0:
                raise ProtocolError("BatchResult has embeddings without a dimension")
            fields["embedding"] = self._take(2, self._emb, self._dim)
        if self._labels:  # an encoder classifier's logits, for every request it finishes
            at = self._score_at = self._score_at + self._labels
            if at > len(self._scores):
                raise ProtocolError("BatchResult scores are shorter than the batch")
            fields["scores"] = self._scores[at - self._labels : at]
        if out.kv is not None and self._ledger is not None:
            if alive and out.kv.state == "reserved":
                fields["kv"] = self._ledger.open(out.kv)
            else:
                self._ledger.discard(out.kv)
        return fields

    def check_consumed(self) -> bool:
        """Whether every value was claimed by a chunk (else the worker and engine disagree)."""
        at = [len(self._ids), len(self._plp), len(self._emb), len(self._p_ids)]
        at.append(len(self._label_lps))
        return self._at == at and self._score_at == len(self._scores)


def _rows(parts: list[np.ndarray], column: np.ndarray, k: int) -> np.ndarray:
    """A chunked prompt's [rows, k] pieces as one array (a one-chunk prompt's is a view)."""
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else column[:0].reshape(0, k)


def read_outputs(msg: BatchResult, chunks: list[Any], ledger: KVExports) -> list[dict[str, Any]]:
    """PrefillResult fields per chunk of the batch (`batching.Chunk`s, batch order); empty dicts
    and no work at all when none of its requests asked for an option. Raises ProtocolError when
    the columns disagree with what was asked."""
    if not any(c.request.outputs for c in chunks):
        return [_NONE] * len(chunks)
    columns = ResultColumns(msg, ledger)
    fields = [
        _NONE
        if c.request.outputs is None
        else columns.chunk(
            c.request.outputs,
            c.start - c.cached,  # a chunk that reads the cache answers from the prompt's start
            c.end,
            last=c.is_last,
            alive=not c.request.handle.done(),
        )
        for c in chunks
    ]
    if not columns.check_consumed():
        raise ProtocolError("BatchResult has output values nobody asked for")
    return fields


_NONE: dict[str, Any] = {}
