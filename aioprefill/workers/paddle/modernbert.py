"""`ModernBertRunner`: the `ModelRunner` for ModernBERT `PaddleModel`s (`ModernBertModel`,
`ModernBertForSequenceClassification`), float32; the math of transformers 5.24's
modeling_modernbert.py (`hf.modernbert` says which config it reads).

As `EncoderRunner` (workers/paddle/encoder.py) does for BERT, one forward packs the batch's
prompts back to back into one [tokens, hidden] matrix (no padding) for the embeddings, the dense
products, LayerNorms (no biases) and the GeGLU MLP; attention runs per prompt on that prompt's
rows alone. Per layer: x + Wo(attention(RoPE(Wqkv(attn_norm(x))))) (layer 0 has no attention
norm), then + Wo(gelu(input) * gate) of Wi(mlp_norm(x)) split in two; a final norm. Positions
count from 0 in each prompt. A global layer (i % global_attn_every_n_layers == 0) attends to
every token of the prompt with RoPE theta `rope_theta`; a local one to the keys at most
local_attention // 2 positions away (transformers' bidirectional sliding-window mask) with
`local_rope_theta`. Queries go in blocks of `_QUERY_BLOCK` rows, each against the keys its
window reaches, so a local layer costs tokens x window, not tokens squared. The RoPE tables are
float32 as transformers computes them (float32 inverse frequencies times float32 positions).

Then per prompt: the pooling of its last hidden states and Normalize (as `EncoderRunner`:
`cls` / `mean` / `last`, a request's OPT_EMBED_* and OPT_NORMALIZE bits override the model's),
and for the classifier its logits: the hidden states pooled by `classifier_pooling` (first
token or mean), dense -> exact GELU -> LayerNorm -> classifier, float32[num_labels].

Batch invariance: a prompt's rows meet other prompts' only in the dense products, which run on
oneDNN's sgemm (`paddle.gemm.Products`; rows keep their bits whatever the row count, from
`encoder.floor_linear`'s floor up: fewer rows are zero-padded to it), as for BERT; attention,
pooling and the head see one prompt at a time, in shapes that depend on that prompt alone.
ModernBERT has no token types (`type_vocab_size` 1).
"""

from __future__ import annotations

import warnings

from aioprefill.workers.paddle.env import configure_math_libraries, quiet_native_logs

configure_math_libraries()
quiet_native_logs()

import numpy as np  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import paddle
import paddle.nn.functional as F  # noqa: E402

from aioprefill.errors import InvalidConfig  # noqa: E402
from aioprefill.hf.modernbert import MODERNBERT  # noqa: E402
from aioprefill.hf.weights import model_weights  # noqa: E402
from aioprefill.models import PaddleModel  # noqa: E402
from aioprefill.workers.paddle.encoder import (  # noqa: E402
    encoder_device,
    floor_linear,
    mean_rows,
    pool,
)
from aioprefill.workers.runner import ForwardBatch, ForwardOutput  # noqa: E402

__all__ = ["ModernBertRunner", "rope_tables"]

_QUERY_BLOCK = 256  # attention's query rows per block (memory: heads x block x keys scores)


def rope_tables(theta: float, head_dim: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, float32 [positions, head_dim], as transformers' ModernBertRotaryEmbedding
    computes them: inv_freq = 1 / theta ** (arange(0, d, 2) / d) in float32, angles = float32
    position x inv_freq (the float32 product rounds as torch's does), each half repeated."""
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / np.float64(theta) ** exponent.astype(np.float64)).astype(np.float32)
    angles = np.arange(positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=1)
    a64 = angles.astype(np.float64)  # float32 angles, their cos/sin correctly rounded
    return np.cos(a64).astype(np.float32), np.sin(a64).astype(np.float32)


class ModernBertRunner:
    """Packed-batch ModernBERT forward on one device (`cpu` with `spec.num_threads`, or a GPU)."""

    device: str

    def __init__(self, spec: PaddleModel, worker_index: int = 0) -> None:
        # (a dtype other than float32 is `encoder_device`'s error, whatever the architecture)
        if spec.dtype == "float32" and spec.architecture not in MODERNBERT:
            raise InvalidConfig(f"PaddleModel.architecture: {spec.architecture} is not ModernBERT")
        self.spec = spec
        self.device, self._mm = encoder_device(spec, worker_index)
        self._heads, self._hd = spec.num_heads, spec.head_dim
        self._scale = float(self._hd) ** -0.5
        self._half = spec.local_attention // 2
        self._global = [i % spec.global_attn_every_n_layers == 0 for i in range(spec.num_layers)]
        self._rope = {}
        for is_global, theta in ((True, spec.rope_theta), (False, spec.local_rope_theta)):
            cos, sin = rope_tables(theta, self._hd, spec.max_position_embeddings)
            self._rope[is_global] = (paddle.to_tensor(cos), paddle.to_tensor(sin))
        with paddle.no_grad():
            self._load(model_weights(spec))

    def _load(self, w: dict[str, np.ndarray]) -> None:
        _, base, head = MODERNBERT[self.spec.architecture]

        def t(name: str, transpose: bool = False) -> paddle.Tensor:
            a = w[name if name.startswith(("head.", "classifier.")) else base + name]
            return paddle.to_tensor(np.ascontiguousarray(a.T if transpose else a))

        self._word = t("embeddings.tok_embeddings.weight")
        self._eln = t("embeddings.norm.weight")
        self._final = t("final_norm.weight")
        self._layers = []
        for i in range(self.spec.num_layers):
            p = f"layers.{i}."
            self._layers.append(
                (
                    t(p + "attn_norm.weight") if i else None,
                    t(p + "attn.Wqkv.weight", True),
                    t(p + "attn.Wo.weight", True),
                    t(p + "mlp_norm.weight"),
                    t(p + "mlp.Wi.weight", True),
                    t(p + "mlp.Wo.weight", True),
                )
            )
        self._head: tuple[paddle.Tensor, ...] | None = None
        if head:  # dense [in, out], norm, classifier [in, out] and its bias
            self._head = (
                t("head.dense.weight", True),
                t("head.norm.weight"),
                t("classifier.weight", True),
                t("classifier.bias"),
            )

    def _linear(self, x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
        return floor_linear(self._mm, x, w)

    def _norm(self, x: paddle.Tensor, weight: paddle.Tensor) -> paddle.Tensor:
        return F.layer_norm(x, [self.spec.hidden_size], weight, None, self.spec.layer_norm_eps)

    @paddle.no_grad()
    def hidden(self, batch: ForwardBatch) -> np.ndarray:
        """The last hidden states (after the final norm) of the batch's tokens, packed,
        float32 [tokens, hidden]."""
        spec, offsets, tokens = self.spec, batch.offsets, batch.tokens
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= spec.vocab_size):
            raise ValueError("token id out of the vocabulary")
        if (batch.start_pos != 0).any() or not batch.is_last.all():
            raise ValueError("an encoder takes whole prompts only (no chunks)")
        lens = np.diff(offsets)
        if int(lens.max()) > spec.max_position_embeddings:
            raise ValueError("a prompt is longer than max_position_embeddings")
        types = batch.token_types
        if types is not None and int(types.max(initial=0)) != 0:
            raise ValueError("ModernBERT has no token types")
        positions = paddle.to_tensor(np.concatenate([np.arange(n, dtype=np.int64) for n in lens]))
        rope = {
            g: (F.embedding(positions, cos), F.embedding(positions, sin))
            for g, (cos, sin) in self._rope.items()
        }
        x = self._norm(
            F.embedding(paddle.to_tensor(tokens.astype(np.int64)), self._word), self._eln
        )
        bounds = list(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True))
        ffn = spec.intermediate_size
        for is_global, (attn_norm, wqkv, wo, mlp_norm, wi, wo_mlp) in zip(
            self._global, self._layers, strict=True
        ):
            a = x if attn_norm is None else self._norm(x, attn_norm)
            q, k, v = self._qkv(self._linear(a, wqkv), *rope[is_global])
            window = None if is_global else self._half
            ctx = paddle.concat([self._attend(q[s:e], k[s:e], v[s:e], window) for s, e in bounds])
            x = x + self._linear(ctx, wo)
            up = self._linear(self._norm(x, mlp_norm), wi)
            x = x + self._linear(F.gelu(up[:, :ffn], approximate=False) * up[:, ffn:], wo_mlp)
        return self._norm(x, self._final).numpy()

    def _qkv(
        self, qkv: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor
    ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """Queries and keys with RoPE, and values, each [tokens, heads, head_dim]."""
        n, half = qkv.shape[0], self._hd // 2
        g = qkv.reshape([n, 3, self._heads, self._hd])
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

        def rotate(t: paddle.Tensor) -> paddle.Tensor:  # t * cos + rotate_half(t) * sin
            turned = paddle.concat([-t[:, :, half:], t[:, :, :half]], axis=-1)
            return t * cos + turned * sin

        return rotate(g[:, 0]), rotate(g[:, 1]), g[:, 2]

    def _attend(
        self, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, window: int | None
    ) -> paddle.Tensor:
        """Bidirectional attention of one prompt ([n, heads, head_dim] each) -> [n, hidden]:
        every key, or (`window`) the keys at most `window` positions away."""
        n = q.shape[0]
        qh, kh, vh = (t.transpose([1, 0, 2]) for t in (q, k, v))  # [heads, n, hd]
        out = []
        for s in range(0, n, _QUERY_BLOCK):
            e = min(n, s + _QUERY_BLOCK)
            ks, ke = (0, n) if window is None else (max(0, s - window), min(n, e + window))
            scores = paddle.matmul(qh[:, s:e], kh[:, ks:ke], transpose_y=True) * self._scale
            if window is not None:  # the block's keys past the window: -inf
                far = np.abs(np.arange(s, e)[:, None] - np.arange(ks, ke)[None, :]) > window
                if far.any():
                    mask = np.where(far, np.float32(-np.inf), np.float32(0))
                    scores = scores + paddle.to_tensor(mask)
            out.append(paddle.matmul(F.softmax(scores, axis=-1), vh[:, ks:ke]))
        ctx = out[0] if len(out) == 1 else paddle.concat(out, axis=1)  # [heads, n, hd]
        return ctx.transpose([1, 0, 2]).reshape([n, self._heads * self._hd])

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        x = self.hidden(batch)
        offsets = batch.offsets
        emb = pool(x, batch, self.spec)
        scores = np.empty((0, 0), np.float32)
        if self._head is not None:
            rows = []
            for i in range(batch.size):
                s, e = int(offsets[i]), int(offsets[i + 1])
                pooled = mean_rows(x, s, e) if self.spec.classifier_pooling == "mean" else x[s]
                rows.append(self._classify(pooled))
            scores = np.stack(rows).astype(np.float32)
        n = batch.size
        return ForwardOutput(
            request_ids=batch.request_ids,
            tokens=np.full(n, -1, np.int32),
            logprobs=np.zeros(n, np.float64),
            embeddings=emb,
            scores=scores,
        )

    @paddle.no_grad()
    def _classify(self, pooled: np.ndarray) -> np.ndarray:
        """One prompt's logits from its pooled state: dense -> GELU -> norm -> classifier."""
        assert self._head is not None
        dense, norm, classifier, bias = self._head
        h = paddle.matmul(paddle.to_tensor(pooled[None, :]), dense)
        h = self._norm(F.gelu(h, approximate=False), norm)
        return (paddle.matmul(h, classifier) + bias).numpy()[0]

    def free(self, request_ids: np.ndarray) -> None:
        """Nothing to drop: an encoder keeps no state between forwards."""
