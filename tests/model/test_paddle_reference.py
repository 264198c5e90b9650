"""PaddleRunner against an independent float64 NumPy forward of the same Llama, written here from
the math (it shares nothing with the runner but the weights)."""

from __future__ import annotations

import numpy as np
import pytest

from aioprefill.config import PaddleModel
from aioprefill.workers import paddle_attention
from aioprefill.workers.paddle_runner import PaddleRunner
from aioprefill.workers.weights import random_weights
from tests.model.batches import SMALL, make_batch, prompts, runner, small


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def reference(spec: PaddleModel, w: dict[str, np.ndarray], tokens: np.ndarray) -> tuple[int, float]:
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
        k = k * cos + rotate_half(k) * sin
        k = np.repeat(k, heads // kv, axis=1)  # HF repeat_kv: query head j reads KV head j // group
        v = np.repeat(v, heads // kv, axis=1)
        scores = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(d)
        scores[:, future] = -np.inf
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = np.einsum("hij,jhd->ihd", probs, v).reshape(n, heads * d)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], spec.rms_norm_eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    h = rms_norm(x[-1], w["model.norm.weight"], spec.rms_norm_eps)
    head = w["model.embed_tokens.weight"] if spec.tie_word_embeddings else w["lm_head.weight"]
    logits = head @ h
    top = int(np.argmax(logits))
    m = logits.max()
    return top, float(logits[top] - m - np.log(np.exp(logits - m).sum()))


def check_against_reference(spec: PaddleModel, lengths: list[int], seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    ps = prompts(rng, lengths, spec.vocab_size)
    out = runner(spec).forward(make_batch(ps))
    weights = random_weights(spec, spec.seed)
    assert out.request_ids.tolist() == list(range(len(ps)))
    for i, p in enumerate(ps):
        token, logprob = reference(spec, weights, p)
        assert int(out.tokens[i]) == token, f"prompt {i} (length {len(p)})"
        assert abs(float(out.logprobs[i]) - logprob) < 1e-4, f"prompt {i} (length {len(p)})"


@pytest.mark.parametrize(
    "spec",
    [
        SMALL,
        small(num_kv_heads=4, seed=4),  # plain multi-head attention
        small(num_kv_heads=1, seed=5),  # multi-query
        small(tie_word_embeddings=True, rope_theta=500000.0, seed=6),
    ],
    ids=["gqa", "mha", "mqa", "tied"],
)
def test_small_models_match_reference(spec: PaddleModel) -> None:
    check_against_reference(spec, [1, 2, 7, 33, 100])


def test_default_tiny_model_matches_reference() -> None:
    check_against_reference(PaddleModel(seed=0), [3, 40], seed=1)


def test_long_prompt_in_query_blocks_matches_reference(monkeypatch) -> None:
    # Force attention into blocks of a few query rows, each reading only the keys it can see.
    monkeypatch.setattr(paddle_attention, "_QUERY_BLOCK", 7)
    spec = small(seed=7)
    check_against_reference(spec, [300, 5], seed=2)


def test_result_fields_and_dtypes() -> None:
    out = runner(SMALL).forward(make_batch([np.array([1, 2, 3])], ids=[41]))
    assert out.request_ids.dtype == np.int64 and out.request_ids.tolist() == [41]
    assert out.tokens.dtype == np.int32 and 0 <= int(out.tokens[0]) < SMALL.vocab_size
    assert out.logprobs.dtype == np.float64 and -np.log(SMALL.vocab_size) - 5 < out.logprobs[0] < 0


def test_cpu_runner_reports_its_device() -> None:
    assert PaddleRunner(small(device="cpu")).device == "cpu"
