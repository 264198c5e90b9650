"""An independent float64 NumPy forward of the Mixtral-style MoE model (it shares nothing with
the runner but the weights): Llama attention, then per token a softmax router, the top-k
experts renormalised, and the weighted sum of their SwiGLU MLPs."""

from __future__ import annotations

import numpy as np

from aioprefill.config import PaddleModel
from tests.model.test_paddle_reference import rms_norm, rotate_half


def moe_mlp(h: np.ndarray, w: dict[str, np.ndarray], m: str, spec: PaddleModel) -> np.ndarray:
    logits = h @ w[m + "gate.weight"].T
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.zeros_like(h)
    for i, row in enumerate(probs):
        top = np.argsort(-row, kind="stable")[: spec.num_experts_per_tok]
        for e in top:
            p = f"{m}experts.{e}."
            gate, up = w[p + "w1.weight"] @ h[i], w[p + "w3.weight"] @ h[i]
            expert = w[p + "w2.weight"] @ (gate / (1.0 + np.exp(-gate)) * up)
            out[i] += row[e] / row[top].sum() * expert
    return out


def reference_moe(
    spec: PaddleModel, w: dict[str, np.ndarray], tokens: np.ndarray
) -> tuple[int, float]:
    """Greedy next token and its log-probability after `tokens`, in float64."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    n, heads, kv, d = len(tokens), spec.num_heads, spec.num_kv_heads, spec.head_dim
    x = w["model.embed_tokens.weight"][tokens]
    inv_freq = 1.0 / spec.rope_theta ** (np.arange(0, d, 2) / d)
    angles = np.outer(np.arange(n), inv_freq)
    cos = np.cos(np.concatenate([angles, angles], axis=-1))[:, None, :]
    sin = np.sin(np.concatenate([angles, angles], axis=-1))[:, None, :]
    future = np.triu(np.ones((n, n), dtype=bool), k=1)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], spec.rms_norm_eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(n, heads, d)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(n, kv, d)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(n, kv, d)
        q = q * cos + rotate_half(q) * sin
        k = np.repeat(k * cos + rotate_half(k) * sin, heads // kv, axis=1)
        v = np.repeat(v, heads // kv, axis=1)
        scores = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(d)
        scores[:, future] = -np.inf
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = np.einsum("hij,jhd->ihd", probs, v).reshape(n, heads * d)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], spec.rms_norm_eps)
        x = x + moe_mlp(h, w, p + "block_sparse_moe.", spec)
    h = rms_norm(x[-1], w["model.norm.weight"], spec.rms_norm_eps)
    head = w["model.embed_tokens.weight"] if spec.tie_word_embeddings else w["lm_head.weight"]
    logits = head @ h
    top = int(np.argmax(logits))
    m = logits.max()
    return top, float(logits[top] - m - np.log(np.exp(logits - m).sum()))
