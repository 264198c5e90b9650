"""How a `PaddleRunner` forward reads and writes its prefix-cache slots (`prefix_blocks`).

The engine's plan for a chunk rides on the batch (`BatchPlan`). Inside the forward:

- at every layer, before request `i` attends (`PrefixForward.at_layer`), its read slots seed its
  `KVCache` with that layer's keys and values (as if earlier chunks had run; requests reading
  the same slots share one copy), and the blocks it
  completes are copied into its write slots: the part of a block that an earlier chunk computed
  comes from the request's `KVCache`, the rest from this chunk's rows. Requests go in batch
  order, so a request that reads a slot an earlier one writes in the same forward ("piggyback")
  finds that layer's keys and values there;
- after the last layer (`after_layers`), the written blocks' hidden rows and token ids are
  stored (token ids alone after a last layer run on the last rows: `paddle.last_rows`), then
  each reading request that asks for prompt log-probabilities, prompt top-k or mean pooling
  gets its cached positions' hidden rows and tokens for the head, and the prompt outputs its
  leading slots kept (up to the first that kept none); the other readers need none of them;
- after the head (`finish`), the prompt outputs of every written block that the chunk
  computed whole are kept in its slot;
- a chunk that does not end its prompt keeps, in its `KVCache`, the hidden rows and tokens of
  the block it leaves unfinished (`keep_tail`), for the next chunk's write.
"""

from __future__ import annotations

import numpy as np
import paddle

from aioprefill.wire import protocol
from aioprefill.wire.outputs import OPTS_OVER_PROMPT
from aioprefill.workers.paddle.attention import KVCache
from aioprefill.workers.paddle.head import Cached, Prefixes, host
from aioprefill.workers.prefix_blocks import SCORED_TOP_K, BatchPlan, BlockStore
from aioprefill.workers.runner import ForwardBatch, ForwardOutput

__all__ = ["PrefixForward", "keep_tail"]


def _host32(t: paddle.Tensor) -> np.ndarray:
    return host(t if t.dtype == paddle.float32 else t.astype("float32"))


def _to_device(a: np.ndarray, dtype: paddle.dtype) -> paddle.Tensor:
    t = paddle.to_tensor(a)
    return t if dtype == paddle.float32 else t.astype(dtype)


class PrefixForward:
    """One forward's reads and writes (made per batch that has a plan)."""

    def __init__(self, store: BlockStore, plan: BatchPlan, batch: ForwardBatch) -> None:
        self.store, self.plan = store, plan
        self._start = batch.start_pos.astype(np.int64).tolist()
        self._a = batch.offsets.astype(np.int64).tolist()
        self._writes = np.concatenate(plan.writes) if plan.writes else np.empty(0, np.int64)
        store.ready[self._writes] = False  # until the forward succeeds (`finish`)
        # Requests reading the same slots (a burst sharing a prefix) share one copy per layer:
        # the engine never writes a slot that the same batch reads for its old content.
        self._shared: dict[bytes, tuple[paddle.Tensor, paddle.Tensor]] = {}
        self._layer = -1

    def at_layer(
        self, layer: int, i: int, cache: KVCache, k: paddle.Tensor, v: paddle.Tensor
    ) -> None:
        """Seed request i's cache with its read slots' K/V of `layer`, then write the blocks
        it completes into its write slots."""
        store = self.store
        reads, writes = self.plan.reads[i], self.plan.writes[i]
        if len(reads):
            if layer != self._layer:
                self._shared, self._layer = {}, layer
            key = reads.tobytes()
            if key not in self._shared:
                keys, values = store.read_kv(layer, reads)
                self._shared[key] = (_to_device(keys, k.dtype), _to_device(values, v.dtype))
            cache.keys[layer], cache.values[layer] = self._shared[key]
        if not len(writes):
            return
        start, a, b = self._start[i], self._a[i], store.block_tokens
        lo = self.plan.first_write[i] * b
        hi = lo + len(writes) * b
        parts_k, parts_v = [], []
        if lo < start:  # the unfinished block of an earlier chunk: its K/V are in the cache
            past_k, past_v = cache.keys[layer], cache.values[layer]
            assert past_k is not None and past_v is not None
            parts_k.append(_host32(past_k[:, lo:start]))
            parts_v.append(_host32(past_v[:, lo:start]))
        first = a + max(lo, start) - start
        parts_k.append(_host32(k[:, first : a + hi - start]))
        parts_v.append(_host32(v[:, first : a + hi - start]))
        if len(parts_k) > 1:
            parts_k = [np.concatenate(parts_k, axis=1)]
            parts_v = [np.concatenate(parts_v, axis=1)]
        store.write_kv(layer, writes, parts_k[0], parts_v[0])

    def after_layers(
        self, x: paddle.Tensor, batch: ForwardBatch, caches: list[KVCache], *, last_rows: bool
    ) -> Prefixes:
        """Store the written blocks' hidden rows and tokens (`last_rows`: the last layer ran on
        each prompt's last row alone, x's other rows are stale: tokens only); then, per reading
        request (batch index), its cached positions' hidden rows (on the device), token ids and
        kept prompt outputs (when it asks for prompt logprobs: those of its leading slots that
        kept them), or for a request that asks for nothing over the prompt, nothing."""
        store, plan, b = self.store, self.plan, self.store.block_tokens
        for i, writes in enumerate(plan.writes):
            if not len(writes):
                continue
            start, a = self._start[i], self._a[i]
            lo = plan.first_write[i] * b
            hi = lo + len(writes) * b
            first = a + max(lo, start) - start
            rows = [] if last_rows else [_host32(x[first : a + hi - start])]
            tokens = [batch.tokens[first : a + hi - start]]
            if lo < start:  # the earlier chunk's part of the block it left unfinished
                tail = caches[i].tail
                assert tail is not None
                held = start - len(tail[1])
                rows.insert(0, tail[0][lo - held :])
                tokens.insert(0, tail[1][lo - held :])
            hidden = None if last_rows else np.concatenate(rows)
            store.write_rows(writes, hidden, np.concatenate(tokens))
        prefixes = {}
        asked, top = batch.has(protocol.OPT_PROMPT_LOGPROBS), batch.has(protocol.OPT_PROMPT_TOP_K)
        top_k, over_prompt = batch.top_k_of(), batch.has(OPTS_OVER_PROMPT)
        rows_of: dict[bytes, tuple[paddle.Tensor, np.ndarray]] = {}  # shared, as at_layer's
        for i, reads in enumerate(plan.reads):
            if len(reads) and not over_prompt[i]:
                prefixes[i] = Cached(None, None, None)
            elif len(reads):
                key = reads.tobytes()
                if key not in rows_of:
                    hidden, ids = store.read_rows(reads)
                    rows_of[key] = (_to_device(hidden, x.dtype), ids)
                k = int(top_k[i]) if top[i] else 0
                scores = store.read_scores(reads, k) if asked[i] else None
                prefixes[i] = Cached(*rows_of[key], scores)
        return prefixes

    def finish(self, batch: ForwardBatch, out: ForwardOutput) -> None:
        """The forward succeeded: its write slots hold their blocks, and each keeps the prompt
        outputs its request computed for every token of the block in this chunk (`out`'s
        columns, as the head answered them)."""
        self.store.ready[self._writes] = True
        asked, top = batch.has(protocol.OPT_PROMPT_LOGPROBS), batch.has(protocol.OPT_PROMPT_TOP_K)
        top_k, ends = batch.top_k_of(), batch.start_pos + batch.seq_lens()
        b, at, at_top = self.store.block_tokens, 0, 0
        for i in np.flatnonzero(asked).tolist():
            start, writes = self._start[i], self.plan.writes[i]
            first = 1 if start == 0 or len(self.plan.reads[i]) else start  # first token valued
            rows, k = int(ends[i]) - first, int(top_k[i]) if top[i] else 0
            lp = out.prompt_logprobs[at : at + rows]
            ids = out.prompt_top_k_ids[at_top : at_top + rows * k].reshape(rows, k)
            lps = out.prompt_top_k_logprobs[at_top : at_top + rows * k].reshape(rows, k)
            at, at_top = at + rows, at_top + rows * k
            if k > SCORED_TOP_K:
                continue
            for j, slot in enumerate(writes.tolist()):
                lo = (self.plan.first_write[i] + j) * b
                if max(lo, 1) < first:
                    continue  # an earlier chunk computed part of this block
                a = max(lo, 1) - first
                if lo == 0:  # the prompt's first token has no logprob: a 0 row in its place
                    vals = [
                        np.concatenate([np.zeros_like(c[:1]), c[: b - 1]]) for c in (lp, ids, lps)
                    ]
                else:
                    vals = [c[a : a + b] for c in (lp, ids, lps)]
                self.store.write_scores(slot, *vals)


def keep_tail(
    cache: KVCache, x: paddle.Tensor, tokens: np.ndarray, a: int, start: int, end: int, block: int
) -> None:
    """A chunk ending at `end` (not its prompt's last): keep the hidden rows and tokens of the
    block it leaves unfinished, positions [end // block * block, end), for the next chunk."""
    lo = end // block * block
    if lo == end:
        cache.tail = None
        return
    rows, ids = [], []
    if lo < start and cache.tail is not None:
        held = start - len(cache.tail[1])
        rows.append(cache.tail[0][lo - held :])
        ids.append(cache.tail[1][lo - held :])
    first = a + max(lo, start) - start
    rows.append(_host32(x[first : a + end - start]).copy())
    ids.append(np.array(tokens[first : a + end - start], dtype=np.int32))
    cache.tail = (np.concatenate(rows), np.concatenate(ids))
