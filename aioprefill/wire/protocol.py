"""The wire protocol between the engine and its workers: every message, one module.

Messages are msgspec Structs tagged by class name and joined into one union per direction;
each side builds its typed `Decoder` once. Arrays travel as raw little-endian bytes, never as
`list[int]` (encoding 64x512 ids as a list costs ~12x more than as bytes), and nothing is
pickled. A batch is columnar: one int32 blob of all token ids back to back plus per-request
columns, so encoding is a handful of memcpys whatever the batch size.

Decoding from a ring slot copies every `bytes` field out of shared memory, so the slot can be
released as soon as `decode()` returns.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from aioprefill.errors import ProtocolError
from aioprefill.kvstore.options import KVStoreOptions
from aioprefill.models import PaddleModel, SimModel
from aioprefill.parallel import ParallelInfo
from aioprefill.shm.channel import ChannelSpec

__all__ = [  # (the messages, their unions, the codec)
    "BatchDone", "BatchFailed", "BatchResult", "FromWorker", "PrefillBatch", "Ready", "Shutdown",
    "Spilled", "StartFailed", "ToWorker", "WorkerSpec", "decode_batch_result",
    "decode_from_worker", "decode_to_worker", "decode_worker_spec", "encode", "encode_into",
]  # fmt: skip

# Flags per request in PrefillBatch.flags
FLAG_LAST_CHUNK = 1  # this chunk ends the prompt: compute the result, then free its state
FLAG_FIRST_CHUNK = 2  # this chunk starts the prompt: no state exists yet

# Output options per request in PrefillBatch.options (on every chunk of the prompt)
OPT_PROMPT_LOGPROBS = 1  # log-probability of every prompt token given the ones before it
OPT_EMBED_LAST = 2  # final-norm hidden state of the last token
OPT_EMBED_MEAN = 4  # mean of the final-norm hidden states over the prompt's tokens
OPT_NORMALIZE = 8  # L2-normalise the embedding
OPT_RETURN_KV = 16  # write the prompt's K/V into the shared-memory segment named in kv_names
OPT_PROMPT_TOP_K = 32  # with OPT_PROMPT_LOGPROBS: the top_k alternatives at every prompt position


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What a worker process needs to start, sent msgspec-encoded at spawn time.

    `parallel` is the worker's place in its collective group (`ParallelInfo`: mode, rank,
    size, group, master), made once by the engine and read unchanged by the worker. A
    collective that waits longer than `collective_timeout_s` breaks the group.
    """

    worker: int
    model: SimModel | PaddleModel
    to_worker: ChannelSpec
    from_worker: ChannelSpec
    engine_pid: int
    parallel: ParallelInfo = ParallelInfo()
    collective_timeout_s: float = 60.0
    # Prefix cache: this worker's (this rank's) byte budget for cached blocks of
    # `block_tokens` prompt tokens; 0 turns the cache off. The worker answers in `Ready` how
    # many blocks that is; the engine then owns the slots (see `PrefillBatch`).
    prefix_cache_bytes: int = 0
    block_tokens: int = 16
    kv_store: KVStoreOptions | None = None  # the cache's second tier (aioprefill.kvstore)
    # The engine's AIOPREFILL_* variables: a forkserver keeps the environment of its first engine
    env: dict[str, str] = msgspec.field(default_factory=dict)


# ---- engine -> worker ---------------------------------------------------------------------


class PrefillBatch(msgspec.Struct, tag=True, array_like=True):
    """One forward's worth of work. Columns have one entry per request (chunk) in the batch.

    request_ids: int64[n]; offsets: int32[n+1] into `tokens` (int32[offsets[-1]]);
    start_pos: int32[n], position of the chunk's first token in its prompt (0 unless chunked);
    flags: uint8[n], FLAG_* bits. `free_ids`: int64[m], requests whose cached state
    (chunked prefill KV) must be dropped before this forward (cancelled or failed).
    Output options (empty when no request in the batch has any): options: uint8[n], OPT_* bits;
    top_k: int32[n]; kv_names: one segment name per request with OPT_RETURN_KV, batch order.
    """

    batch_id: int
    request_ids: bytes
    offsets: bytes
    tokens: bytes
    start_pos: bytes
    flags: bytes
    free_ids: bytes = b""
    sent_ns: int = 0
    options: bytes = b""
    top_k: bytes = b""
    kv_names: list[str] = msgspec.field(default_factory=list)
    labels: bytes = b""  # int32: n+1 offsets, then each request's label token ids (b"": none)
    # Prefix cache (all empty when no request of the batch reads or writes a cached block).
    # The engine owns the worker's block slots (`Ready.cache_blocks` of them): it decides which
    # slot holds which block, so the worker never evicts on its own.
    # read_offsets int32[n+1] into read_slots int32[...]: a chunk with reads is its prompt's
    # first chunk computed, starting at start_pos == len(reads) * block_tokens; prompt block i
    # (positions i*block_tokens ...) is read from its i-th slot instead of computed.
    # write_offsets int32[n+1] into write_slots int32[...], write_first int32[n]: after this
    # chunk, its j-th write slot holds prompt block write_first + j (full blocks that end at or
    # before this chunk's end). Writing a slot evicts what it held. A request may read a slot
    # that a request *earlier in the same batch* writes (both share an uncached prefix): the
    # worker makes each layer's written keys/values visible before later requests attend. The
    # engine never writes a slot that the same batch reads for its old content.
    # write_hashes uint64[len(write_slots)] or empty: the written blocks' hashes (store keys,
    # only for workers with a store: it may load a chunk's leading written blocks instead).
    # tail_offsets int32[n+1] into tail_hashes uint64[...] (or both empty; store only): the
    # hashes of the full blocks chunk i computes past its writes (blocks write_first + its
    # write count, + 1, ...; no slot holds them: the worker's store puts them).
    read_offsets: bytes = b""
    read_slots: bytes = b""
    write_offsets: bytes = b""
    write_slots: bytes = b""
    write_first: bytes = b""
    write_hashes: bytes = b""
    tail_offsets: bytes = b""
    tail_hashes: bytes = b""
    token_types: bytes = b""  # encoders: uint8 per token (BERT's segment ids); b"": all zero

    @property
    def size(self) -> int:
        return len(self.request_ids) // 8

    def cache_arrays(self) -> tuple[Any, ...] | None:
        """(read_offsets, read_slots, write_offsets, write_slots, write_first, write_hashes,
        tail_offsets, tail_hashes; each of the last three None when empty) validated, or None
        when the batch does not touch the prefix cache."""
        if not (self.read_offsets or self.write_offsets):
            return None
        n = self.size
        tailed = bool(self.tail_offsets or self.tail_hashes)
        if len(self.read_offsets) != 4 * (n + 1) or len(self.write_offsets) != 4 * (n + 1):
            raise ProtocolError(f"PrefillBatch cache offsets are not {n + 1} int32")
        if tailed and (len(self.tail_offsets) != 4 * (n + 1) or len(self.tail_hashes) % 8):
            raise ProtocolError(f"PrefillBatch tail columns are not {n + 1} int32 and uint64s")
        if len(self.write_first) != 4 * n:
            raise ProtocolError(f"PrefillBatch.write_first is not {n} int32")
        read_offsets = np.frombuffer(self.read_offsets, dtype="<i4")
        read_slots = np.frombuffer(self.read_slots, dtype="<i4")
        write_offsets = np.frombuffer(self.write_offsets, dtype="<i4")
        write_slots = np.frombuffer(self.write_slots, dtype="<i4")
        write_first = np.frombuffer(self.write_first, dtype="<i4")
        for offsets, slots, what in (
            (read_offsets, read_slots, "read"),
            (write_offsets, write_slots, "write"),
        ):
            if offsets[0] != 0 or offsets[n] != len(slots) or (n and np.diff(offsets).min() < 0):
                raise ProtocolError(f"PrefillBatch {what} offsets do not cover its slots")
            if len(slots) and slots.min() < 0:
                raise ProtocolError(f"PrefillBatch {what} slots has a negative slot")
        if n and write_first.min() < 0:
            raise ProtocolError("PrefillBatch.write_first has a negative block")
        if len(self.write_hashes) not in (0, 2 * len(self.write_slots)):
            raise ProtocolError("PrefillBatch.write_hashes does not match its write slots")
        hashes = np.frombuffer(self.write_hashes, dtype="<u8") if self.write_hashes else None
        cols = (read_offsets, read_slots, write_offsets, write_slots, write_first, hashes)
        if not tailed:
            return (*cols, None, None)
        tail_offsets = np.frombuffer(self.tail_offsets, dtype="<i4")
        tails = np.frombuffer(self.tail_hashes, dtype="<u8")
        if tail_offsets[0] != 0 or tail_offsets[n] != len(tails) or np.diff(tail_offsets).min() < 0:
            raise ProtocolError("PrefillBatch tail offsets do not cover its tail hashes")
        return (*cols, tail_offsets, tails)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(request_ids, offsets, tokens, start_pos, flags) as read-only views, validated."""
        n = len(self.request_ids) // 8
        if len(self.request_ids) != 8 * n:
            raise ProtocolError("PrefillBatch.request_ids is not a whole number of int64")
        if len(self.offsets) != 4 * (n + 1) or len(self.start_pos) != 4 * n or len(self.flags) != n:
            raise ProtocolError(f"PrefillBatch columns disagree on the batch size ({n})")
        if len(self.tokens) % 4:
            raise ProtocolError("PrefillBatch.tokens is not a whole number of int32")
        ids = np.frombuffer(self.request_ids, dtype="<i8")
        offsets = np.frombuffer(self.offsets, dtype="<i4")
        tokens = np.frombuffer(self.tokens, dtype="<i4")
        start_pos = np.frombuffer(self.start_pos, dtype="<i4")
        flags = np.frombuffer(self.flags, dtype=np.uint8)
        if offsets[0] != 0 or offsets[n] != len(tokens) or (n and np.diff(offsets).min() <= 0):
            raise ProtocolError("PrefillBatch.offsets are not increasing from 0 to len(tokens)")
        if n and start_pos.min() < 0:
            raise ProtocolError("PrefillBatch.start_pos has a negative position")
        return ids, offsets, tokens, start_pos, flags

    def option_arrays(self) -> tuple[np.ndarray | None, np.ndarray | None, tuple[str, ...]]:
        """(options, top_k, kv_names), validated; None for a column the batch left empty."""
        n = self.size
        options = top_k = None
        if self.options:
            if len(self.options) != n:
                raise ProtocolError(f"PrefillBatch.options has {len(self.options)}, not {n}")
            options = np.frombuffer(self.options, dtype=np.uint8)
        if self.top_k:
            if len(self.top_k) != 4 * n:
                raise ProtocolError(f"PrefillBatch.top_k is not {n} int32")
            top_k = np.frombuffer(self.top_k, dtype="<i4")
            if top_k.min() < 0:
                raise ProtocolError("PrefillBatch.top_k has a negative entry")
        wants_kv = 0 if options is None else int(np.count_nonzero(options & OPT_RETURN_KV))
        if wants_kv != len(self.kv_names):
            raise ProtocolError(f"{wants_kv} requests want their KV but {len(self.kv_names)} named")
        return options, top_k, tuple(self.kv_names)

    def free_array(self) -> np.ndarray:
        if len(self.free_ids) % 8:
            raise ProtocolError("PrefillBatch.free_ids is not a whole number of int64")
        return np.frombuffer(self.free_ids, dtype="<i8")


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Finish the current forward, then exit cleanly."""


ToWorker = PrefillBatch | Shutdown


# ---- worker -> engine ---------------------------------------------------------------------


class Ready(msgspec.Struct, tag=True, array_like=True):
    """The worker loaded its model and waits for batches."""

    worker: int
    pid: int
    device: str
    started_ns: int
    ready_ns: int
    cache_blocks: int = 0  # prefix cache slots this worker holds (0: off), slot ids 0..n-1
    block_bytes: int = 0  # bytes one cached block takes on this worker (KV + what outputs need)


class StartFailed(msgspec.Struct, tag=True, array_like=True):
    """The worker could not start (bad weights file, no device...); it exits after sending."""

    worker: int
    error_type: str
    message: str


class BatchResult(msgspec.Struct, tag=True, array_like=True):
    """A forward finished. Results only for requests whose last chunk was in the batch.

    request_ids: int64[k]; tokens: int32[k]; logprobs: float64[k]; scores: float32[k, labels]
    (encoder classifiers; else empty). Output options' columns hold entries only for requests
    that asked, back to back in batch order: top_k_ids int32 / top_k_logprobs float32 (top_k per
    finished request); prompt_logprobs float32 (end - max(start, 1) per chunk, last or not);
    prompt_top_k_ids int32 / prompt_top_k_logprobs float32 (top_k per prompt logprob of the
    chunks with OPT_PROMPT_TOP_K); embeddings float32 (embed_dim per finished request).
    """

    batch_id: int
    forward_start_ns: int
    forward_end_ns: int
    request_ids: bytes
    tokens: bytes
    logprobs: bytes
    top_k_ids: bytes = b""
    top_k_logprobs: bytes = b""
    prompt_logprobs: bytes = b""
    embeddings: bytes = b""
    embed_dim: int = 0
    prompt_top_k_ids: bytes = b""
    prompt_top_k_logprobs: bytes = b""
    label_logprobs: bytes = b""  # float32: finished requests' label token logprobs, batch order
    loaded_tokens: bytes = b""  # int32[n], per chunk: tokens loaded from the store (b"": none)
    scores: bytes = b""

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        k = len(self.request_ids) // 8
        if (len(self.request_ids), len(self.tokens), len(self.logprobs)) != (8 * k, 4 * k, 8 * k):
            raise ProtocolError(f"BatchResult columns disagree on the result count ({k})")
        return (
            np.frombuffer(self.request_ids, dtype="<i8"),
            np.frombuffer(self.tokens, dtype="<i4"),
            np.frombuffer(self.logprobs, dtype="<f8"),
        )


class BatchDone(msgspec.Struct, tag=True, array_like=True):
    """A tensor-parallel rank other than 0 finished this batch; rank 0 carries the results."""

    batch_id: int
    forward_start_ns: int
    forward_end_ns: int


class Spilled(msgspec.Struct, tag=True, array_like=True):
    """A `BatchResult` too large for the result ring, encoded into shared-memory segment `name`
    (`size` bytes) instead; the engine decodes it from there and unlinks the segment."""

    batch_id: int
    name: str
    size: int


class BatchFailed(msgspec.Struct, tag=True, array_like=True):
    """The model raised during this batch's forward; every request in it fails."""

    batch_id: int
    forward_start_ns: int
    forward_end_ns: int
    error_type: str
    message: str


FromWorker = Ready | StartFailed | BatchResult | BatchDone | Spilled | BatchFailed


_encoder = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_from_worker = msgspec.msgpack.Decoder(FromWorker)
_spec_decoder = msgspec.msgpack.Decoder(WorkerSpec)
_batch_result = msgspec.msgpack.Decoder(BatchResult)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def encode_into(msg: msgspec.Struct, buffer: bytearray) -> memoryview:
    """Encode into a reused buffer; returns a view of exactly the encoded bytes."""
    _encoder.encode_into(msg, buffer)
    return memoryview(buffer)


def _decode(decoder: msgspec.msgpack.Decoder[Any], data: bytes | memoryview, what: str) -> Any:
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed {what} message: {exc}") from exc


def decode_to_worker(data: bytes | memoryview) -> PrefillBatch | Shutdown:
    return _decode(_to_worker, data, "engine->worker")


def decode_from_worker(data: bytes | memoryview) -> FromWorker:
    return _decode(_from_worker, data, "worker->engine")


def decode_batch_result(data: bytes | memoryview) -> BatchResult:
    """A spilled `BatchResult`, read from its segment."""
    return _decode(_batch_result, data, "spilled result")


def decode_worker_spec(data: bytes) -> WorkerSpec:
    return _decode(_spec_decoder, data, "worker spec")
