"""Text prompts through the engine: `prefill(str)` runs the engine's tokenizer (SmolLM2's, from
its GGUF file) and then exactly what the same ids would; `engine.tokenizer`; the model's own
tokenizer by default; what is refused."""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
import sys

import msgspec
import numpy as np
import pytest

from aioprefill import (
    Engine,
    EngineConfig,
    InvalidConfig,
    InvalidRequest,
    PaddleModel,
    SimModel,
    Tokenizer,
)
from aioprefill.text.tokenizer import OFF_LOOP_CHARS
from aioprefill.workers.sim import expected_token
from tests.model.batches import SMALL
from tests.tokenizer_files import ROOT, smollm2_gguf

SIM = SimModel(fixed_ms=0.5, vocab_size=49152)


@functools.cache
def smollm2() -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2_gguf())


@pytest.mark.asyncio
async def test_str_prompt_runs_the_tokenizers_ids():
    tok = smollm2()
    text = "The capital of France is"
    async with Engine(EngineConfig(model=SIM, tokenizer=tok)) as engine:
        assert isinstance(engine.tokenizer, Tokenizer)
        ids = tok.encode(text)
        r = await engine.prefill(text)
        assert r.token == expected_token(ids, 49152) and r.batch_tokens == len(ids)
        # a long text goes through the thread, concurrently with short ones
        long_text = "Paris is the capital and largest city of France. " * (OFF_LOOP_CHARS // 40)
        results = await asyncio.gather(
            engine.prefill(long_text), *(engine.prefill(f"{text} {i}") for i in range(8))
        )
        assert results[0].token == expected_token(tok.encode(long_text), 49152)
        assert [r.token for r in results[1:]] == [
            expected_token(tok.encode(f"{text} {i}"), 49152) for i in range(8)
        ]
        # a thread's submit_threadsafe takes text too
        fut = await asyncio.to_thread(engine.submit_threadsafe, text)
        assert (await asyncio.wrap_future(fut)).token == r.token


@pytest.mark.asyncio
async def test_str_prompt_refusals():
    tok = smollm2()
    async with Engine(EngineConfig(model=SIM, tokenizer=tok, max_prompt_tokens=8)) as engine:
        assert engine.tokenizer is tok
        with pytest.raises(InvalidRequest, match="request 'r1': prompt is an empty string"):
            await engine.prefill("", request_id="r1")
        with pytest.raises(InvalidRequest, match="10 tokens, more than max_prompt_tokens=8"):
            await engine.prefill("word" + " word" * 9)
        assert engine.stats().submitted == 0
    # no tokenizer: token ids only, and it says how to get one
    async with Engine(EngineConfig(model=SimModel(fixed_ms=0.5))) as engine:
        assert engine.tokenizer is None
        with pytest.raises(InvalidRequest, match=r"no tokenizer: pass token ids, or EngineConf"):
            await engine.prefill("The capital of France is")
        # a tokenizer's [1, n] batch stays refused (DESIGN: 2-D is bad input), saying what to do
        with pytest.raises(InvalidRequest, match=r"shape \(1, 3\): pass ids\[0\]"):
            await engine.prefill(np.array([[1, 2, 3]]))
        assert engine.stats().submitted == 0


@pytest.mark.asyncio
async def test_paddle_engine_text_equals_ids():
    """A real Paddle model with SmolLM2's vocabulary size: text and its ids give one result."""
    model = msgspec.structs.replace(SMALL, vocab_size=49152, deterministic=True)
    texts = ["The capital of France is", "def add(a, b):\n    return a + b", "naïve 🤗 2024"]
    async with Engine(EngineConfig(model=model, tokenizer=smollm2_gguf())) as engine:
        by_text = await asyncio.gather(*(engine.prefill(t, top_k=3) for t in texts))
        ids = [engine.tokenizer.encode(t) for t in texts]
        by_ids = await asyncio.gather(*(engine.prefill(i, top_k=3) for i in ids))
    for a, b, i in zip(by_text, by_ids, ids, strict=True):
        assert a.batch_tokens >= len(i) and (a.token, a.logprob) == (b.token, b.logprob)
        assert a.top_k_ids.tolist() == b.top_k_ids.tolist()


def test_config_tokenizer_field(tmp_path):
    path = smollm2_gguf()
    assert EngineConfig(model=SIM).tokenizer is None  # SimModel has no checkpoint
    assert isinstance(EngineConfig(model=SIM, tokenizer=path).tokenizer, Tokenizer)
    with pytest.raises(
        InvalidConfig,
        match=r"tokenizer: \S+ has 49152 ids, more than the model's vocab_size \(32000\)",
    ):
        EngineConfig(model=SimModel(), tokenizer=path)  # vocab_size 32000
    with pytest.raises(InvalidConfig, match=r"EngineConfig\.tokenizer: must be None, a Tokenizer"):
        EngineConfig(model=SIM, tokenizer=42)
    with pytest.raises(InvalidConfig, match=r"EngineConfig\.tokenizer: .* neither a directory"):
        EngineConfig(model=SIM, tokenizer=tmp_path / "missing")


def _checkpoint_with_tokenizer(tmp_path, tokenizer_json: str | None):
    """A real checkpoint directory (tests/data/hf, vocab 1000), with a tokenizer.json of 1000
    ids or none."""
    d = tmp_path / "ckpt"
    shutil.copytree(ROOT / "tests" / "data" / "hf" / "llama_theta_eps", d)
    if tokenizer_json is not None:
        (d / "tokenizer.json").write_text(tokenizer_json)
        (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return d


def _word_level_json(n: int) -> str:
    tk = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "</s>": 1, **{f"w{i}": i for i in range(2, n)}}
    backend = tk.Tokenizer(tk.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    return backend.to_str()


@pytest.mark.asyncio
async def test_model_brings_its_tokenizer(tmp_path):
    d = _checkpoint_with_tokenizer(tmp_path, _word_level_json(1000))
    config = EngineConfig(model=PaddleModel.from_pretrained(d))
    assert isinstance(config.tokenizer, Tokenizer) and config.tokenizer.name_or_path == str(d)
    assert config.tokenizer.encode("w5 w7 nope") == [5, 7, 0] and config.tokenizer.eos_token_id == 1
    async with Engine(config) as engine:
        a, b = await asyncio.gather(engine.prefill("w5 w7 w999"), engine.prefill([5, 7, 999]))
    assert (a.token, a.logprob) == (b.token, b.logprob)
    # a tokenizer larger than the model's vocabulary is refused at construction
    big = _checkpoint_with_tokenizer(tmp_path / "big", _word_level_json(1001))
    with pytest.raises(InvalidConfig, match=r"has 1001 ids, more than the model's vocab_size"):
        EngineConfig(model=PaddleModel.from_pretrained(big))
    # a GGUF model (what PaddleModel.from_pretrained("x.gguf") returns): the file's vocabulary
    gguf = PaddleModel.from_pretrained(smollm2_gguf())
    assert EngineConfig(model=gguf).tokenizer.name_or_path == str(smollm2_gguf().resolve())
    # no tokenizer.json: none, and token ids work as before
    bare = _checkpoint_with_tokenizer(tmp_path / "bare", None)
    assert EngineConfig(model=PaddleModel.from_pretrained(bare)).tokenizer is None


@pytest.mark.asyncio
async def test_without_tokenizers_package(tmp_path, monkeypatch):
    """Token ids need no tokenizer: without the extra a checkpoint's tokenizer.json is left
    unread, and a str prompt names the extra to install."""
    d = _checkpoint_with_tokenizer(tmp_path, _word_level_json(1000))
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # unimportable
    assert EngineConfig(model=PaddleModel.from_pretrained(d)).tokenizer is None
    async with Engine(EngineConfig(model=SimModel(fixed_ms=0.5))) as engine:
        with pytest.raises(InvalidRequest, match=r"pip install 'aioprefill\[tokenizer\]'"):
            await engine.prefill("The capital of France is")
        assert (await engine.prefill([1, 2, 3])).batch_tokens == 3
