"""`OutputHead`: what a PaddleRunner computes from the final hidden states, per request.

Every finished request gets its greedy token and log-probability; the output options add, only
for the requests that asked: top-k and label token logprobs (read from the same logits as the
greedy token's, by the same float32/float64 rule) at the last position, prompt
log-probabilities (the LM head on every position of *those* requests: a 512-token prompt costs
512 head rows, its batch-mates none) and, with `OPT_PROMPT_TOP_K`, the top-k at each of those
positions, and a pooled final-norm hidden state. A chunked prompt carries what its next chunk
needs (the last row's hidden state for the next token's log-probability, the running sum for
mean pooling), so its outputs equal the unchunked ones.

The log-sum-exp and the rest of each row's results come from `paddle.logits.head_rows`: on the
CPU the head runs a slice of the vocabulary at a time and reduces each slice's logits while they
are in cache (float32 exponentials summed pairwise, slices joined in float64: ~1e-7 from an exact
sum); a GPU keeps the logits on the device, sums in float64 there and moves only per-row results.
Batch invariance: every reduction is per row; with `tile_rows` (deterministic) the head runs on
fixed tiles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import paddle

from aioprefill.wire import protocol
from aioprefill.workers.paddle.logits import HEAD_ROWS, HeadRows, head_rows
from aioprefill.workers.paddle.norm import RmsNorm
from aioprefill.workers.paddle.shard import Shard
from aioprefill.workers.runner import ForwardBatch, ForwardOutput

__all__ = ["Cached", "OutputHead", "Prefixes", "host"]

_EMBED = protocol.OPT_EMBED_LAST | protocol.OPT_EMBED_MEAN


class Cached(NamedTuple):
    """A chunk's cached positions [0, n): their hidden rows [n, hidden] (before the final norm)
    and token ids int32[n], and the prompt outputs the leading slots kept, positions [0, m <= n)
    (logprob float32[m], top-k ids int32[m, k], logprobs float32[m, k]; token 0's unused);
    all None for a chunk that asks for nothing over the prompt (`wire.outputs.OPTS_OVER_PROMPT`)."""

    hidden: paddle.Tensor | None
    tokens: np.ndarray | None
    scores: tuple[np.ndarray, np.ndarray, np.ndarray] | None


Prefixes = dict[int, Cached]  # by batch index


def host(t: paddle.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor (zero-copy through DLPack), or a host copy of a GPU one; a
    bfloat16 tensor widened to float32 first (exact: NumPy has no bfloat16, and `.numpy()` gives
    its raw uint16 bits, which read as numbers are garbage)."""
    if t.dtype == paddle.bfloat16:
        t = t.astype("float32")
    if t.place.is_cpu_place():
        return np.from_dlpack(t)
    return t.numpy()


class OutputHead:
    """Final norm + LM head + log-softmax, and the per-request output options."""

    def __init__(
        self,
        lm_head: paddle.Tensor,
        norm: paddle.Tensor,
        eps: float,
        *,
        rms_norm: RmsNorm,
        tile_rows: int | None,
        min_rows: int = 1,
        shard: Shard | None = None,
        product: Callable[[paddle.Tensor, paddle.Tensor], paddle.Tensor] | None = None,
        pad_last: bool = False,
        product_last: Callable[[paddle.Tensor, paddle.Tensor], paddle.Tensor] | None = None,
    ) -> None:
        """`rms_norm`: the final norm's kernel (`paddle.norm.rms_norm_for`). `shard`: under
        tensor parallelism `lm_head` is this rank's vocabulary slice, and each tile's per-row
        results are joined across the ranks (`Shard.head_rows`). `product(x, w)` is x @ w.T
        (`paddle.gemm.Products.product`; default Paddle's matmul). Prompt log-probabilities run
        on tiles of at least `min_rows` rows (zero rows added; `paddle.rows`), and with
        `pad_last` (a bfloat16 CPU worker, whose rows are otherwise bitwise batch-invariant)
        the last rows too; `product_last` (default `product`) multiplies those last rows
        (`paddle.gemm.Products.product_few`)."""
        self._lm_head = lm_head
        # the weight prompt rows multiply: `lm_head`, or its extended bf16 copy (lo_channels)
        self.prompt_head = lm_head
        self._pad_last = pad_last
        self._shard = shard if shard is not None and shard.tp_size > 1 else None
        self._norm, self._eps, self._rms_norm = norm, eps, rms_norm
        self._product = product or _matmul_t
        self._product_last = product_last or self._product
        self._tile, self._min_rows = tile_rows, min_rows  # tile_rows: fixed tiles (deterministic)
        self._carry: dict[int, paddle.Tensor] = {}  # rid -> last row's hidden state [1, hidden]
        self._sums: dict[int, np.ndarray] = {}  # rid -> float64 sum of final-norm rows so far

    def free(self, request_ids: list[int]) -> None:
        for rid in request_ids:
            self._carry.pop(rid, None)
            self._sums.pop(rid, None)

    @property
    def num_cached(self) -> int:
        return len(self._carry) + len(self._sums)

    # ------------------------------------------------------------------ the batch

    def __call__(
        self, x: paddle.Tensor, batch: ForwardBatch, prefixes: Prefixes | None = None
    ) -> ForwardOutput:
        """Outputs for a forward whose final hidden states (before the norm) are `x`.
        `prefixes`: per batch index of a chunk that read cached blocks, the hidden rows and
        token ids of those positions; its outputs cover them as if it had computed them."""
        offsets = batch.offsets.astype(np.int64)
        rids = batch.request_ids.tolist()
        prefixes = prefixes or {}
        starts = batch.start_pos.tolist()
        self.free([rid for i, rid in enumerate(rids) if starts[i] == 0 or i in prefixes])
        plp, p_ids, p_lps = self._prompt_logprobs(x, batch, offsets, rids, prefixes)
        self._mean_sums(x, batch, offsets, rids, prefixes)
        done = np.flatnonzero(batch.is_last)
        if len(done) == 0:
            empty = np.empty(0, dtype=np.int64)
            return ForwardOutput(
                empty,
                empty.astype(np.int32),
                empty.astype(np.float64),
                prompt_logprobs=plp,
                prompt_top_k_ids=p_ids,
                prompt_top_k_logprobs=p_lps,
            )
        top_k = batch.top_k_of()[done]
        last_rows = paddle.gather(x, paddle.to_tensor(offsets[done + 1] - 1))
        labels = [batch.labels_of(i) for i in done.tolist()]
        h, r = self._rows(last_rows, int(top_k.max()), labels=_label_matrix(labels))
        k_ids = [r.top_ids[j, :k] for j, k in enumerate(top_k.tolist()) if k]
        k_lps = [r.top_vals[j, :k] - r.lse[j] for j, k in enumerate(top_k.tolist()) if k]
        label_lps = [
            (r.picked[j, : len(ids)] - r.lse[j]).astype(np.float32)  # type: ignore[index]
            for j, ids in enumerate(labels)
            if ids is not None
        ]
        embeds = []
        options = batch.options
        if options is not None:
            for j, i in enumerate(done.tolist()):
                opts = int(options[i])
                if opts & protocol.OPT_EMBED_MEAN:
                    length = int(batch.start_pos[i] + offsets[i + 1] - offsets[i])
                    v = self._sums.pop(rids[i]) / length
                elif opts & protocol.OPT_EMBED_LAST and h is not None:
                    v = h[j].astype(np.float64)
                else:
                    continue
                if opts & protocol.OPT_NORMALIZE:
                    v = v / np.linalg.norm(v)
                embeds.append(v.astype(np.float32))
        return ForwardOutput(
            request_ids=batch.request_ids[done].astype(np.int64),
            tokens=r.ids.astype(np.int32),
            logprobs=r.best - r.lse,
            top_k_ids=np.concatenate(k_ids) if k_ids else np.empty(0, np.int32),
            top_k_logprobs=np.concatenate(k_lps).astype(np.float32)
            if k_lps
            else np.empty(0, np.float32),
            prompt_logprobs=plp,
            prompt_top_k_ids=p_ids,
            prompt_top_k_logprobs=p_lps,
            embeddings=np.stack(embeds) if embeds else np.empty((0, 0), np.float32),
            label_logprobs=np.concatenate(label_lps) if label_lps else np.empty(0, np.float32),
        )

    def _prompt_logprobs(
        self,
        x: paddle.Tensor,
        batch: ForwardBatch,
        offsets: np.ndarray,
        rids: list[int],
        prefixes: Prefixes,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """float32, per chunk that asked, back to back: log p(token j | tokens < j) for each of
        the chunk's tokens that has a predecessor (the first chunk's first token has none; a
        chunk after cached blocks answers for those positions too, from their hidden rows); and
        for the chunks with OPT_PROMPT_TOP_K, their `top_k` best ids / logprobs at those rows.
        Rows with and without top-k go through the head apart (top-k only where asked; every
        result is per row, so the split changes no value)."""
        asked = np.flatnonzero(batch.has(protocol.OPT_PROMPT_LOGPROBS))
        wants_top = batch.has(protocol.OPT_PROMPT_TOP_K)
        top_k = batch.top_k_of()
        groups: dict[bool, tuple[list[paddle.Tensor], list[np.ndarray]]] = {}
        # per asked chunk: (top-k?, rows, k, values kept in the cache for its first rows)
        sizes: list[tuple[bool, int, int, tuple[np.ndarray, ...] | None]] = []
        for i in asked.tolist():
            a, b = int(offsets[i]), int(offsets[i + 1])
            parts, targets = groups.setdefault(bool(wants_top[i]), ([], []))
            carried = self._carry.pop(rids[i], None)
            rows, kept = 0, None
            if i in prefixes:  # cached positions: kept values [1, m), the head on the rest
                hidden, tokens, scores = prefixes[i]
                assert hidden is not None and tokens is not None  # (it asked: rows were read)
                kept = None if scores is None else tuple(a[1:] for a in scores)
                m = 1 if scores is None else max(len(scores[0]), 1)
                if len(tokens) > m:
                    parts.append(hidden[m - 1 : -1])
                    targets.append(tokens[m:])
                    rows += len(tokens) - m
                carried = hidden[-1:]
            if carried is not None:  # the previous chunk's last row predicts this chunk's first
                parts.append(carried)
                targets.append(batch.tokens[a : a + 1])
                rows += 1
            if b - a > 1:
                parts.append(x[a : b - 1])
                targets.append(batch.tokens[a + 1 : b])
                rows += b - a - 1
            if not batch.is_last[i]:
                self._carry[rids[i]] = x[b - 1 : b].clone()
            sizes.append((bool(wants_top[i]), rows, int(top_k[i]), kept))
        done: dict[bool, HeadRows] = {}
        for top, (parts, targets) in groups.items():
            if parts:
                h = paddle.concat(parts) if len(parts) > 1 else parts[0]
                kmax = max(k for t, _, k, _ in sizes if t) if top else 0
                done[top] = self._rows(h, kmax, np.concatenate(targets).astype(np.int64))[1]
        plps, ids, lps, at = [], [], [], {False: 0, True: 0}
        for top, rows, k, kept in sizes:
            r, lo = done.get(top), at[top]
            at[top] = lo + rows
            if kept is not None:
                plps.append(kept[0])
                if top:
                    ids.append(kept[1].ravel())
                    lps.append(kept[2].ravel())
            if r is None or not rows:
                continue
            assert r.picked is not None
            lse = r.lse[lo : lo + rows]
            plps.append(r.picked[lo : lo + rows] - lse)
            if top:
                ids.append(r.top_ids[lo : lo + rows, :k].ravel())
                lps.append((r.top_vals[lo : lo + rows, :k] - lse[:, None]).ravel())
        return (
            np.concatenate(plps).astype(np.float32) if plps else np.empty(0, np.float32),
            np.concatenate(ids).astype(np.int32) if ids else np.empty(0, np.int32),
            np.concatenate(lps).astype(np.float32) if lps else np.empty(0, np.float32),
        )

    def _mean_sums(
        self,
        x: paddle.Tensor,
        batch: ForwardBatch,
        offsets: np.ndarray,
        rids: list[int],
        prefixes: Prefixes,
    ) -> None:
        """Add each mean-pooling chunk's final-norm rows (after its cached positions' rows) to
        its request's float64 sum, one row after the other in position order, so a prompt
        summed whole, in chunks or after cached blocks gets the same bits."""
        if batch.options is None:
            return
        for i in np.flatnonzero(batch.has(protocol.OPT_EMBED_MEAN)).tolist():
            a, b = int(offsets[i]), int(offsets[i + 1])
            rid = rids[i]
            cached = prefixes[i].hidden if i in prefixes else None
            chunks = [x[a:b]] if cached is None else [cached, x[a:b]]
            for h in chunks:
                rows = self._rms_norm(h, self._norm, self._eps)
                total: np.ndarray
                if rows.place.is_cpu_place():  # summed in float64 without a float64 copy
                    if rid in self._sums:  # NumPy adds the rows of axis 0 in order
                        both = [self._sums[rid][None], host(rows).astype(np.float64)]
                        total = np.sum(np.concatenate(both), axis=0)
                    else:
                        total = np.asarray(np.sum(host(rows), axis=0, dtype=np.float64))
                else:  # on the device: only the sum comes back
                    total = rows.astype("float64").sum(axis=0).numpy()
                    total = total if rid not in self._sums else self._sums[rid] + total
                self._sums[rid] = total

    # ------------------------------------------------------------------ rows of the head

    def _rows(
        self,
        h: paddle.Tensor,
        kmax: int,
        targets: np.ndarray | None = None,
        *,
        labels: np.ndarray | None = None,
    ) -> tuple[np.ndarray | None, HeadRows]:
        """Rows `h` [rows, hidden] through the final norm and the head, tile by tile: the
        final-norm rows (float32 [rows, hidden]; None with `targets`, which never need them)
        and the head's per-row results; `labels` [rows, m] (last rows): their logits picked."""
        rows = h.shape[0]
        # prompt logprobs: at least the floor; last rows: as many (`pad_last`: the floor too)
        floor = self._min_rows if targets is not None or self._pad_last else 1
        if self._tile:  # deterministic: fixed tiles
            tile = self._tile
            padded = -(-rows // tile) * tile
        else:  # tiles of HEAD_ROWS, the last as long as it is, but at least `floor` rows (it
            # was padded to HEAD_ROWS: 8 x 280 prompt logprobs ran 3,072 rows for 2,232)
            tile, rest = HEAD_ROWS, rows % HEAD_ROWS
            padded = rows + (floor - rest if 0 < rest < floor else 0)
        if padded > rows:  # zero rows, ignored
            h = paddle.concat([h, paddle.zeros([padded - rows, h.shape[1]], dtype=h.dtype)])
            if targets is not None:
                targets = np.concatenate([targets, np.zeros(padded - rows, dtype=np.int64)])
            if labels is not None:
                labels = np.concatenate([labels, np.full((padded - rows, labels.shape[1]), -1)])
        normed, parts = [], []
        for lo in range(0, padded, tile):
            hn = self._rms_norm(h[lo : lo + tile], self._norm, self._eps)
            t = None if targets is None else targets[lo : lo + tile]
            t = t if labels is None else labels[lo : lo + tile]
            v0 = 0 if self._shard is None else self._shard.vocab_start
            product = self._product if targets is not None else self._product_last
            weight = self.prompt_head if targets is not None else self._lm_head
            got = head_rows(hn, weight, product, kmax, t, v0=v0)
            # parallel: this rank's vocabulary slice, joined with the other ranks'
            parts.append(got if self._shard is None else self._shard.head_rows(got))
            if targets is None:
                normed.append(host(hn).astype(np.float32, copy=True))
        joined = [
            None if p[0] is None else np.concatenate(p)[:rows] for p in zip(*parts, strict=True)
        ]
        h_out = np.concatenate(normed)[:rows] if normed else None
        return h_out, HeadRows(*joined)  # type: ignore[arg-type]


def _label_matrix(labels: list[np.ndarray | None]) -> np.ndarray | None:
    """int64[rows, most]: each last row's label token ids, -1 after its own (None: no labels)."""
    most = max((len(ids) for ids in labels if ids is not None), default=0)
    if not most:
        return None
    out = np.full((len(labels), most), -1, dtype=np.int64)
    for j, ids in enumerate(labels):
        if ids is not None:
            out[j, : len(ids)] = ids
    return out


def _matmul_t(x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
    return paddle.matmul(x, w, transpose_y=True)
