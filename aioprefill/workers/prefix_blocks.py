"""The worker's prefix-cache block slots, and one batch's read/write plan for them.

The engine owns the slots (it decides which block each holds, `protocol.PrefillBatch`); the
worker only reads the slots a chunk names and writes the blocks a chunk completes into the slots
named. A slot holds one block of `block_tokens` prompt positions:

- per layer, this rank's KV heads' keys (after RoPE) and values, `[kv_heads, block_tokens,
  head_dim]` in the model's dtype (`kv_dtype`: float32; a bfloat16 model's as uint16 bits, a
  float16 model's as float16: half the bytes, so ~1.9x the tokens per byte of slots for
  SmolLM2): `write_kv` narrows the float32 arrays it is given (round to nearest even: exact
  where they hold values of that dtype already, as a deterministic bfloat16 CPU worker's K/V,
  rounded where they are made) and `read_kv` widens them back to float32 exactly;
- the final hidden state (before the final norm) of every position, float32 `[block_tokens,
  hidden]`: what prompt log-probabilities, prompt top-k and mean pooling over cached positions
  are computed from (the head and the norm run on these rows exactly as on computed ones), so a
  hit never recomputes a layer. Not kept by a forward that ran its last layer on the last rows
  alone (`paddle.last_rows`: no request of it asked for those options, and no KV store puts its
  blocks): such a slot is rowless (`has_rows`), and the engine never plans a read of its rows
  (`sched.prefix.BlockIndex.rowless`; `BatchPlan.check` refuses one);
- the block's token ids (int32): the targets of the cached positions' prompt log-probabilities;
- when the request that wrote it asked for prompt log-probabilities (and prompt top-k, up to
  `SCORED_TOP_K`) and computed every position of the block in the chunk that wrote it: those
  values, per token (its log-probability given the tokens before, the top-k of the position
  before), exactly as that request's outputs held them. A reader takes them as they are for the
  run of its slots from the first that hold them, and runs the LM head on the rest (a block
  written in the same forward holds none yet), so scoring a cached context (lm-eval sends every
  choice of a question as a full prompt) runs the head only on the tokens not yet scored.

Memory: one `np.empty` per array, allocated once at start for `prefix_cache_bytes //
block_bytes` slots and never touched until written, so the worker's RSS grows with the slots
used. Layout `[layer][kv_head, slot, position, dim]`: gathering a request's slots of one layer
is one fancy index that lands as `[kv_heads, slots * block_tokens, dim]`, what attention reads.

Bytes per block (block_tokens=16, one rank): 4 * 16 * (2 * layers * kv_heads * head_dim +
hidden + 2 + 2 * 20) + 2: SmolLM2-135M (30 layers, 3 KV heads of 64, hidden 576) 776,834
bytes (~759 KiB: 1 GiB holds 1,382 blocks, 22,112 tokens); the tiny default model (4 layers,
4 KV heads of 32, hidden 256) 84,610 bytes (~83 KiB). A TP rank keeps its share of the KV
heads (and all of the hidden rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aioprefill.wire.outputs import OPTS_OVER_PROMPT
from aioprefill.workers.runner import ForwardBatch

__all__ = ["SCORED_TOP_K", "BatchPlan", "BlockStore", "bf16_bits"]

# The most prompt top-k a slot keeps per position (OpenAI's `logprobs` stops at 20).
SCORED_TOP_K = 20
# How a slot stores a model dtype's K/V (NumPy has no bfloat16: its bits).
_KV_NUMPY: dict[str, type] = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 values -> the bits of the nearest bfloat16 (round to nearest even, as Paddle's
    cast; NaNs stay NaN): exactly the high halves where the values are bfloat16 values already
    (what a deterministic bfloat16 CPU worker's K/V are; a default one rounds them only here,
    as they leave for a slot or a KV export: `paddle.runner`)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    bits = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    nan = np.isnan(u.view(np.float32))
    if nan.any():  # a payload in the low half would have carried into the exponent
        bits[nan] = np.uint16(0x7FC0)
    return bits


def _widen_bf16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits -> the float32 values (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


class BlockStore:
    """`num_blocks` slots of `block_tokens` positions each (see the module docstring)."""

    def __init__(
        self,
        num_blocks: int,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        hidden_size: int,
        block_tokens: int,
        kv_dtype: str = "float32",
    ) -> None:
        self.block_tokens = block_tokens
        self.kv_dtype = kv_dtype
        self._kv_np = _KV_NUMPY.get(kv_dtype, np.float32)
        self._allocate(num_blocks, (num_layers, kv_heads, head_dim, hidden_size))

    def _allocate(self, num_blocks: int, dims: tuple[int, int, int, int]) -> None:
        num_layers, kv_heads, head_dim, hidden_size = dims
        block_tokens = self.block_tokens
        self.num_blocks = num_blocks
        shape = (num_layers, kv_heads, num_blocks, block_tokens, head_dim)
        self.keys: np.ndarray = np.empty(shape, dtype=self._kv_np)  # lazily touched (RSS)
        self.values: np.ndarray = np.empty(shape, dtype=self._kv_np)
        self.hidden = np.empty((num_blocks, block_tokens, hidden_size), dtype=np.float32)
        self.tokens = np.empty((num_blocks, block_tokens), dtype=np.int32)
        # Per slot: a forward wrote it whole (a failed forward's write slots are not: reading
        # one is refused rather than answered from half-written or stale memory).
        self.ready = np.zeros(num_blocks, dtype=bool)
        self.has_rows = np.zeros(num_blocks, dtype=bool)  # per slot: `hidden` holds its rows
        # Per slot: -1 no prompt logprobs kept; else they are, with this many top-k of each.
        self.scored = np.empty(num_blocks, dtype=np.int16)
        self.logprobs = np.empty((num_blocks, block_tokens), dtype=np.float32)
        top = (num_blocks, block_tokens, SCORED_TOP_K)
        self.top_ids = np.empty(top, dtype=np.int32)
        self.top_logprobs = np.empty(top, dtype=np.float32)

    def add_slots(self, extra: int) -> None:
        """`extra` slots past the engine's, which its plans never name (the KV store tier's
        scratch: blocks loaded past the slots a prompt was given); before any is stored."""
        if self.ready.any():
            raise RuntimeError("slots added to a prefix cache already in use")
        layers, heads, n, _, dim = self.keys.shape
        self._allocate(n + extra, (layers, heads, dim, self.hidden.shape[-1]))

    @staticmethod
    def block_bytes(
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        hidden_size: int,
        block_tokens: int,
        kv_dtype: str = "float32",
    ) -> int:
        """Bytes one slot takes: K and V of every layer, the hidden rows, the token ids, the
        prompt logprobs and top-k."""
        kv = np.dtype(_KV_NUMPY.get(kv_dtype, np.float32)).itemsize
        kv_bytes = kv * block_tokens * 2 * num_layers * kv_heads * head_dim
        return kv_bytes + 4 * block_tokens * (hidden_size + 2 + 2 * SCORED_TOP_K) + 2

    def slot_arrays(self, slot: int) -> list[np.ndarray]:
        """One slot's every array (views), in a fixed order: what the KV store keeps of it
        (`aioprefill.kvstore`; their bytes add up to `block_bytes`)."""
        return [
            *(self.keys[:, :, slot], self.values[:, :, slot], self.hidden[slot], self.tokens[slot]),
            *(self.logprobs[slot], self.top_ids[slot], self.top_logprobs[slot]),
            self.scored[slot : slot + 1],
        ]

    def loaded(self, slot: int) -> None:
        """`slot_arrays(slot)` were filled from the KV store (checked): it holds its block."""
        self.ready[slot] = self.has_rows[slot] = True

    def layout(self) -> str:
        """Names the slot's byte layout (store keys: blocks of other layouts never mix)."""
        layers, heads, _, b, dim = self.keys.shape
        hidden = self.hidden.shape[-1]
        name = f"paddle-slot-v1 L{layers} kv{heads}x{dim} h{hidden} B{b} top{SCORED_TOP_K}"
        return name if self.kv_dtype == "float32" else f"{name} kv-{self.kv_dtype}"

    def read_kv(self, layer: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One layer's keys and values of `slots`, in order: `[kv_heads, n * B, head_dim]`."""
        k, v = self.keys[layer][:, slots], self.values[layer][:, slots]
        heads, n, b, dim = k.shape
        k, v = k.reshape(heads, n * b, dim), v.reshape(heads, n * b, dim)
        if k.dtype == np.uint16:  # bfloat16 bits: widen exactly
            return _widen_bf16(k), _widen_bf16(v)
        return k.astype(np.float32, copy=False), v.astype(np.float32, copy=False)

    def write_kv(self, layer: int, slots: np.ndarray, keys: np.ndarray, values: np.ndarray) -> None:
        """Store `[kv_heads, n * B, head_dim]` keys and values as blocks into `slots`."""
        heads, _, dim = keys.shape
        shape = (heads, len(slots), self.block_tokens, dim)
        if self._kv_np is np.uint16:  # bfloat16 bits, rounded (exact for bfloat16 values)
            keys, values = bf16_bits(keys), bf16_bits(values)
        self.keys[layer][:, slots] = keys.reshape(shape)
        self.values[layer][:, slots] = values.reshape(shape)

    def read_rows(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Hidden rows `[n * B, hidden]` and token ids `[n * B]` of `slots`, in order."""
        return (
            self.hidden[slots].reshape(-1, self.hidden.shape[-1]),
            self.tokens[slots].reshape(-1),
        )

    def write_rows(self, slots: np.ndarray, hidden: np.ndarray | None, tokens: np.ndarray) -> None:
        """The blocks' token ids and hidden rows (None: rowless slots)."""
        if hidden is not None:
            self.hidden[slots] = hidden.reshape(len(slots), self.block_tokens, -1)
        self.has_rows[slots] = hidden is not None
        self.tokens[slots] = tokens.reshape(len(slots), self.block_tokens)
        self.scored[slots] = -1  # until `write_scores`

    def write_scores(
        self, slot: int, logprobs: np.ndarray, top_ids: np.ndarray, top_logprobs: np.ndarray
    ) -> None:
        """One slot's prompt logprobs [B] and top-k [B, k] (k = 0, or at most SCORED_TOP_K)."""
        k = top_ids.shape[1]
        self.logprobs[slot] = logprobs
        self.top_ids[slot, :, :k] = top_ids
        self.top_logprobs[slot, :, :k] = top_logprobs
        self.scored[slot] = k

    def read_scores(
        self, slots: np.ndarray, top_k: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The kept prompt logprobs [n * B] and top-k [n * B, top_k] of the first n of `slots`,
        the longest run from the first that holds them (with at least `top_k` of each
        position), or None when the first does not. A block written in this very forward
        (piggyback) holds none yet: its readers' head runs on its rows only, not on the whole
        prefix (lm-eval's choices of one question read the context's old blocks and the
        question's new ones together)."""
        held = self.scored[slots] >= top_k
        n = len(slots) if held.all() else int(np.argmin(held))
        if n == 0:
            return None
        b, first = self.block_tokens, slots[:n]
        return (
            self.logprobs[first].reshape(-1),
            self.top_ids[first, :, :top_k].reshape(n * b, top_k),
            self.top_logprobs[first, :, :top_k].reshape(n * b, top_k),
        )


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """One batch's prefix-cache instructions per request: the slots it reads (its prompt's
    first blocks) and the slots it writes with the blocks `first_write`, `first_write + 1`, ..."""

    reads: list[np.ndarray]
    writes: list[np.ndarray]
    first_write: list[int]

    @classmethod
    def of(cls, batch: ForwardBatch) -> BatchPlan | None:
        """The batch's plan, or None when it neither reads nor writes a slot."""
        ro, rs, wo, ws, wf = (
            batch.read_offsets,
            batch.read_slots,
            batch.write_offsets,
            batch.write_slots,
            batch.write_first,
        )
        if ro is None or rs is None or wo is None or ws is None or wf is None:
            return None
        if not len(rs) and not len(ws):
            return None
        n = batch.size
        reads = [rs[ro[i] : ro[i + 1]].astype(np.int64) for i in range(n)]
        writes = [ws[wo[i] : wo[i + 1]].astype(np.int64) for i in range(n)]
        return cls(reads, writes, [int(f) for f in wf.tolist()])

    def check(self, batch: ForwardBatch, store: BlockStore) -> None:
        """ValueError for instructions this worker cannot follow, before anything runs: a slot
        past the store, reads that do not match the chunk's start or a slot no forward wrote
        (unless an earlier request of the batch writes it), writes past the chunk or before
        the positions it holds."""
        num_blocks, block_tokens = store.num_blocks, store.block_tokens
        ends = (batch.start_pos.astype(np.int64) + batch.seq_lens()).tolist()
        over_prompt = batch.has(OPTS_OVER_PROMPT).tolist()
        written: set[int] = set()
        for i, (rid, start, end) in enumerate(
            zip(batch.request_ids.tolist(), batch.start_pos.tolist(), ends, strict=True)
        ):
            reads, writes = self.reads[i], self.writes[i]
            for slots, what in ((reads, "reads"), (writes, "writes")):
                if len(slots) and int(slots.max()) >= num_blocks:
                    raise ValueError(f"request {rid} {what} slot past this worker's {num_blocks}")
            if len(reads) and start != len(reads) * block_tokens:
                raise ValueError(
                    f"request {rid}: {len(reads)} blocks read, but its chunk starts at {start}"
                )
            for slot in reads[~store.ready[reads]].tolist():
                if slot not in written:
                    raise ValueError(f"request {rid} reads slot {slot}, which holds no block")
            if over_prompt[i]:  # (an earlier request writing it keeps them: not trimmed)
                for slot in reads[~store.has_rows[reads]].tolist():
                    if slot not in written:
                        raise ValueError(f"request {rid} reads the hidden rows of slot {slot}, "
                                         "which has none")  # fmt: skip
            written.update(writes.tolist())
            if len(writes):
                lo = self.first_write[i] * block_tokens
                if lo + len(writes) * block_tokens > end:
                    raise ValueError(f"request {rid}: writes blocks past its chunk's end {end}")
                # K/V of every earlier position is in the request's state, but its hidden rows
                # only from the block the previous chunk left unfinished.
                held = start // block_tokens * block_tokens
                if lo < held:
                    raise ValueError(
                        f"request {rid}: writes block {lo // block_tokens}, before its chunk"
                    )
