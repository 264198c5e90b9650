"""`EncoderRunner`: the `ModelRunner` for encoder `PaddleModel`s (BERT, XLM-RoBERTa), float32.

One forward packs every prompt of the batch back to back into one [tokens, hidden] matrix (no
padding) for the embeddings (word + absolute position + token type, then LayerNorm), the dense
products, LayerNorms and exact GELU; attention runs per sequence (bidirectional: every token
sees every token of its own prompt and nothing else), on that sequence's rows alone. On a CPU
with the wheel's oneDNN the whole stack runs on its sgemm and primitives, on NumPy buffers
(`FusedEncoder`, encoder_fused.py: 1.14-1.18x fewer CPU-seconds than the Paddle ops); without
its primitive API, Paddle ops with each head's two products on oneDNN's sgemm reading q, k, v
in place (`_attend_in_place`); elsewhere Paddle's `matmul` on a transposed copy (`_attend`).
Then per prompt: the model's pooling of its last hidden states (`cls`: the first token, `mean`
over its tokens, `last` token; a request's OPT_EMBED_* bits choose another), L2-normalised with the
model's Normalize module or OPT_NORMALIZE, and for a *ForSequenceClassification model its
classifier's raw logits (BERT: pooler dense + tanh on the first token, then `classifier`;
XLM-R: `classifier.dense` + tanh, then `out_proj`), float32[num_labels].

Batch invariance: a prompt's rows meet other prompts' rows only in the dense products. On a
CPU they run on oneDNN's sgemm from Paddle's wheel (`paddle.gemm.Products`), whose rows keep
their bits whatever the product's row count and a row's place in it, from 2 rows up (measured
on MiniLM's four shapes, 1 and 2 threads, 1-300 rows at offsets 0-2000 of a 3,000-row product;
a 1-row product takes another path, so fewer than `_FLOOR_ROWS` rows are zero-padded to it);
MKL's (Paddle's `matmul`) moved rows at every count up to 64 and more. tests/test_encoder.py
checks prompts alone against the same prompts in batches. Attention, pooling and the
classifier see one prompt at a time. An encoder has no next token: `tokens` are -1 and
`logprobs` 0.0; it keeps no state between forwards (no chunks, no prefix cache).
"""

from __future__ import annotations

import logging
import math
import warnings

from aioprefill.workers.paddle.env import (
    configure_math_libraries,
    keep_freed_memory,
    quiet_native_logs,
)

configure_math_libraries()
quiet_native_logs()

import numpy as np  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import paddle
import paddle.nn.functional as F  # noqa: E402

from aioprefill.errors import InvalidConfig  # noqa: E402
from aioprefill.hf.encoder import ENCODERS  # noqa: E402
from aioprefill.hf.weights import model_weights  # noqa: E402
from aioprefill.models import PaddleModel  # noqa: E402
from aioprefill.wire.encoder import OPT_EMBED_CLS  # noqa: E402
from aioprefill.wire.protocol import (  # noqa: E402
    OPT_EMBED_LAST,
    OPT_EMBED_MEAN,
    OPT_NORMALIZE,
)
from aioprefill.workers.paddle.encoder_fused import FusedEncoder  # noqa: E402
from aioprefill.workers.paddle.fused import fused_available  # noqa: E402
from aioprefill.workers.paddle.gemm import Products  # noqa: E402
from aioprefill.workers.runner import ForwardBatch, ForwardOutput  # noqa: E402

__all__ = ["EncoderRunner", "encoder_device", "floor_linear", "mean_rows", "pool"]

_FLOOR_ROWS = 16  # products on fewer rows are zero-padded to this many (batch invariance)
_POOL_BITS = {"cls": OPT_EMBED_CLS, "mean": OPT_EMBED_MEAN, "last": OPT_EMBED_LAST}
_LAYER_NAMES = (
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "attention.output.LayerNorm",
    "intermediate.dense",
    "output.dense",
    "output.LayerNorm",
)


class EncoderRunner:
    """Packed-batch encoder forward on one device (`cpu` with `spec.num_threads`, or a GPU)."""

    device: str

    def __init__(self, spec: PaddleModel, worker_index: int = 0) -> None:
        self.spec = spec
        self.device, self._mm = encoder_device(spec, worker_index)
        self._heads, self._hd = spec.num_heads, spec.hidden_size // spec.num_heads
        self._scale = 1.0 / math.sqrt(self._hd)
        self._scores = np.empty(0, np.float32)  # one prompt's [heads, n, n] (grow-only)
        # a CPU with oneDNN: the whole stack on its primitives (encoder_fused.py)
        self._fused: FusedEncoder | None = None
        with paddle.no_grad():
            self._load(model_weights(spec))

    def _load(self, w: dict[str, np.ndarray]) -> None:
        _, base, head = ENCODERS[self.spec.architecture]

        def t(name: str, transpose: bool = False) -> paddle.Tensor:
            a = w[base + name] if base + name in w else w[name]
            return paddle.to_tensor(np.ascontiguousarray(a.T if transpose else a))

        # the classifier, as float32 NumPy [in, out] (one prompt's row at a time)
        self._head: tuple[np.ndarray, ...] | None = None
        if head == "bert":
            names = ("bert.pooler.dense", "classifier")
        elif head == "roberta":
            names = ("classifier.dense", "classifier.out_proj")
        if head:
            self._head = tuple(
                np.ascontiguousarray(a) for n in names for a in (w[n + ".weight"].T, w[n + ".bias"])
            )
        if self.device == "cpu" and self._mm.uses_onednn and fused_available():
            spec = self.spec

            def get(name: str) -> np.ndarray:
                return w[base + name] if base + name in w else w[name]

            self._fused = FusedEncoder(
                get, spec.num_layers, spec.num_heads, spec.layer_norm_eps, self._mm, _FLOOR_ROWS
            )
            return  # no Paddle copy of the weights
        self._word = t("embeddings.word_embeddings.weight")
        self._pos = t("embeddings.position_embeddings.weight")
        self._types = t("embeddings.token_type_embeddings.weight")
        self._eln = (t("embeddings.LayerNorm.weight"), t("embeddings.LayerNorm.bias"))
        self._layers = []
        for i in range(self.spec.num_layers):
            p = f"encoder.layer.{i}."
            q, k, v, o, ln1, up, down, ln2 = (p + n for n in _LAYER_NAMES)
            qkv = np.concatenate([w[base + n + ".weight"] for n in (q, k, v)])
            qkv_bias = np.concatenate([w[base + n + ".bias"] for n in (q, k, v)])
            self._layers.append(
                (
                    paddle.to_tensor(np.ascontiguousarray(qkv.T)),
                    paddle.to_tensor(qkv_bias),
                    t(o + ".weight", True),
                    t(o + ".bias"),
                    (t(ln1 + ".weight"), t(ln1 + ".bias")),
                    t(up + ".weight", True),
                    t(up + ".bias"),
                    t(down + ".weight", True),
                    t(down + ".bias"),
                    (t(ln2 + ".weight"), t(ln2 + ".bias")),
                )
            )

    def _linear(self, x: paddle.Tensor, w: paddle.Tensor, b: paddle.Tensor) -> paddle.Tensor:
        return floor_linear(self._mm, x, w) + b

    @paddle.no_grad()
    def hidden(self, batch: ForwardBatch) -> np.ndarray:
        """The last hidden states of the batch's tokens, packed, float32 [tokens, hidden]."""
        spec, offsets = self.spec, batch.offsets
        tokens = batch.tokens
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= spec.vocab_size):
            raise ValueError("token id out of the vocabulary")
        lens = np.diff(offsets)
        if (batch.start_pos != 0).any() or not batch.is_last.all():
            raise ValueError("an encoder takes whole prompts only (no chunks)")
        if int(lens.max()) > spec.max_position_embeddings - spec.position_offset:
            raise ValueError("a prompt is longer than the position table")
        positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])
        positions += spec.position_offset
        types = batch.token_types
        if types is not None and len(types) != len(tokens):
            raise ValueError("token types do not have one entry per token")
        if types is not None and int(types.max(initial=0)) >= spec.type_vocab_size:
            raise ValueError("token type id out of the type vocabulary")
        bounds = list(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True))
        if self._fused is not None:
            return self._fused.hidden(tokens, types, positions, bounds)
        x = F.embedding(paddle.to_tensor(tokens.astype(np.int64)), self._word)
        if types is None:
            x = x + self._types[0]
        else:
            x = x + F.embedding(paddle.to_tensor(types.astype(np.int64)), self._types)
        x = x + F.embedding(paddle.to_tensor(positions), self._pos)
        h, eps = spec.hidden_size, spec.layer_norm_eps
        x = F.layer_norm(x, [h], *self._eln, epsilon=eps)
        for wqkv, bqkv, wo, bo, ln1, w1, b1, w2, b2, ln2 in self._layers:
            qkv = self._linear(x, wqkv, bqkv)
            if self._mm.uses_onednn:
                ctx = self._attend_in_place(qkv, bounds)
            else:
                ctx = paddle.concat([self._attend(qkv[s:e]) for s, e in bounds])
            x = F.layer_norm(self._linear(ctx, wo, bo) + x, [h], *ln1, epsilon=eps)
            up = F.gelu(self._linear(x, w1, b1), approximate=False)
            x = F.layer_norm(self._linear(up, w2, b2) + x, [h], *ln2, epsilon=eps)
        return x.numpy()

    def _attend_in_place(self, qkv: paddle.Tensor, bounds: list[tuple[int, int]]) -> paddle.Tensor:
        """Bidirectional attention of every prompt (rows s:e of the packed qkv [tokens,
        3*hidden]) -> the packed context [tokens, hidden], on oneDNN's sgemm with leading
        dimensions: each head's scores q_h k_h^T (the 1/sqrt(d) scale as the product's alpha)
        into one kept buffer, q_h and k_h read in place from the qkv rows; softmax over all heads
        at once in NumPy, unnormalised (exp(s - row max)); each head's probabilities times v_h
        written straight into its columns of the context, then divided by the row sums (n x d
        divisions instead of n x n). No transposes, concats or per-head tensors: 2.7x the
        Paddle path per layer on MiniLM's shapes (60 prompts of 8-256 tokens, 1 thread)."""
        heads, hd, f = self._heads, self._hd, 4  # float32 bytes
        hidden, width = heads * hd, 3 * heads * hd
        ctx = paddle.empty([qkv.shape[0], hidden], dtype=qkv.dtype)
        longest = max(e - s for s, e in bounds)
        if self._scores.size < heads * longest * longest:
            self._scores = np.empty(heads * longest * longest, np.float32)
        qkv = qkv if qkv.is_contiguous() else qkv.contiguous()
        out: np.ndarray = np.from_dlpack(ctx)
        sp, qp, cp, mm = self._scores.ctypes.data, qkv.data_ptr(), ctx.data_ptr(), self._mm
        for s, e in bounds:
            n, row = e - s, qp + s * width * f
            for h in range(heads):
                q, k, a = row + h * hd * f, row + (hidden + h * hd) * f, sp + h * n * n * f
                mm.strided(n, n, hd, self._scale, q, width, k, width, a, n, transpose_b=True)
            p = self._scores[: heads * n * n].reshape(heads * n, n)
            p -= p.max(axis=1, keepdims=True)
            np.exp(p, out=p)
            total = p.sum(axis=1).reshape(heads, n)
            for h in range(heads):
                a, v = sp + h * n * n * f, row + (2 * hidden + h * hd) * f
                c = cp + (s * hidden + h * hd) * f
                mm.strided(n, hd, n, 1.0, a, n, v, width, c, hidden, transpose_b=False)
            part = out[s:e].reshape(n, heads, hd)
            part /= total.T[:, :, None]
        return ctx

    def _attend(self, qkv: paddle.Tensor) -> paddle.Tensor:
        """Bidirectional attention of one sequence: qkv [n, 3*hidden] -> [n, hidden]."""
        n = qkv.shape[0]
        g = qkv.reshape([n, 3, self._heads, self._hd]).transpose([1, 2, 0, 3])
        scores = paddle.matmul(g[0], g[1], transpose_y=True) * self._scale
        out = paddle.matmul(F.softmax(scores, axis=-1), g[2])  # [heads, n, hd]
        return out.transpose([1, 0, 2]).reshape([n, self._heads * self._hd])

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        x = self.hidden(batch)
        offsets = batch.offsets
        emb = pool(x, batch, self.spec)
        scores = np.empty((0, 0), np.float32)
        if self._head is not None:
            w1, b1, w2, b2 = self._head
            first = x[offsets[:-1]]
            scores = np.stack([np.tanh(row @ w1 + b1) @ w2 + b2 for row in first])
            scores = scores.astype(np.float32)
        n = batch.size
        return ForwardOutput(
            request_ids=batch.request_ids,
            tokens=np.full(n, -1, np.int32),
            logprobs=np.zeros(n, np.float64),
            embeddings=emb,
            scores=scores,
        )

    def free(self, request_ids: np.ndarray) -> None:
        """Nothing to drop: an encoder keeps no state between forwards."""


def encoder_device(spec: PaddleModel, worker_index: int) -> tuple[str, Products]:
    """An encoder worker's device, set (`cpu` with `spec.num_threads`, or its GPU), and its
    products (oneDNN's sgemm on a CPU: rows batch-invariant). float32 only."""
    if spec.dtype != "float32":
        raise InvalidConfig(f"PaddleModel.dtype: {spec.dtype}: encoders run float32 only")
    has_cuda = paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    if spec.device == "gpu" and not has_cuda:
        raise InvalidConfig("PaddleModel.device: 'gpu' but this paddle has no CUDA device")
    device = "cpu" if spec.device == "cpu" or not has_cuda else f"gpu:{worker_index}"
    paddle.set_device(device)
    if device == "cpu":
        keep_freed_memory()
        paddle.base.core.set_num_threads(spec.num_threads)
    mm = Products(device, spec.num_threads, None, gemm="onednn", in_out=True)
    if device == "cpu" and not mm.uses_onednn:
        logging.getLogger("aioprefill.worker").warning(
            "oneDNN's sgemm is not in this Paddle wheel: encoder products run on MKL, whose "
            "rows may move with the batch by float32 rounding"
        )
    return device, mm


def floor_linear(mm: Products, x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
    """x @ w on at least `_FLOOR_ROWS` rows (fewer are zero-padded, then cut off): the same
    kernel family whatever the batch."""
    rows = x.shape[0]
    if rows < _FLOOR_ROWS:
        pad = paddle.zeros([_FLOOR_ROWS - rows, x.shape[1]], dtype=x.dtype)
        return mm.linear(paddle.concat([x, pad]), w)[:rows]
    return mm.linear(x, w)


def mean_rows(x: np.ndarray, s: int, e: int) -> np.ndarray:
    """sentence-transformers' mean pooling of rows s..e: sum over tokens / count."""
    return x[s:e].sum(axis=0, dtype=np.float32) / np.float32(e - s)


def pool(x: np.ndarray, batch: ForwardBatch, spec: PaddleModel) -> np.ndarray:
    """Each prompt's embedding from its last hidden states (packed rows of x): its request's
    OPT_EMBED_* / OPT_NORMALIZE bits, else the model's pooling (default cls) and Normalize."""
    offsets = batch.offsets
    if batch.options is None:
        default = _POOL_BITS[spec.pooling or "cls"] | (OPT_NORMALIZE if spec.normalize else 0)
        bits = np.full(batch.size, default, np.uint8)
    else:
        bits = batch.options
    emb = np.empty((batch.size, x.shape[1]), np.float32)
    for i in range(batch.size):
        s, e, b = int(offsets[i]), int(offsets[i + 1]), int(bits[i])
        if b & OPT_EMBED_MEAN:
            v = mean_rows(x, s, e)
        elif b & OPT_EMBED_LAST:
            v = x[e - 1]
        else:  # OPT_EMBED_CLS, the default
            v = x[s]
        if b & OPT_NORMALIZE:  # torch's F.normalize: v / max(||v||, 1e-12)
            v = v / np.float32(max(float(np.sqrt(np.dot(v, v))), 1e-12))
        emb[i] = v
    return emb
