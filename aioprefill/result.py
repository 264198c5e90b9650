"""`PrefillResult`: what `await engine.prefill(tokens)` returns."""

from __future__ import annotations

import msgspec

__all__ = ["PrefillResult"]


class PrefillResult(msgspec.Struct, frozen=True, kw_only=True):
    """The greedy next token of one prompt, with where and when it was computed.

    Every `*_ns` field is `time.monotonic_ns()`; workers run on the same machine and share that
    clock, so differences across fields are meaningful. For a chunked prompt the batch fields
    describe the batch that carried its last chunk.
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
    submitted_ns: int
    dispatched_ns: int
    forward_start_ns: int
    forward_end_ns: int
    finished_ns: int

    @property
    def ttft_ns(self) -> int:
        """Time to first token: from submission to the result resolving the caller's future."""
        return self.finished_ns - self.submitted_ns

    @property
    def queue_ns(self) -> int:
        """Time from submission until the forward that finished the prompt started."""
        return self.forward_start_ns - self.submitted_ns
