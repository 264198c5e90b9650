"""The model interface a worker drives: one `forward` over a packed batch, and `free`.

A `ForwardBatch` holds requests back to back (no padding). A request may be one chunk of a
longer prompt: `start_pos > 0` means earlier chunks were run by this same worker and the runner
kept their state (the KV cache); `is_last` says the chunk ends the prompt, so the runner returns
a result for it and drops its state. `SimRunner` and `PaddleRunner` implement this.

Output options ride along per request (`options`: `OPT_*` bits from `aioprefill.wire.protocol`,
`top_k`, `kv_names`) on every chunk of a prompt; a runner computes only what was asked:

- prompt log-probabilities: one float32 per token of the chunk that has a predecessor
  (`end - max(start, 1)` values), for every chunk, so the engine assembles a chunked prompt's;
- with `OPT_PROMPT_TOP_K` besides, the request's `top_k` best tokens at each of those positions
  (ids and log-probabilities, `top_k` values per prompt logprob, best first);
- top-k, label token logprobs (`label_offsets`/`label_ids`: the log-softmax over the whole
  vocabulary at the last position, read at each id), embeddings and the KV export: once, with
  the chunk that ends the prompt.

A chunk that reads prefix cache slots (`read_*`, starting at `len(reads) * block_tokens`) is
its prompt's first chunk computed and answers as one: its prompt log-probabilities (and prompt
top-k) cover every position from 1 (`end - 1` values, cached positions included), and its
embeddings and KV export cover the cached positions too, as for the whole prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from aioprefill.wire.protocol import OPT_RETURN_KV

__all__ = ["ForwardBatch", "ForwardOutput", "ModelRunner"]

_NO_NAMES: tuple[str, ...] = ()


def _empty(dtype: str) -> np.ndarray:
    return np.empty(0, dtype=dtype)


@dataclass(slots=True, frozen=True)
class ForwardBatch:
    request_ids: np.ndarray  # int64[n]
    offsets: np.ndarray  # int32[n+1]; request i's tokens are tokens[offsets[i]:offsets[i+1]]
    tokens: np.ndarray  # int32[offsets[-1]]
    start_pos: np.ndarray  # int32[n]; position of each chunk's first token in its prompt
    is_last: np.ndarray  # bool[n]; chunk ends its prompt: produce a result, free its state
    options: np.ndarray | None = None  # uint8[n] of OPT_* bits; None: no options anywhere
    top_k: np.ndarray | None = None  # int32[n]; None: 0 for every request
    # One shared-memory segment name per request with OPT_RETURN_KV, in batch order.
    kv_names: tuple[str, ...] = _NO_NAMES
    # Label token ids: request i's are label_ids[label_offsets[i]:label_offsets[i+1]]; None: none.
    label_offsets: np.ndarray | None = None  # int32[n+1]
    label_ids: np.ndarray | None = None  # int32
    # Prefix cache instructions (`protocol.PrefillBatch` says what they mean); None: the batch
    # neither reads nor writes cached blocks. A chunk with reads starts its prompt afresh at
    # start_pos = len(reads) * block_tokens.
    read_offsets: np.ndarray | None = None  # int32[n+1] into read_slots
    read_slots: np.ndarray | None = None  # int32
    write_offsets: np.ndarray | None = None  # int32[n+1] into write_slots
    write_slots: np.ndarray | None = None  # int32
    write_first: np.ndarray | None = None  # int32[n]: prompt block held by the first write slot
    write_hashes: np.ndarray | None = None  # uint64, the written blocks' hashes (store keys)
    tail_offsets: np.ndarray | None = None  # int32[n+1] into tail_hashes (store only)
    tail_hashes: np.ndarray | None = None  # uint64: blocks computed past each chunk's writes
    token_types: np.ndarray | None = None  # uint8[offsets[-1]] (encoders); None: all zero

    @property
    def size(self) -> int:
        return len(self.request_ids)

    def seq_lens(self) -> np.ndarray:
        return np.diff(self.offsets)

    def has(self, bit: int) -> np.ndarray:
        """bool[n]: which requests asked for option `bit`."""
        if self.options is None:
            return np.zeros(self.size, dtype=bool)
        return (self.options & bit) != 0

    def kv_name_of(self) -> dict[int, str]:
        """Batch index -> KV export segment name, for the requests with OPT_RETURN_KV."""
        wants = np.flatnonzero(self.has(OPT_RETURN_KV)).tolist()
        return dict(zip(wants, self.kv_names, strict=True))

    def labels_of(self, i: int) -> np.ndarray | None:
        """Request i's label token ids (int32), or None when it asked for none."""
        if self.label_offsets is None or self.label_ids is None:
            return None
        a, b = int(self.label_offsets[i]), int(self.label_offsets[i + 1])
        return self.label_ids[a:b] if b > a else None

    def top_k_of(self) -> np.ndarray:
        return np.zeros(self.size, dtype=np.int32) if self.top_k is None else self.top_k


@dataclass(slots=True, frozen=True)
class ForwardOutput:
    """Results for the requests of the batch whose `is_last` is set, in batch order."""

    request_ids: np.ndarray  # int64[k]
    tokens: np.ndarray  # int32[k]; greedy next token
    logprobs: np.ndarray  # float64[k]; log-probability of that token
    # Finished requests with top_k > 0, back to back in batch order, best first.
    top_k_ids: np.ndarray = field(default_factory=lambda: _empty("int32"))
    top_k_logprobs: np.ndarray = field(default_factory=lambda: _empty("float32"))
    # Every chunk with OPT_PROMPT_LOGPROBS, back to back in batch order (last or not).
    prompt_logprobs: np.ndarray = field(default_factory=lambda: _empty("float32"))
    # Every chunk with OPT_PROMPT_TOP_K: [rows, top_k] flattened, rows as in prompt_logprobs.
    prompt_top_k_ids: np.ndarray = field(default_factory=lambda: _empty("int32"))
    prompt_top_k_logprobs: np.ndarray = field(default_factory=lambda: _empty("float32"))
    # float32[m, dim]: finished requests with an OPT_EMBED_* bit, in batch order.
    embeddings: np.ndarray = field(default_factory=lambda: np.empty((0, 0), dtype=np.float32))
    # Finished requests with label ids, back to back in batch order: one logprob per id.
    label_logprobs: np.ndarray = field(default_factory=lambda: _empty("float32"))
    # float32[k, num_labels]: an encoder classifier's logits for every finished request.
    scores: np.ndarray = field(default_factory=lambda: np.empty((0, 0), dtype=np.float32))


class ModelRunner(Protocol):
    """A worker's model. A runner with a prefix cache also has `cache_blocks` (its slots,
    0..n-1) and `block_bytes` (bytes per slot), which the worker reports in `Ready`; one
    without them reports 0 and is never sent cache reads or writes."""

    device: str

    def forward(self, batch: ForwardBatch) -> ForwardOutput: ...

    def free(self, request_ids: np.ndarray) -> None:
        """Drop any state kept for these requests (cancelled or failed mid-prompt)."""
        ...
