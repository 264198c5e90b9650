"""The reference forward the model tests compare PaddleRunner against: an independent float64
NumPy re-implementation of the math, written from the Hugging Face formulas (LlamaForCausalLM,
and MixtralForCausalLM's sparse MoE block), not from aioprefill's code. It shares nothing with
the runner but the weights (HF tensor names) and the spec's fields, and imports nothing from
aioprefill at run time (never aioprefill/workers/*): a bug copied into both would pass unseen.

Per layer, for rows x at positions past..past+n-1 (`past`: tokens already in the KV cache):

    h = x / sqrt(mean(x^2) + eps) * w                        LlamaRMSNorm (input_layernorm)
    q, k, v = h Wq^T, h Wk^T, h Wv^T                         per head: [n, heads | kv_heads, d]
    q, k = q cos + rotate_half(q) sin, likewise k            RoPE, inv_freq = theta^(-2i/d)
    K, V = [cache; k], [cache; v]                            the per-layer KV, after RoPE
    attn = softmax(q K^T / sqrt(d), causal) V                query head j reads KV head j // group
    x = x + attn Wo^T
    x = x + mlp(rmsnorm(x, post_attention_layernorm))

with `dense_mlp` (LlamaMLP: down(silu(gate h) * up h)) or `moe_mlp` (MixtralSparseMoeBlock: a
softmax router, the top-k experts renormalised, the weighted sum of their SwiGLU MLPs). Then the
final norm and the LM head (the embedding matrix when tied) give logits and their log-softmax.

Only the plain Llama variant is written here: `reference_hidden` refuses specs with scaled
RoPE, q/k/v biases or q/k norms rather than give them a wrong answer.

    reference_hidden  the layers: last hidden states (before the final norm) and K/V per layer
    lm_head           final norm, logits, log-probabilities
    greedy            next token and its log-probability after a prompt
    full              everything the output options export (prompt logprobs, top-k, embeddings, KV)
    decode_logits     one decode step that reads only a given KV cache
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:  # only NumPy at run time: the spec is read by its field names
    from aioprefill.config import PaddleModel

Weights = dict[str, np.ndarray]
# An MLP block: (spec, float64 weights, the layer's prefix "model.layers.{i}.", normed rows) -> rows
Mlp = Callable[["PaddleModel", Weights, str, np.ndarray], np.ndarray]


def as64(w: Weights) -> Weights:
    return {k: v.astype(np.float64) for k, v in w.items()}


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def rope(spec: PaddleModel, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, [n, 1, head_dim], for default (unscaled) RoPE."""
    d = spec.head_dim
    inv_freq = 1.0 / spec.rope_theta ** (np.arange(0, d, 2) / d)
    angles = np.outer(positions, inv_freq)
    both = np.concatenate([angles, angles], axis=-1)[:, None, :]
    return np.cos(both), np.sin(both)


def dense_mlp(spec: PaddleModel, w: Weights, layer: str, h: np.ndarray) -> np.ndarray:
    p = layer + "mlp."
    gate = h @ w[p + "gate_proj.weight"].T
    up = h @ w[p + "up_proj.weight"].T
    return (silu(gate) * up) @ w[p + "down_proj.weight"].T


def moe_mlp(spec: PaddleModel, w: Weights, layer: str, h: np.ndarray) -> np.ndarray:
    """Per row: softmax over the router's logits, the top `num_experts_per_tok` experts (a tie
    goes to the lower expert id), their weights renormalised to sum to 1."""
    m = layer + "block_sparse_moe."
    logits = h @ w[m + "gate.weight"].T
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.zeros_like(h)
    for i, row in enumerate(probs):
        top = np.argsort(-row, kind="stable")[: spec.num_experts_per_tok]
        for e in top:
            p = f"{m}experts.{e}."
            gate, up = w[p + "w1.weight"] @ h[i], w[p + "w3.weight"] @ h[i]
            expert = w[p + "w2.weight"] @ (silu(gate) * up)
            out[i] += row[e] / row[top].sum() * expert
    return out


class Hidden(NamedTuple):
    states: np.ndarray  # [n, hidden]: the last layer's output, before the final norm
    keys: np.ndarray  # [layers, kv_heads, past + n, head_dim], after RoPE
    values: np.ndarray  # [layers, kv_heads, past + n, head_dim]


def reference_hidden(
    spec: PaddleModel,
    w64: Weights,
    tokens: np.ndarray,
    *,
    mlp: Mlp = dense_mlp,
    past: tuple[np.ndarray, np.ndarray] | None = None,
) -> Hidden:
    """Run the layers over `tokens` (`w64`: weights already float64). With `past` (keys, values
    shaped like `Hidden.keys`), the tokens follow that cache: they sit at positions after it and
    attend to it, and nothing else of the earlier tokens is read."""
    if spec.rope_type != "default" or spec.attention_bias or spec.qk_norm:
        raise NotImplementedError("the reference is plain Llama: default RoPE, no biases/q-k norm")
    n, heads, kv, d = len(tokens), spec.num_heads, spec.num_kv_heads, spec.head_dim
    start = 0 if past is None else past[0].shape[2]
    cos, sin = rope(spec, start + np.arange(n))
    x = w64["model.embed_tokens.weight"][tokens]
    keys, values = [], []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        h = rms_norm(x, w64[p + "input_layernorm.weight"], spec.rms_norm_eps)
        q = (h @ w64[p + "self_attn.q_proj.weight"].T).reshape(n, heads, d)
        k = (h @ w64[p + "self_attn.k_proj.weight"].T).reshape(n, kv, d)
        v = (h @ w64[p + "self_attn.v_proj.weight"].T).reshape(n, kv, d)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k_all, v_all = k.transpose(1, 0, 2), v.transpose(1, 0, 2)  # [kv, n, d]
        if past is not None:
            k_all = np.concatenate([past[0][i], k_all], axis=1)
            v_all = np.concatenate([past[1][i], v_all], axis=1)
        keys.append(k_all)
        values.append(v_all)
        total = k_all.shape[1]
        kr = np.repeat(k_all, heads // kv, axis=0)  # HF repeat_kv: [heads, total, d]
        vr = np.repeat(v_all, heads // kv, axis=0)
        scores = np.einsum("ihd,hjd->hij", q, kr) / np.sqrt(d)
        future = np.arange(total)[None, :] > (total - n + np.arange(n))[:, None]
        scores[:, future] = -np.inf
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = np.einsum("hij,hjd->ihd", probs, vr).reshape(n, heads * d)
        x = x + attn @ w64[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w64[p + "post_attention_layernorm.weight"], spec.rms_norm_eps)
        x = x + mlp(spec, w64, p, h)
    return Hidden(x, np.stack(keys), np.stack(values))


def lm_head(
    spec: PaddleModel, w64: Weights, x: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(final-norm hidden states, logits, log-softmax of the logits) for rows `x`."""
    h = rms_norm(x, w64["model.norm.weight"], spec.rms_norm_eps)
    head = w64["model.embed_tokens.weight"] if spec.tie_word_embeddings else w64["lm_head.weight"]
    logits = h @ head.T
    m = logits.max(axis=-1, keepdims=True)
    log_probs = logits - m - np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))
    return h, logits, log_probs


def greedy(
    spec: PaddleModel, w: Weights, tokens: np.ndarray, *, mlp: Mlp = dense_mlp
) -> tuple[int, float]:
    """Greedy next token and its log-probability after `tokens`, in float64 (`w`: any dtype)."""
    w64 = as64(w)
    last = reference_hidden(spec, w64, tokens, mlp=mlp).states[-1:]
    _, logits, log_probs = lm_head(spec, w64, last)
    top = int(np.argmax(logits[0]))
    return top, float(log_probs[0, top])


@dataclass
class Full:
    logits: np.ndarray  # [n, vocab]
    log_probs: np.ndarray  # [n, vocab], log-softmax of logits
    hidden: np.ndarray  # [n, hidden], after the final norm
    keys: np.ndarray  # [layers, kv_heads, n, head_dim], after RoPE
    values: np.ndarray  # [layers, kv_heads, n, head_dim]

    def prompt_logprobs(self, tokens: np.ndarray) -> np.ndarray:
        return self.log_probs[np.arange(len(tokens) - 1), tokens[1:]]


def full(spec: PaddleModel, w64: Weights, tokens: np.ndarray, *, mlp: Mlp = dense_mlp) -> Full:
    """Everything about a prompt, in float64 (`w64`: weights already float64)."""
    states, keys, values = reference_hidden(spec, w64, tokens, mlp=mlp)
    h, logits, log_probs = lm_head(spec, w64, states)
    return Full(logits, log_probs, h, keys, values)


def decode_logits(
    spec: PaddleModel,
    w64: Weights,
    keys: np.ndarray,
    values: np.ndarray,
    token: int,
    *,
    mlp: Mlp = dense_mlp,
) -> np.ndarray:
    """Next-token logits after `token`, given only the prompt's KV cache (what a decode node
    receives): position = the cache's length."""
    states = reference_hidden(spec, w64, np.array([token]), mlp=mlp, past=(keys, values)).states
    return lm_head(spec, w64, states)[1][0]
