"""bfloat16 on a CPU: each product's input carried to ~float32 on the few channels that hold most
of its rounding error, at ~1/36 of a product's cost.

A bf16 product rounds its float32 input x to bf16 (2^-9 of each value). bf16x2 (`Products`'s
`split`: x = hi + lo, both bf16, two products) carries x to ~2^-17 at twice the cost, so it was
spent on the first layers only. But the rounding error of a product, sum_i (x_i - hi_i) w_i, comes
mostly from a few input channels: an LLM's residual stream carries a few channels of outsized
values (SmolLM2's q/k/v inputs: 8 of 576 channels hold 56-79% of the rounding error's energy),
the same channels for every prompt. So each product's weight gets s more input rows that repeat
its s heaviest channels, and x gets, beside its bf16 rounding, those channels' rest rounded to
bf16: one product over k + s inputs (`Products.extended`, `Bf16Cast.extend`) instead of two over
k. The channels are picked once as the worker starts: one forward of a fixed seeded prompt with
every product on bf16x2, each input channel ranked by its energy (sum of x_i^2) times its weight
column's (sum_j w_ij^2).

Measured (SmolLM2-135M, the 64 x 280 prompts of benchmarks/bench_bf16.py against float64; the
channels picked on another seeded prompt): s = 16 on every product of every layer costs 2.3% more
product FLOPs, against 4.9% for what it replaces (bf16x2 on layer 0 and on q/k/v of layers 1-3),
and is closer on every statistic: next-token |d| mean 0.0103 vs 0.0127, p90 0.022 vs 0.026, max
0.039 vs 0.036 (the noisiest), prompt p99 0.058 vs 0.069; on real12 next max 0.017 vs 0.033. s = 8:
max 0.058. The channels from the weights alone (no calibration) were worse than no correction.

The LM head's prompt rows (prompt log-probabilities, scoring: a product over every position,
~28% of a scoring forward's CPU in float32) multiply the same way, with one step more: the head
is float32 in the checkpoint and its bf16 rounding moves the logits as much as x's does, so its
bf16 weight [n, k + 2s] repeats its s heaviest channels twice, rounded (against x's rest) and as
its own rest (against x's rounding): x's and the weights' rounding both carried to ~float32 on
those channels (`_extend_head`; the final norm's output is as lopsided: 8 of 576 channels hold
95% of that error's energy), one bf16 product at ~0.53x the float32 one's time. Measured: the
64 x 280 prompt p99 0.0593 against 0.0577 with the float32 head (0.0739 with a plain bf16 head),
real12 0.0486 vs 0.0483; scoring forwards 1.14x faster in process (4 and 8 x 280, 1 thread).
The next-token rows stay float32 (`Products.product_few`: they stream the head, where a bf16
one moved next-token logprobs by more than it saves: mean |d| 0.0102 -> 0.0127).

Under TP each rank picks among its own inputs (a row-parallel product's shard of them) by its
own share of the calibration forward, which the ranks run together as they start. A mixture of
experts keeps bf16x2 on its first layers (the expert products are not `Products`') and gets the
head's extension alone (its calibration forward runs as its forwards do); an expert-parallel
group neither (its ranks step in lockstep). Where the extended products' rows move with the row
count (`paddle.rows`' check, rerun on them) the runner keeps bf16x2 on its first layers and the
float32 head, as before.
"""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np
import paddle

from aioprefill.models import PaddleModel
from aioprefill.wire import protocol
from aioprefill.workers.paddle.gemm import Products
from aioprefill.workers.paddle.logits import VOCAB_CHUNK
from aioprefill.workers.paddle.onednn import Extension
from aioprefill.workers.paddle.rows import row_floor
from aioprefill.workers.paddle.weights import Layer
from aioprefill.workers.runner import ForwardBatch

__all__ = ["LO_CHANNELS", "calibration_batch", "extend_runner"]

LO_CHANNELS = 16  # s: input channels per product carried to ~float32
_CALIBRATION_TOKENS = 256
_SEED = 7
_PRODUCTS = ("qkv", "o", "gate_up", "down")


class _Head(Protocol):
    prompt_head: paddle.Tensor


class _Runner(Protocol):
    """What `extend_runner` reads and sets of a `paddle.runner.PaddleRunner`."""

    spec: PaddleModel
    _mm: Products
    _layers: list[Layer]
    _tiled: bool
    _floor: int
    _x2: tuple[int, int]

    @property
    def _outputs(self) -> _Head: ...

    def forward(self, batch: ForwardBatch) -> object: ...


log = logging.getLogger("aioprefill.worker")


def calibration_batch(vocab_size: int) -> ForwardBatch:
    """One prompt of seeded random ids, with its prompt log-probabilities: every layer and the
    head on every row."""
    ids = np.random.default_rng(_SEED).integers(0, vocab_size, _CALIBRATION_TOKENS, np.int32)
    return ForwardBatch(
        np.array([-1], np.int64), np.array([0, len(ids)], np.int32), ids,
        np.zeros(1, np.int32), np.ones(1, bool),
        options=np.full(1, protocol.OPT_PROMPT_LOGPROBS, np.uint8),
    )  # fmt: skip


def _column_energy(w: paddle.Tensor) -> np.ndarray:
    """sum_j w_ij^2 for each input channel i of a weight (bf16 or float32; [n, k] or [heads, k,
    dim]), float64 squares of `VOCAB_CHUNK` rows at a time: no float64 copy of a whole LM head."""
    a = np.from_dlpack(w) if w.dtype == paddle.float32 else w.astype(paddle.float32).numpy()
    if a.ndim == 3:
        return np.square(a, dtype=np.float64).sum(axis=(0, 2))
    rows = range(0, len(a), VOCAB_CHUNK)
    return sum(np.square(a[lo : lo + VOCAB_CHUNK], dtype=np.float64).sum(axis=0) for lo in rows)


def extend_runner(runner: _Runner, lm_head: paddle.Tensor) -> tuple[int, int]:
    """Extends a bf16 `PaddleRunner`'s dense products as it starts: picks each one's
    `LO_CHANNELS` channels by its forward of `calibration_batch` with every product on bf16x2,
    extends the layers' weights in place and registers them in its `Products.extended`, and
    the LM head's prompt rows (`_extend_head`); a mixture of experts its head only. Puts the
    weights back where the extended products' rows move with the row count (its default mode's
    floor, `rows.row_floor`). Returns the (layers, q/k/v layers) on bf16x2 from then on: none,
    or its first ones as before."""
    mm, layers, before = runner._mm, runner._layers, runner._x2
    dense = all(layer.moe is None for layer in layers)
    energy: dict[int, np.ndarray] = {}

    def observe(x: paddle.Tensor, w: paddle.Tensor) -> None:
        e = (np.from_dlpack(x).astype(np.float64) ** 2).sum(axis=0)
        key = int(w.data_ptr())
        energy[key] = energy.get(key, 0.0) + e

    runner._x2, mm.observe = (len(layers),) * 2 if dense else before, observe
    try:
        runner.forward(calibration_batch(runner.spec.vocab_size))
    finally:
        runner._x2, mm.observe = before, None
    extendable = layers if dense else []
    old = [{n: getattr(layer, n) for n in _PRODUCTS} for layer in extendable]
    for layer, weights in zip(extendable, old, strict=True):
        for name, w in weights.items():
            e = energy.get(int(w.data_ptr()))
            if e is None:  # never ran on bf16x2: not a product of this forward
                continue
            score = e * _column_energy(w)
            cols = np.sort(np.argsort(-score, kind="stable")[:LO_CHANNELS])
            extra = paddle.index_select(w, paddle.to_tensor(cols), axis=1)
            wide = paddle.concat([w, extra], axis=1)
            setattr(layer, name, wide)
            mm.extended[int(wide.data_ptr())] = Extension(cols)
    head = lm_head
    e = energy.get(int(lm_head.data_ptr()))  # its first vocabulary slice's (`head_rows`)
    if e is not None and lm_head.dtype == paddle.float32:
        head = _extend_head(mm, lm_head, e)
    if (
        runner._tiled
        or row_floor(mm, layers[0], head, head=head is not lm_head)[0] == runner._floor
    ):
        runner._outputs.prompt_head = head
        return (0, 0) if dense else before
    mm.extended.clear()
    for layer, weights in zip(extendable, old, strict=True):
        for name, w in weights.items():
            setattr(layer, name, w)
    log.warning("bf16: the extended products' rows move with the row count: bf16x2 as before")
    return before


def _extend_head(mm: Products, lm_head: paddle.Tensor, energy: np.ndarray) -> paddle.Tensor:
    """The float32 LM head [n, k] as the bf16 weight its prompt rows multiply, [n, k + 2s]: its
    rounding, then on its `LO_CHANNELS` heaviest input channels (by `energy` times the column's)
    its rounding again (against x's rest) and its own rest (against x's rounding), registered
    in `mm.extended` at each of `head_rows`' vocabulary slices. The final norm's output is
    lopsided as the residual stream is (SmolLM2: 8 of 576 channels hold 95% of the head's
    rounding error's energy); at ~0.53x the float32 product's CPU time."""
    score = energy * _column_energy(lm_head)
    cols = np.sort(np.argsort(-score, kind="stable")[:LO_CHANNELS])
    hi = lm_head.astype(paddle.bfloat16)
    picked = paddle.to_tensor(cols)
    rounded = paddle.index_select(hi, picked, axis=1)
    rest = paddle.index_select(lm_head, picked, axis=1) - rounded.astype(lm_head.dtype)
    wide = paddle.concat([hi, rounded, rest.astype(hi.dtype)], axis=1)
    row_bytes = int(wide.shape[1]) * 2
    for lo in range(0, int(wide.shape[0]), VOCAB_CHUNK):
        mm.extended[int(wide.data_ptr()) + lo * row_bytes] = Extension(cols, weight_rest=True)
    return wide
