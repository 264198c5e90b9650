"""`SimRunner`: a worker-side model that sleeps for the `SimModel` cost model.

It is a real worker (real process, rings, eventfds) whose forward costs a known, tunable time,
for scheduling experiments. Its token for a prompt is a CRC32 of the prompt's int32 bytes
modulo the vocabulary, computed incrementally across chunks, so the result of a chunked prompt
equals the unchunked one and tests can check each caller got its own answer.

The output options get synthetic but deterministic values, each a function of the prompt
alone (so batch- and chunk-invariant), with the shapes and types a real model gives: the
`sim_*` functions below say what a `SimModel` worker returns; the KV export has the shape of
`aioprefill.wire.kv.SIM_KV_LAYOUT` and the embedding `SIM_EMBED_DIM` values.

Its prefix cache has the slots a real worker would have for the same budget (`cache_blocks`:
`prefix_cache_bytes // (block_tokens * SimModel.kv_bytes_per_token)`); as its "KV", a slot
holds its block's token ids. A chunk that reads slots continues from them (their tokens stand
in for the prefix it did not receive, and its CRC32 continues from theirs), so its outputs
equal the whole prompt's, and a wrong read (an engine bookkeeping bug) gives a wrong answer.
Its cost charges the computed tokens plus attention over the cached ones
(`SimModel.forward_seconds`); storing a batch's new blocks (its "KV writes", which a real
model's kernels make within the time its cost counts) runs inside that time, not after it.

As a rank of a tensor- or expert-parallel group it meets its peers at a real barrier after
every forward (`SocketBarrier`), so a step costs what the slowest rank costs and a rank that
skips a step blocks the others, as the collectives of a real model would. An empty batch (what
an idle expert-parallel rank gets) sleeps the fixed cost and joins the barrier. Only rank 0 of
a tensor-parallel group writes KV exports.
"""

from __future__ import annotations

import os
import time
import zlib
from dataclasses import dataclass, field

import numpy as np

from aioprefill.models import SimModel
from aioprefill.wire import protocol
from aioprefill.wire.kv import SIM_KV_LAYOUT
from aioprefill.workers.barrier import SocketBarrier
from aioprefill.workers.kv_writer import KVWriters, open_writers
from aioprefill.workers.runner import ForwardBatch, ForwardOutput
from aioprefill.workers.sim_cache import SimBlocks, only_whole_writes, slots_of
from aioprefill.workers.sim_labels import sim_label_logprobs

__all__ = [
    "SIM_EMBED_DIM",
    "SimRunner",
    "expected_logprob",
    "expected_token",
    "sim_embedding",
    "sim_kv",
    "sim_prompt_logprobs",
    "sim_prompt_top_k",
    "sim_top_k",
]

SIM_EMBED_DIM = 16


def _token_of(crc: int, vocab_size: int) -> int:
    return crc % vocab_size


def _logprob_of(crc: int) -> float:
    return -((crc >> 8) % 10_000) / 1000.0


def expected_token(tokens: list[int] | np.ndarray, vocab_size: int = 32000) -> int:
    """The token a `SimModel` worker returns for this prompt."""
    return _token_of(zlib.crc32(np.asarray(tokens, dtype="<i4").tobytes()), vocab_size)


def expected_logprob(tokens: list[int] | np.ndarray) -> float:
    """The log-probability a `SimModel` worker returns for this prompt."""
    return _logprob_of(zlib.crc32(np.asarray(tokens, dtype="<i4").tobytes()))


def _pair_logprobs(prev: np.ndarray, cur: np.ndarray, pos: np.ndarray) -> np.ndarray:
    mixed = prev.astype(np.int64) * 31 + cur.astype(np.int64) * 17 + pos
    return (-(mixed % 1000) / 100.0).astype(np.float32)


def sim_prompt_logprobs(tokens: list[int] | np.ndarray) -> np.ndarray:
    """float32[n-1]: the prompt log-probabilities a `SimModel` worker returns."""
    t = np.asarray(tokens, dtype=np.int64)
    return _pair_logprobs(t[:-1], t[1:], np.arange(1, len(t)))


def _pair_top_k(prev: np.ndarray, pos: np.ndarray, k: int, vocab_size: int):
    """[rows, k] ids and logprobs at each position, from the token before it and its place."""
    base = prev.astype(np.int64) * 31 + pos * 7
    ids = (base[:, None] + np.arange(k)) % vocab_size
    lps = -(base[:, None] % 100) / 100.0 - 0.25 * np.arange(k)
    return ids.astype(np.int32), lps.astype(np.float32)


def sim_prompt_top_k(tokens: list[int] | np.ndarray, k: int, vocab_size: int = 32000):
    """(int32[n-1, k], float32[n-1, k]): the prompt top-k a `SimModel` worker returns."""
    t = np.asarray(tokens, dtype=np.int64)
    return _pair_top_k(t[:-1], np.arange(1, len(t)), k, vocab_size)


def sim_top_k(tokens: list[int] | np.ndarray, k: int, vocab_size: int = 32000):
    """(int32[k], float32[k]): the top-k a `SimModel` worker returns, its token first."""
    return _top_k(zlib.crc32(np.asarray(tokens, dtype="<i4").tobytes()), k, vocab_size)


def _top_k(crc: int, k: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    ids = (_token_of(crc, vocab_size) + np.arange(k, dtype=np.int64)) % vocab_size
    lps = _logprob_of(crc) - 0.25 * np.arange(k)
    return ids.astype(np.int32), lps.astype(np.float32)


def _token_vectors(tokens: np.ndarray, start: int) -> np.ndarray:
    """float64[n, SIM_EMBED_DIM]: a vector per (token, position)."""
    pos = np.arange(start, start + len(tokens))[:, None]
    d = np.arange(1, SIM_EMBED_DIM + 1)[None, :]
    return np.sin(0.37 * (tokens.astype(np.float64)[:, None] + 1) * d + 0.011 * pos)


def _pool(total: np.ndarray, last: np.ndarray, n: int, opts: int) -> np.ndarray:
    v = total / n if opts & protocol.OPT_EMBED_MEAN else last
    if opts & protocol.OPT_NORMALIZE:
        v = v / np.linalg.norm(v)
    return v.astype(np.float32)


def sim_embedding(tokens: list[int] | np.ndarray, embed: str, normalize: bool = False):
    """float32[SIM_EMBED_DIM]: the embedding a `SimModel` worker returns."""
    vectors = _token_vectors(np.asarray(tokens), 0)
    opts = protocol.OPT_EMBED_MEAN if embed == "mean" else protocol.OPT_EMBED_LAST
    opts |= protocol.OPT_NORMALIZE if normalize else 0
    return _pool(vectors.sum(axis=0), vectors[-1], len(vectors), opts)


def sim_kv(tokens: list[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(keys, values) float32[2, 2, n, 8]: the KV export of a `SimModel` worker."""
    t = np.asarray(tokens, dtype=np.float64)
    lay = SIM_KV_LAYOUT
    grid = np.ix_(
        np.arange(lay.num_layers), np.arange(lay.num_kv_heads), np.arange(len(t)),
        np.arange(lay.head_dim),
    )  # fmt: skip
    ell, h, pos, d = grid
    keys = np.sin(0.01 * t[pos] * (ell + 1) + 0.1 * pos + h + 0.5 * d)
    return keys.astype(np.float32), np.cos(keys).astype(np.float32)


@dataclass(slots=True)
class _State:
    """What a chunked prompt carries to its next chunk."""

    crc: int = 0
    last_token: int = 0
    embed_sum: np.ndarray | None = None
    tokens: list[np.ndarray] = field(default_factory=list)  # kept only for a KV export


class SimRunner:
    device = "sim"

    def __init__(
        self,
        spec: SimModel,
        barrier: SocketBarrier | None = None,
        *,
        writes_kv: bool = True,
        cache_bytes: int = 0,
        block_tokens: int = 16,
    ) -> None:
        self.spec = spec
        self.barrier = barrier
        self.block_tokens = block_tokens
        self.block_bytes = block_tokens * spec.kv_bytes_per_token
        self.cache_blocks = cache_bytes // self.block_bytes
        self._blocks = self.cache_slots = SimBlocks(self.cache_blocks, block_tokens)
        # A tensor-parallel rank > 0 leaves KV exports to rank 0: the values are the same, and
        # two ranks creating one segment race (one may map it before the other has sized it).
        self.writes_kv = writes_kv
        self._partial: dict[int, _State] = {}  # request id -> state after its chunks so far

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        try:
            return self._forward(batch)
        except BaseException:
            self._blocks.invalidate(batch.write_slots)  # it may have written none of them
            raise

    def _forward(self, batch: ForwardBatch) -> ForwardOutput:
        seq_lens = batch.seq_lens()
        self._inject_faults(batch.tokens)
        reads = batch.read_offsets
        cached = None if reads is None else (np.diff(reads) * self.block_tokens).tolist()
        deadline = time.perf_counter() + self.spec.forward_seconds(seq_lens.tolist(), cached)
        plain = batch.options is None and batch.top_k is None and only_whole_writes(batch)
        if plain:  # a real forward writes these blocks' KV inside the time the model charges
            self._blocks.write_whole(batch, self.block_tokens)
        time.sleep(max(0.0, deadline - time.perf_counter()))
        if self.barrier is not None:
            out_of_step = self.spec.fail_rank >= 0
            if out_of_step and self.barrier.rank == self.spec.fail_rank:
                self._inject_failure(batch.tokens)  # before the barrier: the peers wait for it
            self.barrier.wait()  # the step ends when the slowest rank's forward does
            if not out_of_step:
                self._inject_failure(batch.tokens)  # after the barrier: the group stays in step
            if self.barrier.rank == self.spec.slow_rank:
                time.sleep(self.spec.slow_rank_ms * 1e-3)
        if plain:
            return self._plain(batch)
        return self._with_options(batch)

    def _plain(self, batch: ForwardBatch) -> ForwardOutput:
        """No output options in the batch: the token and its logprob only (the hot path of the
        scheduling benchmarks, so plain lists rather than per-element NumPy indexing)."""
        ids, toks, lps = [], [], []
        offsets, starts = batch.offsets.tolist(), batch.start_pos.tolist()
        tokens, vocab = batch.tokens, self.spec.vocab_size
        for i, (rid, last) in enumerate(
            zip(batch.request_ids.tolist(), batch.is_last.tolist(), strict=True)
        ):
            chunk = tokens[offsets[i] : offsets[i + 1]]
            state = self._partial.pop(rid, None) if starts[i] else None
            crc = zlib.crc32(chunk.tobytes(), 0 if state is None else state.crc)
            if last:
                ids.append(rid)
                toks.append(_token_of(crc, vocab))
                lps.append(_logprob_of(crc))
            else:
                state = state or _State()
                state.crc = crc
                if self.cache_blocks:  # a later chunk may write a block this one started
                    state.tokens.append(chunk)
                self._partial[rid] = state
        return ForwardOutput(
            request_ids=np.asarray(ids, dtype=np.int64),
            tokens=np.asarray(toks, dtype=np.int32),
            logprobs=np.asarray(lps, dtype=np.float64),
        )

    def _with_options(self, batch: ForwardBatch) -> ForwardOutput:
        ids, toks, lps = [], [], []
        top_ids, top_lps, plps, embeds, p_ids, p_lps, labs = [], [], [], [], [], [], []
        options = batch.options
        top_k = batch.top_k_of()
        writers = open_writers(batch, SIM_KV_LAYOUT) if self.writes_kv else KVWriters()
        offsets = batch.offsets
        try:
            for i in range(batch.size):
                rid = int(batch.request_ids[i])
                chunk = batch.tokens[offsets[i] : offsets[i + 1]]
                start = int(batch.start_pos[i])
                reads = slots_of(batch.read_offsets, batch.read_slots, i)
                if len(reads):  # outputs cover the prompt from 0: the cached ids come first
                    cached_ids, crc = self._blocks.read(reads)
                    seg, seg_start, state = np.concatenate([cached_ids, chunk]), 0, _State(crc)
                else:
                    seg, seg_start = chunk, start
                    kept = self._partial.pop(rid, None) if start else None
                    state = kept or _State()
                opts = 0 if options is None else int(options[i])
                if opts & protocol.OPT_PROMPT_LOGPROBS:
                    prev = np.concatenate([[state.last_token], seg[:-1]])
                    pos = np.arange(seg_start, seg_start + len(seg))
                    skip = 1 if seg_start == 0 else 0
                    plps.append(_pair_logprobs(prev, seg, pos)[skip:])
                    if opts & protocol.OPT_PROMPT_TOP_K:
                        k, vocab = int(top_k[i]), self.spec.vocab_size
                        pk = _pair_top_k(prev[skip:], pos[skip:], k, vocab)
                        p_ids.append(pk[0].ravel())
                        p_lps.append(pk[1].ravel())
                state.crc = zlib.crc32(chunk.tobytes(), state.crc)
                state.last_token = int(chunk[-1])
                vectors = None
                if opts & (protocol.OPT_EMBED_LAST | protocol.OPT_EMBED_MEAN):
                    vectors = _token_vectors(seg, seg_start)
                    add = vectors.sum(axis=0)
                    state.embed_sum = add if state.embed_sum is None else state.embed_sum + add
                if opts & protocol.OPT_RETURN_KV or self.cache_blocks:
                    state.tokens.append(seg)
                writes = slots_of(batch.write_offsets, batch.write_slots, i)
                if len(writes):
                    assert batch.write_first is not None
                    self._write(writes, int(batch.write_first[i]), state.tokens)
                if not batch.is_last[i]:
                    self._partial[rid] = state
                    continue
                ids.append(rid)
                toks.append(_token_of(state.crc, self.spec.vocab_size))
                lps.append(_logprob_of(state.crc))
                if top_k[i]:
                    k_ids, k_lps = _top_k(state.crc, int(top_k[i]), self.spec.vocab_size)
                    top_ids.append(k_ids)
                    top_lps.append(k_lps)
                if (labels := batch.labels_of(i)) is not None:
                    labs.append(sim_label_logprobs(toks[-1], lps[-1], labels, self.spec.vocab_size))
                if vectors is not None and state.embed_sum is not None:
                    n = start + len(chunk)
                    embeds.append(_pool(state.embed_sum, vectors[-1], n, opts))
                if i in writers:
                    keys, values = sim_kv(np.concatenate(state.tokens))
                    writers[i].keys[...], writers[i].values[...] = keys, values
        except BaseException:
            writers.discard()
            raise
        writers.close()
        return ForwardOutput(
            request_ids=np.asarray(ids, dtype=np.int64),
            tokens=np.asarray(toks, dtype=np.int32),
            logprobs=np.asarray(lps, dtype=np.float64),
            top_k_ids=np.concatenate(top_ids) if top_ids else np.empty(0, np.int32),
            top_k_logprobs=np.concatenate(top_lps) if top_lps else np.empty(0, np.float32),
            prompt_logprobs=np.concatenate(plps) if plps else np.empty(0, np.float32),
            embeddings=np.stack(embeds) if embeds else np.empty((0, 0), np.float32),
            prompt_top_k_ids=np.concatenate(p_ids) if p_ids else np.empty(0, np.int32),
            prompt_top_k_logprobs=np.concatenate(p_lps) if p_lps else np.empty(0, np.float32),
            label_logprobs=np.concatenate(labs) if labs else np.empty(0, np.float32),
        )

    def _write(self, slots: np.ndarray, first: int, parts: list[np.ndarray]) -> None:
        """Store prompt blocks first, first+1, ... in `slots`; `parts`: the prompt so far."""
        size = self.block_tokens
        prompt = np.concatenate(parts) if len(parts) > 1 else parts[0]
        for j, slot in enumerate(slots.tolist()):
            end = (first + j + 1) * size
            self._blocks.write(slot, prompt[end - size : end])

    def _inject_failure(self, tokens: np.ndarray) -> None:
        if self.spec.fail_token >= 0 and np.any(tokens == self.spec.fail_token):
            raise RuntimeError(f"injected failure: batch holds token {self.spec.fail_token}")

    def _inject_faults(self, tokens: np.ndarray) -> None:
        spec = self.spec
        if self.barrier is None:
            self._inject_failure(tokens)
        if spec.crash_token >= 0 and np.any(tokens == spec.crash_token):
            os._exit(70)  # a hard crash: no result, no goodbye
        if spec.hang_token >= 0 and np.any(tokens == spec.hang_token):
            time.sleep(3600)

    def free(self, request_ids: np.ndarray) -> None:
        for rid in request_ids.tolist():
            self._partial.pop(rid, None)
