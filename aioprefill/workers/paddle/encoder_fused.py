"""`FusedEncoder`: `EncoderRunner`'s forward on a CPU with oneDNN, on NumPy buffers, oneDNN's
sgemm and primitives only (no Paddle op in the forward).

Per layer: qkv = x @ Wqkv (sgemm), + b (`fused.bias_`); attention per prompt (`fused.attend_`:
each head's scores by sgemm reading q and k in place, oneDNN's softmax over all heads at once,
each head's probabilities @ v written into its columns of the prompt's context rows; a prompt
of at most 128 tokens on a 1-thread worker: each product one runtime-shape matmul primitive over
every head, bitwise the same, 1,000 prompts of 8-48 tokens 1.03-1.07x fewer CPU-s a forward,
benchmarks/results/encoder/short_prompts.txt);
res = ctx @ Wo, + x + bo in one pass, LayerNorm in place; up = res @ W1, + b1 and exact GELU in
one pass; x = up @ W2, + res + b2, LayerNorm. The embeddings (word + token type + position rows,
NumPy), then the same LayerNorm.

Measured (all-MiniLM-L6-v2, 300 sentences of 8-256 tokens, batches of <= 8,192 tokens, 1
thread, in-process, measurement lock): 9.5-9.9 CPU-s against 10.8-11.6 for the Paddle path it
replaces (1.14-1.18x); the products (at the core's float32 peak) are ~82% of the forward now.
Split by part (benchmarks/studies/encoder/profile_forward.py: 300 prompts of 8-256 random ids,
lock, load 0.2-1.8: benchmarks/results/encoder/profile_forward.txt): 9.9-10.5 CPU-s, the
products 8.1-8.3, attention 1.3-1.7 (its products' floor 0.62-0.66: what else was tried,
`fused`), the epilogues 0.36-0.45, LayerNorm 0.06-0.08.

Buffers are kept between forwards (grow-only, a power of two of rows: no page faults on each
batch's ~120 MB, nor on each slightly larger batch). Rows are
padded to `floor_rows` (zero rows, cut off at the end) so every product keeps the row counts
whose bits `paddle.gemm` measured batch-invariant; attention, softmax, the epilogues and
LayerNorm see a prompt's, a row's or an element's own values only.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from aioprefill.workers.paddle.fused import attend_, bias_, layer_norm_
from aioprefill.workers.paddle.gemm import Products

__all__ = ["FusedEncoder"]

_F32 = 4  # bytes

Layer = tuple[np.ndarray, ...]


class FusedEncoder:
    """The encoder stack's weights as float32 NumPy ([in, out] products) and the forward."""

    def __init__(
        self, get: Callable[[str], np.ndarray], num_layers: int, heads: int, eps: float,
        mm: Products, floor_rows: int,
    ) -> None:  # fmt: skip
        """`get(name)`: the checkpoint's tensor `name` (below the model's base prefix)."""

        def f(name: str, transpose: bool = False) -> np.ndarray:
            a = get(name)
            return np.ascontiguousarray(a.T if transpose else a, dtype=np.float32)

        self.word = f("embeddings.word_embeddings.weight")
        self.pos = f("embeddings.position_embeddings.weight")
        self.types = f("embeddings.token_type_embeddings.weight")
        self.eln = (f("embeddings.LayerNorm.weight"), f("embeddings.LayerNorm.bias"))
        self.layers: list[Layer] = []
        for i in range(num_layers):
            p = f"encoder.layer.{i}."
            att = p + "attention."
            qkv = [get(f"{att}self.{n}.weight") for n in ("query", "key", "value")]
            bias = [get(f"{att}self.{n}.bias") for n in ("query", "key", "value")]
            self.layers.append(
                (
                    np.ascontiguousarray(np.concatenate(qkv).T, dtype=np.float32),
                    np.ascontiguousarray(np.concatenate(bias), dtype=np.float32),
                    f(att + "output.dense.weight", True),
                    f(att + "output.dense.bias"),
                    f(att + "output.LayerNorm.weight"),
                    f(att + "output.LayerNorm.bias"),
                    f(p + "intermediate.dense.weight", True),
                    f(p + "intermediate.dense.bias"),
                    f(p + "output.dense.weight", True),
                    f(p + "output.dense.bias"),
                    f(p + "output.LayerNorm.weight"),
                    f(p + "output.LayerNorm.bias"),
                )
            )
        self.hidden_size = self.word.shape[1]
        self.heads, self.hd = heads, self.hidden_size // heads
        self.scale = 1.0 / math.sqrt(self.hd)
        self.eps, self.mm, self.floor = eps, mm, floor_rows
        self._bufs: dict[str, np.ndarray] = {}

    def _buf(self, name: str, rows: int, cols: int) -> np.ndarray:
        """A kept buffer's first rows x cols. It holds a power of two of rows (batches are cut
        at `max_batch_tokens`, a power of two by default, so the buffers stop growing at the
        first full batch), and the old one is dropped before the new one is made (malloc can
        reuse its memory): each growth faults in fresh pages, ~1 s for MiniLM's ~120 MB at
        8,192 rows on this VM (measured: the engine's first two full batches ran ~1 s slower
        each when the buffers grew to every slightly larger batch)."""
        need = rows * cols
        b = self._bufs.get(name)
        if b is None or b.size < need:
            self._bufs.pop(name, None)
            del b
            b = self._bufs[name] = np.empty((1 << max(rows - 1, 0).bit_length()) * cols, np.float32)
        return b[:need].reshape(rows, cols)

    def hidden(
        self, tokens: np.ndarray, types: np.ndarray | None, positions: np.ndarray,
        bounds: list[tuple[int, int]],
    ) -> np.ndarray:  # fmt: skip
        """The last hidden states of the packed tokens, float32 [tokens, hidden] (a new array)."""
        rows, h = len(tokens), self.hidden_size
        padded = max(rows, self.floor)
        x, res = self._buf("x", padded, h), self._buf("res", padded, h)
        ctx = self._buf("ctx", padded, h)
        qkv = self._buf("qkv", padded, 3 * h)
        np.take(self.word, tokens, axis=0, out=x[:rows])
        if types is None:
            x[:rows] += self.types[0]
        else:
            x[:rows] += self.types[types]
        x[:rows] += self.pos[positions]
        if padded > rows:  # zero rows: the products' floor (cut off at the end)
            x[rows:] = 0.0
            ctx[rows:] = 0.0
        layer_norm_(x, *self.eln, self.eps)
        for wqkv, bqkv, wo, bo, g1, b1n, w1, b1, w2, b2, g2, b2n in self.layers:
            bias_(self._product(x, wqkv, qkv), bqkv)
            self._attend(qkv, ctx, bounds)
            bias_(self._product(ctx, wo, res), bo, "add", x)  # res = ctx @ wo + x + bo
            layer_norm_(res, g1, b1n, self.eps)
            u = self._buf("up", padded, w1.shape[1])
            bias_(self._product(res, w1, u), b1, "gelu")
            bias_(self._product(u, w2, x), b2, "add", res)  # x = up @ w2 + res + b2
            layer_norm_(x, g2, b2n, self.eps)
        return x[:rows].copy()

    def _product(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out = x @ w (w [in, out]) by oneDNN's sgemm, whose rows keep their bits whatever
        the row count from 2 rows up (`paddle.gemm`, measured on these shapes)."""
        rows, k = x.shape
        n = w.shape[1]
        a, b, c = x.ctypes.data, w.ctypes.data, out.ctypes.data
        self.mm.strided(rows, n, k, 1.0, a, k, b, n, c, n, transpose_b=False)
        return out

    def _attend(self, qkv: np.ndarray, ctx: np.ndarray, bounds: list[tuple[int, int]]) -> None:
        """Bidirectional attention of every prompt (rows s:e of qkv) into ctx's rows s:e
        (`fused.attend_`: per-head sgemm in place around one softmax per prompt)."""
        longest = max(e - s for s, e in bounds)
        scores = self._buf("scores", self.heads * longest, longest)
        for s, e in bounds:
            attend_(self.mm, qkv, ctx, s, e, self.heads, self.scale, scores)
