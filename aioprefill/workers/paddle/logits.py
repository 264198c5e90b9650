"""`head_rows`: the LM head's per-row results (`HeadRows`: argmax, log-sum-exp, top-k, the
target's logit) for rows of final-norm hidden states, their logits a vocabulary slice at a time.

On the CPU the head multiplies `VOCAB_CHUNK` vocabulary rows at a time, and each slice's logits
[rows, VOCAB_CHUNK] (32 MB at 1024 rows) are reduced while they are in cache: argmax, top-k and the
target's logit read them, then they are shifted by the row's maximum and exponentiated in place and
summed in float32 with NumPy's pairwise sum (relative error ~1e-7 over 8192 terms, against ~5e-5
for a sequential float32 sum); the slices' sums join in float64 (`join`, the rule a tensor-parallel
head joins its ranks with). Measured on an AMD EPYC Zen 5, 1 thread, SmolLM2's 49152 x 576 head
(benchmarks/studies/ctranslate2/bench_head.py, CPU us per row, product and reduction): 330 on
tiles of 1024 rows in slices of 8192 (oneDNN, 172 GFLOP/s overall), 363 on 512-row tiles, against
578 for the rule before
(128-row tiles of whole rows, a float64-accumulated sum of a shifted copy); MKL 606 against ~680.
A device keeps one product over its vocabulary and sums there in float64. Every result is per row
and the slices are fixed, so a row's result depends on its logits only (batch invariance), given
products whose rows do not depend on the row count (`paddle.rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import paddle

__all__ = ["HEAD_ROWS", "VOCAB_CHUNK", "HeadRows", "head_rows", "join"]

# Prompt log-probabilities run the head on at most HEAD_ROWS rows at a time (default mode), each
# tile against VOCAB_CHUNK vocabulary rows at a time on the CPU
# (benchmarks/studies/ctranslate2/bench_head.py).
HEAD_ROWS = 1024
VOCAB_CHUNK = 8192


class HeadRows(NamedTuple):
    """Per-row results of the head: argmax id int64, its logit, log-sum-exp (both float64),
    top-k logits float32 / ids int32 [rows, kmax] best first, target logits float64 or None
    (-inf for a target outside the vocabulary slice these rows saw; [rows, m] for targets
    [rows, m]: a row's label token ids, -1 where it has fewer)."""

    ids: np.ndarray
    best: np.ndarray
    lse: np.ndarray
    top_vals: np.ndarray
    top_ids: np.ndarray
    picked: np.ndarray | None


Product = Callable[[paddle.Tensor, paddle.Tensor], paddle.Tensor]


def head_rows(
    hn: paddle.Tensor,
    weight: paddle.Tensor,
    product: Product,
    kmax: int,
    targets: np.ndarray | None,
    *,
    v0: int = 0,
    chunk: int = VOCAB_CHUNK,
) -> HeadRows:
    """`hn` [rows, hidden] against `weight` [n, hidden], the vocabulary ids v0 .. v0 + n (a
    tensor-parallel rank's slice, or all of it): per-row results over those ids, ids global.
    `product(x, w)` is x @ w.T. `targets`: int64[rows] (or [rows, m]) global ids, or None.
    `chunk`: the CPU's vocabulary slice."""
    n = int(weight.shape[0])
    step = chunk if hn.place.is_cpu_place() else n
    parts = []
    for lo in range(0, n, step):
        w = weight if step >= n else weight[lo : lo + step]  # a view: no copy
        logits = product(hn, w)
        if logits.dtype != paddle.float32:
            logits = logits.astype("float32")
        parts.append(_slice_rows(logits, kmax, targets, v0 + lo))
    return join(parts)


def join(parts: Sequence[HeadRows]) -> HeadRows:
    """The per-row results over the union of vocabulary slices, from each slice's (in id order):
    the argmax is the lowest id among the slices holding the maximum (as over the whole row); the
    log-sum-exp is max + log(sum_s exp(lse_s - max)) in float64; top-k ties keep the lower id; a
    target's logit comes from the slice holding it (the others have -inf)."""
    if len(parts) == 1:
        return parts[0]
    bests = np.stack([p.best for p in parts])  # [slices, rows]
    best = bests.max(axis=0)
    rows = np.arange(bests.shape[1])
    winner = np.argmax(bests == best, axis=0)  # first slice: the lowest id
    ids = np.stack([p.ids for p in parts])[winner, rows]
    lse = best + np.log(np.exp(np.stack([p.lse for p in parts]) - best).sum(axis=0))
    k = parts[0].top_vals.shape[1]
    vals = np.concatenate([p.top_vals for p in parts], axis=1)
    tops = np.concatenate([p.top_ids for p in parts], axis=1)
    if k:
        order = np.lexsort((tops, -vals), axis=-1)[:, :k]
        vals, tops = np.take_along_axis(vals, order, -1), np.take_along_axis(tops, order, -1)
    picked = None
    if parts[0].picked is not None:
        picked = np.stack([p.picked for p in parts]).max(axis=0)  # type: ignore[misc]
    return HeadRows(ids, best, lse, vals, tops, picked)


def _slice_rows(logits: paddle.Tensor, kmax: int, targets: np.ndarray | None, v0: int) -> HeadRows:
    """`HeadRows` of float32 logits [rows, width] of the ids v0 .. v0 + width (top-k ties: lower
    id first on the CPU). On the CPU the logits are overwritten (their exponentials)."""
    width = int(logits.shape[1])
    local, inside = None, None
    if targets is not None:
        inside = (targets >= v0) & (targets < v0 + width)
        local = np.where(inside, targets - v0, 0)
    if not logits.place.is_cpu_place():
        return _device_rows(logits, kmax, local, inside, v0)
    lg: np.ndarray = np.from_dlpack(logits)
    rows = np.arange(len(lg))
    arg = np.argmax(lg, axis=-1)
    best = lg[rows, arg]
    vals, tops = np.empty((len(lg), 0), np.float32), np.empty((len(lg), 0), np.int32)
    if kmax == 1:  # the argmax: its first maximum is the lowest id, as the tie rule below
        tops, vals = arg[:, None].astype(np.int32), best[:, None]
    elif kmax:
        k = min(kmax, width)
        part = np.argpartition(-lg, k - 1, axis=-1)[:, :k]
        pv = np.take_along_axis(lg, part, axis=-1)
        order = np.lexsort((part, -pv), axis=-1)
        tops = np.take_along_axis(part, order, axis=-1).astype(np.int32)
        vals = np.take_along_axis(pv, order, axis=-1)
    picked = None
    if local is not None and inside is not None:
        got = np.take_along_axis(lg, local.reshape(len(lg), -1), axis=-1).reshape(local.shape)
        picked = np.where(inside, got.astype(np.float64), -np.inf)
    # exp(l - max) is in (0, 1]: in place, then NumPy's pairwise float32 sum (module docstring)
    np.subtract(lg, best[:, None], out=lg)
    np.exp(lg, out=lg)
    lse = best.astype(np.float64) + np.log(lg.sum(axis=-1).astype(np.float64))
    ids, best64 = arg.astype(np.int64) + v0, best.astype(np.float64)
    return HeadRows(ids, best64, lse, vals, tops + v0, picked)


def _device_rows(
    logits: paddle.Tensor,
    kmax: int,
    local: np.ndarray | None,
    inside: np.ndarray | None,
    v0: int,
) -> HeadRows:
    """`HeadRows` on a device: the float64 sum there, only per-row numbers come back."""
    top_t = paddle.max(logits, axis=-1, keepdim=True)
    total = paddle.exp(logits - top_t).astype("float64").sum(axis=-1)
    lse: np.ndarray = top_t.squeeze(-1).astype("float64").numpy() + np.log(total.numpy())
    arg = paddle.argmax(logits, axis=-1).numpy().astype(np.int64)
    best = top_t.squeeze(-1).numpy().astype(np.float64)
    vals = np.empty((len(lse), 0), np.float32)
    tops = np.empty((len(lse), 0), np.int32)
    if kmax:
        v, i = paddle.topk(logits, min(kmax, int(logits.shape[1])), axis=-1)
        vals, tops = v.numpy(), i.numpy().astype(np.int32)
    picked = None
    if local is not None and inside is not None:
        tt = paddle.to_tensor(local.reshape(len(local), -1))
        got = paddle.take_along_axis(logits, tt, axis=-1).numpy().reshape(local.shape)
        picked = np.where(inside, got.astype(np.float64), -np.inf)
    return HeadRows(arg + v0, best, lse, vals, tops + v0, picked)
