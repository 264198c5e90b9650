"""`python -m aioprefill.serve` on a real checkpoint (tests/data/hf/llama_bf16, whose goldens
are transformers' float64 results), driven by the official `openai` client: the greedy next
token and its logprob, the echoed prompt's logprobs, batched and token-id prompts, embeddings,
the refusals a prefill server owes its clients, and the other endpoints."""

from __future__ import annotations

import base64
import math

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.hf.goldens import expected
from tests.serve.util import HF, serve

GOLDEN = expected("llama_bf16")
TOL = 2e-4  # the bound against transformers fp64


@pytest.fixture(scope="module")
def server():
    with serve(
        "--model", str(HF / "llama_bf16"), "--served-model-name", "tiny/llama", "--dtype", "float32"
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as c:
        yield c


def test_next_token_and_logprob_equal_transformers(client):
    prompts = GOLDEN["prompts"][:6]
    out = client.completions.create(model="tiny/llama", prompt=prompts, max_tokens=1, logprobs=5)
    assert [c.index for c in out.choices] == list(range(len(prompts)))
    for choice, token, logprob in zip(
        out.choices, GOLDEN["tokens"], GOLDEN["logprobs"], strict=False
    ):
        assert choice.logprobs.tokens == [f"token_id:{token}"]  # no tokenizer: vLLM's id form
        assert abs(choice.logprobs.token_logprobs[0] - logprob) < TOL
        top = choice.logprobs.top_logprobs[0]
        assert len(top) == 5 and max(top, key=top.get) == f"token_id:{token}"
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert choice.finish_reason == "length"
    n = sum(map(len, prompts))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (n, len(prompts))
    assert out.model == "tiny/llama" and out.object == "text_completion"


def test_echo_scores_the_prompt_like_transformers(client):
    # Scoring what transformers predicted after each golden prompt: the last echoed logprob
    # is transformers' logprob of that token (lm-eval's local-completions request).
    for prompt, token, logprob in list(
        zip(GOLDEN["prompts"], GOLDEN["tokens"], GOLDEN["logprobs"], strict=True)
    )[:5]:
        full = [*prompt, token]
        out = client.completions.create(
            model="tiny/llama", prompt=full, max_tokens=0, echo=True, logprobs=1, temperature=0
        )
        lp = out.choices[0].logprobs
        assert lp.tokens == [f"token_id:{t}" for t in full]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert abs(lp.token_logprobs[-1] - logprob) < TOL
        assert all(x <= 0 for x in lp.token_logprobs[1:])
        assert out.usage.completion_tokens == 0


def test_echo_with_the_next_token_matches_scoring_one_longer(client):
    prompt = GOLDEN["prompts"][4]
    one = client.completions.create(model="m", prompt=prompt, max_tokens=1, echo=True, logprobs=0)
    lp = one.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 1 and lp.tokens[-1] == f"token_id:{GOLDEN['tokens'][4]}"
    longer = client.completions.create(
        model="m", prompt=[*prompt, GOLDEN["tokens"][4]], max_tokens=0, echo=True, logprobs=0
    )
    np.testing.assert_allclose(
        lp.token_logprobs[1:], longer.choices[0].logprobs.token_logprobs[1:], atol=TOL
    )


def test_echo_top_logprobs_at_every_prompt_position_are_the_next_token_top_k(client):
    """lm-eval's is_greedy reads the echoed prompt's top_logprobs: at each position the N best
    tokens given the ones before it (plus the prompt token), as the engine's own top-N for that
    prefix gives them, the greedy token first; the scored golden token is the greedy one."""
    prompt, token, logprob = GOLDEN["prompts"][3], GOLDEN["tokens"][3], GOLDEN["logprobs"][3]
    full = [*prompt, token]
    out = client.completions.create(
        model="m", prompt=full, max_tokens=0, echo=True, logprobs=5, temperature=0
    )
    lp = out.choices[0].logprobs
    assert lp.top_logprobs[0] is None and len(lp.top_logprobs) == len(full)
    prefixes = [full[:j] for j in range(1, len(full))]
    nexts = client.completions.create(model="m", prompt=prefixes, max_tokens=1, logprobs=5)
    for j, choice in enumerate(nexts.choices, start=1):
        top, own = lp.top_logprobs[j], f"token_id:{full[j]}"
        assert own in top and top[own] == lp.token_logprobs[j]
        best = choice.logprobs.top_logprobs[0]  # the engine's top-5 after the prefix
        assert len(best) == 5 and set(best) <= set(top) and len(top) <= 6
        for text, value in best.items():
            assert abs(top[text] - value) < 1e-5, (j, text)
        assert max(top, key=top.get) == choice.logprobs.tokens[0]  # the greedy token
    assert max(lp.top_logprobs[-1], key=lp.top_logprobs[-1].get) == f"token_id:{token}"
    assert abs(lp.top_logprobs[-1][f"token_id:{token}"] - logprob) < TOL


def test_unknown_fields_are_tolerated(client):
    extra = {"no_stop_trim": True, "ignore_eos": False, "skip_special_tokens": True,
             "return_hidden_states": False, "stream": False}  # fmt: skip
    out = client.completions.create(model="m", prompt=[5, 6], max_tokens=1, extra_body=extra)
    assert len(out.choices) == 1 and out.choices[0].text == ""


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"max_tokens": 5}, "prefill server"),
        ({"logprobs": 21}, "logprobs must be between 0 and 20"),
        ({"n": 2}, "n must be 1"),
        ({"prompt": [5, 1000]}, "outside the vocabulary"),
        ({"prompt": "text"}, "no tokenizer"),
        ({"prompt": [[1, 2], []]}, "prompt[1]: prompt is empty"),
        ({"prompt": [1] * 257}, "max_prompt_tokens=256"),
    ],
)
def test_refusals_are_openai_400s(client, kwargs, needle):
    args = {"model": "m", "prompt": [1, 2], "max_tokens": 1} | kwargs
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**args)
    assert info.value.status_code == 400
    body = info.value.body
    assert needle in body["message"] and body["type"] == "invalid_request_error"
    assert body["code"] == 400


def test_embeddings_float_and_base64(client):
    inputs = [GOLDEN["prompts"][1], GOLDEN["prompts"][3]]
    out = client.embeddings.create(model="m", input=inputs, encoding_format="float")
    assert [d.index for d in out.data] == [0, 1]
    vectors = np.array([d.embedding for d in out.data])
    assert vectors.shape == (2, 64) and np.isfinite(vectors).all()
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, inputs))
    raw = httpx.post(
        str(client.base_url) + "embeddings",
        json={"model": "m", "input": inputs[1], "encoding_format": "base64"},
    ).json()
    b64 = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(b64, np.float32(vectors[1]))
    short = client.embeddings.create(model="m", input=inputs, dimensions=8, encoding_format="float")
    np.testing.assert_array_equal([d.embedding for d in short.data], vectors[:, :8])  # Matryoshka
    for dims in (0, 65):  # 0 or more than the model's size
        with pytest.raises(openai.BadRequestError, match="dimensions"):
            client.embeddings.create(model="m", input=[[1, 2]], dimensions=dims)


def test_other_endpoints(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny/llama"]
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json()["is_running"]
    info = httpx.get(server.url + "/server_info").json()
    assert info["served_model_name"] == "tiny/llama" and info["max_model_len"] == 256
    assert "model_path" not in info and "tokenizer_path" not in info  # sglang-router downloads it
    r = httpx.post(server.url + "/tokenize", json={"prompt": "hi"})
    assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
    r = httpx.post(
        server.url + "/v1/completions", json={"prompt": [1]}, headers={"X-Request-Id": "abc-7"}
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-7"
    assert r.json()["id"] == "cmpl-abc-7"
    assert httpx.get(server.url + "/nope").status_code == 404
    assert httpx.get(server.url + "/v1/completions").status_code == 405
    text = httpx.get(server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    answers = {(s.labels["route"], s.labels["status"]): s.value
               for s in families["aioprefill_http_responses"].samples}  # fmt: skip
    assert answers[("/v1/completions", "200")] >= 1 and answers[("other", "404")] == 1
    assert answers[("/v1/completions", "405")] == 1
    ttft = families["aioprefill_ttft_seconds"]
    count = next(s.value for s in ttft.samples if s.name.endswith("_count"))
    assert count >= 1 and not math.isnan(count)
