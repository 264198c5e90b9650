"""ModernBERT end to end (docs/embedding.md, "Encoder models"): synthetic checkpoints saved by
transformers 5.24 (tests/data/encoder/modernbert: a `ModernBertModel` sentence-transformers
directory, mean pooling + Normalize; modernbert_cls: `ModernBertForSequenceClassification`, one
label; both 3 layers: one global, two local with a 16-token window, far shorter than the texts),
goldens by benchmarks/tools/make_encoder_goldens.py: our forward through the Engine equals
sentence-transformers' `encode` and transformers' hidden states and logits within 1e-5
(float32), bitwise the same alone or batched; the window, the layer pattern and both RoPE
thetas each move the output; Hub-style and transformers-5-style configs read alike; what the
forward does not implement is refused naming the config key."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from functools import cache
from pathlib import Path

import msgspec
import numpy as np
import pytest
import uvloop

from aioprefill import Engine, EngineConfig, InvalidRequest, PaddleModel, Tokenizer
from aioprefill.errors import InvalidConfig
from aioprefill.text.encoder_text import EncoderText
from tests.encoder_models import DATA, runner_embeddings
from tests.test_encoder import EngineThread

EMBED = DATA / "modernbert"
CLASSIFY = DATA / "modernbert_cls"


@cache
def goldens() -> tuple[dict, np.ndarray, np.ndarray, np.ndarray]:
    """sentences, ids; sentence-transformers' normalised embeddings; transformers' mean and
    first-token last hidden states (un-normalised)."""
    expected = json.loads((EMBED / "expected.json").read_text())
    arrays = (np.load(EMBED / f) for f in ("embeddings.npy", "mean_states.npy", "first_states.npy"))
    return (expected, *arrays)  # type: ignore[return-value]


def pairs() -> list[dict]:
    return json.loads((CLASSIFY / "expected.json").read_text())["pairs"]


def _copy(src: Path, dst: Path, change: Callable[[dict], dict]) -> Path:
    """`src` with its config.json changed (the other files linked)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    (dst / "config.json").write_text(
        json.dumps(change(json.loads((src / "config.json").read_text())))
    )
    return dst


@pytest.fixture(scope="module")
def embedder():
    thread = EngineThread(EngineConfig(model=PaddleModel.from_pretrained(EMBED)))
    try:
        yield thread
    finally:
        thread.close()


def test_directory_reads_as_transformers_and_sentence_transformers_do() -> None:
    spec = PaddleModel.from_pretrained(EMBED)
    assert spec.architecture == "ModernBertModel" and spec.is_encoder
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.intermediate_size) == (
        3, 64, 4, 64,
    )  # fmt: skip
    assert (spec.local_attention, spec.global_attn_every_n_layers) == (16, 3)
    assert (spec.rope_theta, spec.local_rope_theta) == (160000.0, 10000.0)
    assert (spec.layer_norm_eps, spec.type_vocab_size, spec.position_offset) == (1e-5, 1, 0)
    assert (spec.pooling, spec.normalize, spec.max_seq_length) == ("mean", True, 256)
    expected, *_ = goldens()
    text = EncoderText.for_model(Tokenizer.from_pretrained(EMBED), spec)
    assert text.encode_batch(expected["sentences"]) == expected["input_ids"]
    lengths = [len(ids) for ids in expected["input_ids"]]
    assert max(lengths) > 8 * spec.local_attention and min(lengths) < spec.local_attention


def test_embeddings_equal_sentence_transformers_and_transformers(embedder) -> None:
    expected, want, mean, first = goldens()
    ids = expected["input_ids"]

    async def run(engine: Engine) -> tuple[list, list, list, list]:
        batched = await asyncio.gather(*(engine.prefill(x) for x in ids))
        raw_mean = await asyncio.gather(*(engine.prefill(x, normalize=False) for x in ids))
        raw_first = await asyncio.gather(
            *(engine.prefill(x, embed="cls", normalize=False) for x in ids)
        )
        alone = [await engine.prefill(ids[i]) for i in (0, 7, int(np.argmax(list(map(len, ids)))))]
        return batched, raw_mean, raw_first, alone

    batched, raw_mean, raw_first, alone = embedder.run(run)
    got = np.stack([r.embedding for r in batched])
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-5
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.99999
    assert max(r.batch_size for r in batched) > 1
    assert all((r.token, r.logprob, r.scores) == (-1, 0.0, None) for r in batched)
    assert np.abs(np.stack([r.embedding for r in raw_mean]) - mean).max() <= 1e-5
    assert np.abs(np.stack([r.embedding for r in raw_first]) - first).max() <= 1e-5
    # batch invariance: alone, a prompt gets the very bits it got inside the batches above
    for i, r in zip((0, 7, int(np.argmax(list(map(len, ids))))), alone, strict=True):
        assert r.batch_size == 1
        np.testing.assert_array_equal(r.embedding, got[i])


def test_requests_modernbert_cannot_answer_are_refused(embedder) -> None:
    async def refused(engine: Engine) -> list[str]:
        out = []
        for opts in ({"token_type_ids": [0, 0, 1, 1]}, {"prompt_logprobs": True}):
            try:
                await engine.prefill([421, 40, 41, 422], **opts)
                out.append("accepted")
            except InvalidRequest as exc:
                out.append(str(exc))
        r = await engine.prefill([421, 40, 41, 422], token_type_ids=[0, 0, 0, 0])
        out.append("zeros accepted" if r.embedding is not None else "?")
        return out

    types, logprobs, zeros = embedder.run(refused)
    assert "type_vocab_size" in types and "prompt_logprobs" in logprobs
    assert zeros == "zeros accepted"


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_classifier_logits_equal_transformers(pooling: str, tmp_path: Path) -> None:
    directory = CLASSIFY
    if pooling == "cls":  # the same weights, the config's other pooling
        directory = _copy(CLASSIFY, tmp_path / "cls", lambda c: {**c, "classifier_pooling": "cls"})
    spec = PaddleModel.from_pretrained(directory)
    assert spec.architecture == "ModernBertForSequenceClassification"
    assert (spec.num_labels, spec.classifier_pooling, spec.pooling) == (1, pooling, "cls")
    rows = pairs()
    text = EncoderText.for_model(Tokenizer.from_pretrained(directory), spec)
    assert [text.encode_pair(p["query"], p["document"]) for p in rows] == [
        (p["input_ids"], p["token_type_ids"]) for p in rows
    ]
    assert max(len(p["input_ids"]) for p in rows) > 8 * spec.local_attention

    async def score() -> tuple[list, list]:
        async with Engine(EngineConfig(model=spec)) as engine:
            batched = await asyncio.gather(*(engine.prefill(p["input_ids"]) for p in rows))
            alone = [await engine.prefill(rows[i]["input_ids"]) for i in (0, 10)]
            return batched, alone

    batched, alone = uvloop.run(score())
    got = np.array([r.scores for r in batched])
    key = "logit" if pooling == "mean" else "logit_cls"
    want = np.array([p[key] for p in rows])
    assert got.dtype == np.float32 and got.shape == (len(rows), 1)
    np.testing.assert_allclose(got[:, 0], want, atol=1e-5, rtol=0)
    assert list(np.argsort(-got[:, 0])) == list(np.argsort(-want))
    for i, r in zip((0, 10), alone, strict=True):
        np.testing.assert_array_equal(r.scores, got[i])
        np.testing.assert_array_equal(r.embedding, batched[i].embedding)


def test_the_window_the_layer_pattern_and_both_thetas_each_matter() -> None:
    from aioprefill.workers.paddle.modernbert import ModernBertRunner

    spec = PaddleModel.from_pretrained(EMBED)
    expected, want, *_ = goldens()
    prompts = [np.array(x) for x in expected["input_ids"]]
    got = runner_embeddings(ModernBertRunner(spec), prompts)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    for change in (
        {"local_attention": 1024},  # every layer sees every token
        {"global_attn_every_n_layers": 2},  # layer 2 global
        {"local_rope_theta": 160000.0},
        {"rope_theta": 10000.0},
    ):
        runner = ModernBertRunner(msgspec.structs.replace(spec, **change))
        other = runner_embeddings(runner, prompts)
        assert np.abs(other - want).max() > 1e-3, change


def test_query_blocks_and_batches_do_not_change_a_prompts_bits(monkeypatch) -> None:
    from aioprefill.workers.paddle import modernbert

    spec = PaddleModel.from_pretrained(CLASSIFY)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 425, n).astype(np.int32) for n in (1, 5, 17, 300, 512, 40)]
    runner = modernbert.ModernBertRunner(spec)
    together = runner_embeddings(runner, prompts)
    for i, p in enumerate(prompts):
        np.testing.assert_array_equal(runner_embeddings(runner, [p])[0], together[i])
    assert np.isfinite(together).all()
    monkeypatch.setattr(modernbert, "_QUERY_BLOCK", 4096)  # one block per prompt
    np.testing.assert_allclose(runner_embeddings(runner, prompts), together, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        runner_embeddings(runner, [np.zeros(513, np.int32)])


def test_hub_style_configs_read_as_transformers_5_saves_them(tmp_path: Path) -> None:
    def hub(c: dict) -> dict:  # the keys answerdotai/ModernBERT-base's config.json carries
        c = {k: v for k, v in c.items() if k not in ("layer_types", "rope_parameters", "dtype")}
        return {
            **c, "global_attn_every_n_layers": 3, "global_rope_theta": 160000.0,
            "local_rope_theta": 10000.0, "torch_dtype": "float32", "layer_norm_eps": 1e-5,
            "position_embedding_type": "absolute", "reference_compile": None,
            "repad_logits_with_grad": False,
        }  # fmt: skip

    for src in (EMBED, CLASSIFY):
        saved = PaddleModel.from_pretrained(src)
        old = PaddleModel.from_pretrained(_copy(src, tmp_path / src.name, hub))
        assert msgspec.structs.replace(old, weights=saved.weights) == saved


def test_configs_the_forward_does_not_implement_are_refused(tmp_path: Path) -> None:
    sliding = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    cases = [
        ("attention_bias", True),
        ("mlp_bias", True),
        ("norm_bias", True),
        ("classifier_bias", True),
        ("hidden_activation", "gelu_pytorch_tanh"),
        ("classifier_activation", "silu"),
        ("classifier_pooling", "max"),
        ("local_attention", 0),
        ("layer_types", ["sliding_attention", "full_attention", "full_attention"]),
        ("rope_parameters", {"full_attention": {"rope_theta": 1e4}, "sliding_attention": sliding}),
        ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
        ("quantization_config", {"bits": 8}),
        ("unpad_everything", True),
    ]
    for i, (key, value) in enumerate(cases):
        d = _copy(CLASSIFY, tmp_path / str(i), lambda c: {**c, key: value})  # noqa: B023
        with pytest.raises(InvalidConfig, match=key):
            PaddleModel.from_pretrained(d)
    with pytest.raises(InvalidConfig, match="local_attention"):
        PaddleModel.from_pretrained(CLASSIFY, local_attention=64)  # from the checkpoint only
    with pytest.raises(InvalidConfig, match="tp_size"):
        EngineConfig(model=PaddleModel.from_pretrained(EMBED), tp_size=2)
