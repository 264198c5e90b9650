"""`SimRunner`: a worker-side model that sleeps for the `SimModel` cost model.

It is a real worker (real process, rings, eventfds) whose forward costs a known, tunable time,
for scheduling experiments. Its token for a prompt is a CRC32 of the prompt's int32 bytes
modulo the vocabulary, computed incrementally across chunks, so the result of a chunked prompt
equals the unchunked one and tests can check each caller got its own answer.

As a rank of a tensor- or expert-parallel group it meets its peers at a real barrier after
every forward (`SocketBarrier`), so a step costs what the slowest rank costs and a rank that
skips a step blocks the others, as the collectives of a real model would. An empty batch (what
an idle expert-parallel rank gets) sleeps the fixed cost and joins the barrier.
"""

from __future__ import annotations

import os
import time
import zlib

import numpy as np

from aioprefill.config import SimModel
from aioprefill.workers.barrier import SocketBarrier
from aioprefill.workers.runner import ForwardBatch, ForwardOutput

__all__ = ["SimRunner", "expected_logprob", "expected_token"]


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


class SimRunner:
    device = "sim"

    def __init__(self, spec: SimModel, barrier: SocketBarrier | None = None) -> None:
        self.spec = spec
        self.barrier = barrier
        self._partial: dict[int, int] = {}  # request id -> CRC of the chunks seen so far

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        seq_lens = batch.seq_lens()
        self._inject_faults(batch.tokens)
        time.sleep(self.spec.forward_seconds([int(n) for n in seq_lens]))
        if self.barrier is not None:
            self.barrier.wait()  # the step ends when the slowest rank's forward does
            self._inject_failure(batch.tokens)  # after the barrier: the group stays in step
            if self.barrier.rank == self.spec.slow_rank:
                time.sleep(self.spec.slow_rank_ms * 1e-3)
        ids, toks, lps = [], [], []
        offsets = batch.offsets
        for i in range(batch.size):
            rid = int(batch.request_ids[i])
            chunk = batch.tokens[offsets[i] : offsets[i + 1]]
            crc = zlib.crc32(
                chunk.tobytes(), self._partial.pop(rid, 0) if batch.start_pos[i] else 0
            )
            if batch.is_last[i]:
                ids.append(rid)
                toks.append(_token_of(crc, self.spec.vocab_size))
                lps.append(_logprob_of(crc))
            else:
                self._partial[rid] = crc
        return ForwardOutput(
            request_ids=np.asarray(ids, dtype=np.int64),
            tokens=np.asarray(toks, dtype=np.int32),
            logprobs=np.asarray(lps, dtype=np.float64),
        )

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
