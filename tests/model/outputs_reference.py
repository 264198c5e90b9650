"""A float64 NumPy Llama that returns everything a prefill can export (logits at every position,
final-norm hidden states, K/V after RoPE), and one decode step that reads *only* a given KV
cache: the independent reference for the output options. Same math as
`test_paddle_reference.reference`, written out per position."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aioprefill.config import PaddleModel
from tests.model.test_paddle_reference import rms_norm, rotate_half


@dataclass
class Full:
    logits: np.ndarray  # [n, vocab]
    log_probs: np.ndarray  # [n, vocab], log-softmax of logits
    hidden: np.ndarray  # [n, hidden], after the final norm
    keys: np.ndarray  # [layers, kv_heads, n, head_dim], after RoPE
    values: np.ndarray  # [layers, kv_heads, n, head_dim]

    def prompt_logprobs(self, tokens: np.ndarray) -> np.ndarray:
        return self.log_probs[np.arange(len(tokens) - 1), tokens[1:]]


def _rope(spec: PaddleModel, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d = spec.head_dim
    inv_freq = 1.0 / spec.rope_theta ** (np.arange(0, d, 2) / d)
    angles = np.outer(positions, inv_freq)
    both = np.concatenate([angles, angles], axis=-1)[:, None, :]
    return np.cos(both), np.sin(both)


def _head(spec: PaddleModel, w: dict[str, np.ndarray], x: np.ndarray):
    h = rms_norm(x, w["model.norm.weight"], spec.rms_norm_eps)
    head = w["model.embed_tokens.weight"] if spec.tie_word_embeddings else w["lm_head.weight"]
    logits = h @ head.T
    m = logits.max(axis=-1, keepdims=True)
    log_probs = logits - m - np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))
    return h, logits, log_probs


def _step(spec, w, x, positions, past_k, past_v):
    """Run the layers for new rows `x` at `positions`, attending to past K/V (per layer lists of
    [kv_heads, past, d], or None) and themselves causally. Returns (x, new keys, new values)."""
    n, heads, kv, d = len(x), spec.num_heads, spec.num_kv_heads, spec.head_dim
    cos, sin = _rope(spec, positions)
    keys, values = [], []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], spec.rms_norm_eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(n, heads, d)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(n, kv, d)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(n, kv, d)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k_all, v_all = k.transpose(1, 0, 2), v.transpose(1, 0, 2)  # [kv, n, d]
        if past_k is not None:
            k_all = np.concatenate([past_k[i], k_all], axis=1)
            v_all = np.concatenate([past_v[i], v_all], axis=1)
        keys.append(k_all)
        values.append(v_all)
        total = k_all.shape[1]
        kr = np.repeat(k_all, heads // kv, axis=0)  # [heads, total, d]
        vr = np.repeat(v_all, heads // kv, axis=0)
        scores = np.einsum("ihd,hjd->hij", q, kr) / np.sqrt(d)
        future = np.arange(total)[None, :] > (total - n + np.arange(n))[:, None]
        scores[:, future] = -np.inf
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = np.einsum("hij,hjd->ihd", probs, vr).reshape(n, heads * d)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], spec.rms_norm_eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    return x, np.stack(keys), np.stack(values)


def as64(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float64) for k, v in w.items()}


def full(spec: PaddleModel, w64: dict[str, np.ndarray], tokens: np.ndarray) -> Full:
    """Everything about a prompt, in float64 (`w64`: weights already float64)."""
    x = w64["model.embed_tokens.weight"][tokens]
    x, keys, values = _step(spec, w64, x, np.arange(len(tokens)), None, None)
    h, logits, log_probs = _head(spec, w64, x)
    return Full(logits, log_probs, h, keys, values)


def decode_logits(
    spec: PaddleModel,
    w64: dict[str, np.ndarray],
    keys: np.ndarray,
    values: np.ndarray,
    token: int,
) -> np.ndarray:
    """Next-token logits after `token`, given only the prompt's KV cache (what a decode node
    receives): position = the cache's length."""
    past = keys.shape[2]
    x = w64["model.embed_tokens.weight"][[token]]
    x, _, _ = _step(spec, w64, x, np.array([past]), list(keys), list(values))
    return _head(spec, w64, x)[1][0]
