"""The model interface a worker drives: one `forward` over a packed batch, and `free`.

A `ForwardBatch` holds requests back to back (no padding). A request may be one chunk of a
longer prompt: `start_pos > 0` means earlier chunks were run by this same worker and the runner
kept their state (the KV cache); `is_last` says the chunk ends the prompt, so the runner returns
a result for it and drops its state. `SimRunner` and `PaddleRunner` implement this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = ["ForwardBatch", "ForwardOutput", "ModelRunner"]


@dataclass(slots=True, frozen=True)
class ForwardBatch:
    request_ids: np.ndarray  # int64[n]
    offsets: np.ndarray  # int32[n+1]; request i's tokens are tokens[offsets[i]:offsets[i+1]]
    tokens: np.ndarray  # int32[offsets[-1]]
    start_pos: np.ndarray  # int32[n]; position of each chunk's first token in its prompt
    is_last: np.ndarray  # bool[n]; chunk ends its prompt: produce a result, free its state

    @property
    def size(self) -> int:
        return len(self.request_ids)

    def seq_lens(self) -> np.ndarray:
        return np.diff(self.offsets)


@dataclass(slots=True, frozen=True)
class ForwardOutput:
    """Results for the requests of the batch whose `is_last` is set, in batch order."""

    request_ids: np.ndarray  # int64[k]
    tokens: np.ndarray  # int32[k]; greedy next token
    logprobs: np.ndarray  # float64[k]; log-probability of that token


class ModelRunner(Protocol):
    device: str

    def forward(self, batch: ForwardBatch) -> ForwardOutput: ...

    def free(self, request_ids: np.ndarray) -> None:
        """Drop any state kept for these requests (cancelled or failed mid-prompt)."""
        ...
