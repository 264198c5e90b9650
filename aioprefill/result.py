"""`PrefillResult`: what `await engine.prefill(tokens)` returns."""

from __future__ import annotations

import msgspec
import numpy as np

from aioprefill.wire.kv import KVExport

__all__ = ["PrefillResult"]


class PrefillResult(msgspec.Struct, frozen=True, kw_only=True):
    """The greedy next token of one prompt, with where and when it was computed.

    Every `*_ns` field is `time.monotonic_ns()`; workers run on the same machine and share that
    clock, so differences across fields are meaningful. For a chunked prompt the batch fields
    describe the batch that carried its last chunk.

    The output options' fields are None unless asked for: `prompt_logprobs` float32[n-1]
    (log-probability of prompt token i given tokens < i, i = 1..n-1); `top_k_ids` int32[k] and
    `top_k_logprobs` float32[k] at the last position, best first; with `prompt_top_k=True`,
    `prompt_top_k_ids` int32[n-1, k] and `prompt_top_k_logprobs` float32[n-1, k], row i the k
    best tokens given tokens < i+1 (aligned with `prompt_logprobs`), best first; `embedding`
    float32[hidden] (the final-norm hidden state of the last token, or its mean over the
    prompt's tokens, L2-normalised with `normalize=True`); `kv`, a `KVExport` handle (`with
    r.kv as kv: kv.keys, kv.values`) to close when done; `label_logprobs` float32[len(
    label_token_ids)], the log-softmax over the whole vocabulary at the last position read at
    those ids, in their order (the greedy token's equals `logprob`, as float32). The arrays are
    read-only.

    An encoder model (BERT, XLM-RoBERTa) has no next token: `token` is -1 and `logprob` 0.0;
    every result carries `embedding` (the model's own pooling and Normalize unless `embed=` /
    `normalize=` ask otherwise) and, for a *ForSequenceClassification model, `scores`
    float32[num_labels], its classifier's raw logits (docs/embedding.md).

    `cached_tokens`: prompt tokens read from the worker's prefix cache instead of computed
    (whole blocks, never the last token; blocks another request of the same batch computed
    included); every output is the same as without the cache.
    """

    request_id: int
    token: int
    logprob: float
    worker: int
    batch_id: int
    batch_size: int
    batch_tokens: int
    num_tokens: int
    num_chunks: int
    cached_tokens: int = 0
    submitted_ns: int
    dispatched_ns: int
    forward_start_ns: int
    forward_end_ns: int
    finished_ns: int
    prompt_logprobs: np.ndarray | None = None
    top_k_ids: np.ndarray | None = None
    top_k_logprobs: np.ndarray | None = None
    embedding: np.ndarray | None = None
    prompt_top_k_ids: np.ndarray | None = None
    prompt_top_k_logprobs: np.ndarray | None = None
    label_logprobs: np.ndarray | None = None
    kv: KVExport | None = None
    scores: np.ndarray | None = None

    @property
    def ttft_ns(self) -> int:
        """Time to first token: from submission to the result resolving the caller's future."""
        return self.finished_ns - self.submitted_ns

    @property
    def queue_ns(self) -> int:
        """Time from submission until the forward that finished the prompt started."""
        return self.forward_start_ns - self.submitted_ns
