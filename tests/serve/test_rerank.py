"""/v1/rerank, /rerank, /v1/score, /score, /embed and /v1/embeddings' new fields on the real
SmolLM2 as a yes/no generative reranker (one server for the module, a query-first template):
relevance equals transformers float64 within 1e-4 (tests/data/smollm2/rerank.json,
benchmarks/tools/make_rerank_goldens.py), in Jina/Cohere's, TEI's, vLLM's and SGLang's shapes;
the query's blocks come from the prefix cache for all but the first document; embeddings
through the official openai client with `dimensions` and base64; every bad body a 400 naming
its field, and a fuzz of the new endpoints never a 5xx. A model without a template cannot
rerank (400)."""

from __future__ import annotations

import base64
import json
import math

import httpx
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.hf.smollm2 import DATA
from tests.serve.util import serve

G = json.loads((DATA / "rerank.json").read_text())
TOL = 1e-4

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    flags = ["--served-model-name", "smollm2", "--rerank-template", G["template"]]
    limits = ["--max-documents", "20", "--max-prompt-tokens", "2048"]
    with serve(*flags, *limits, "--workers", "1") as s:  # one worker: one prefix cache
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def post(http: httpx.Client, path: str, body: dict, status: int = 200):
    r = http.post(path, json=body)
    assert r.status_code == status, (path, r.status_code, r.text)
    return r.json()


def test_rerank_equals_transformers_fp64_and_reads_the_query_from_the_cache(http):
    docs, want = G["documents"], G["relevance"]
    out = post(http, "/v1/rerank", {"model": "smollm2", "query": G["query"], "documents": docs})
    got = {r["index"]: r["relevance_score"] for r in out["results"]}
    np.testing.assert_allclose([got[i] for i in range(len(docs))], want, atol=TOL)
    assert [r["index"] for r in out["results"]] == sorted(range(len(docs)), key=lambda i: -got[i])
    assert all(r["document"]["text"] == docs[r["index"]] for r in out["results"])
    assert out["model"] == "smollm2" and out["id"]
    usage, ids = out["usage"], G["prompt_ids"]
    assert usage["prompt_tokens"] == usage["total_tokens"] == sum(map(len, ids))
    head = next(k for k, (a, b) in enumerate(zip(*ids[:2], strict=False)) if a != b)
    assert head > 32  # the template's text before the document, the query in it
    assert usage["prompt_tokens_details"]["cached_tokens"] >= (head // 16) * 16 * (len(docs) - 1)
    # top_n, no documents, Cohere's {"text": ...} documents
    body = {"query": G["query"], "documents": [{"text": d} for d in docs], "top_n": 2}
    top = post(http, "/rerank", {**body, "return_documents": False})["results"]
    assert [r["index"] for r in top] == [r["index"] for r in out["results"][:2]]
    assert all("document" not in r for r in top)


def test_tei_rerank_shape(http):
    docs = G["documents"][:3]
    out = post(http, "/rerank", {"query": G["query"], "texts": docs, "return_text": True})
    assert [set(r) for r in out] == [{"index", "score", "text"}] * 3
    assert [r["score"] for r in out] == sorted((r["score"] for r in out), reverse=True)
    for r in out:
        assert abs(r["score"] - G["relevance"][r["index"]]) <= TOL
        assert r["text"] == docs[r["index"]]


def test_vllm_score_one_to_many_and_pairwise(http):
    docs, want = G["documents"], G["relevance"]
    out = post(http, "/v1/score", {"model": "smollm2", "text_1": G["query"], "text_2": docs})
    assert out["object"] == "list" and [d["index"] for d in out["data"]] == list(range(len(docs)))
    np.testing.assert_allclose([d["score"] for d in out["data"]], want, atol=TOL)
    pairs = post(http, "/score", {"queries": [G["query"]] * 2, "documents": docs[2:4]})
    np.testing.assert_allclose([d["score"] for d in pairs["data"]], want[2:4], atol=TOL)
    assert pairs["data"][0]["object"] == "score"


def test_sglang_label_token_scoring(http):
    s = G["sglang"]
    body = {"query": s["query"], "items": s["items"], "label_token_ids": s["label_ids"]}
    out = post(http, "/v1/score", body)
    np.testing.assert_allclose(out["scores"], s["probabilities"], atol=TOL)
    soft = post(http, "/v1/score", {**body, "apply_softmax": True})["scores"]
    p = np.asarray(s["probabilities"])
    np.testing.assert_allclose(soft, p / p.sum(axis=1, keepdims=True), atol=TOL)
    # token ids: query + item joined, or item + query with item_first
    ids = s["prompt_ids"][0]
    by_ids = post(http, "/score", {**body, "query": ids[:5], "items": [ids[5:]]})["scores"]
    np.testing.assert_allclose(by_ids[0], s["probabilities"][0], atol=TOL)
    first = {**body, "query": ids[5:], "items": [ids[:5]], "item_first": True}
    assert post(http, "/score", first)["scores"] == by_ids


def test_embeddings_with_the_openai_client_dimensions_base64_and_truncation(server, http):
    text = ["The capital of France is", "Bananas are yellow."]
    full = post(http, "/v1/embeddings", {"input": text})["data"]
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
        raw = client.embeddings.create(
            model="smollm2", input=text, dimensions=8, encoding_format="base64"
        )
        auto = client.embeddings.create(model="smollm2", input=text, dimensions=8)  # it asks
    for r, a, f in zip(raw.data, auto.data, full, strict=True):  # for base64 and decodes it
        got = np.frombuffer(base64.b64decode(r.embedding), dtype="<f4")
        assert len(got) == 8  # mean pooling, not normalised: the first 8 values
        np.testing.assert_array_equal(got, np.float32(f["embedding"][:8]))
        np.testing.assert_array_equal(np.float32(a.embedding), got)
    ids = post(http, "/tokenize", {"prompt": text[0]})["tokens"]
    cut = post(http, "/v1/embeddings", {"input": text[0], "truncate_prompt_tokens": 3})
    tail = post(http, "/v1/embeddings", {"input": ids[-3:]})
    assert cut["data"][0]["embedding"] == tail["data"][0]["embedding"]  # the last 3 ids
    assert cut["usage"]["prompt_tokens"] == 3
    tei = post(http, "/embed", {"inputs": text[0], "dimensions": 4})
    v = np.asarray(full[0]["embedding"][:4], dtype=np.float64)
    np.testing.assert_allclose(tei[0], v / np.linalg.norm(v), atol=1e-6)  # unit length again
    assert abs(np.linalg.norm(post(http, "/embed", {"inputs": [text[1]]})[0]) - 1) < 1e-5


BAD = [
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a", 1]}, "documents[1]"),
    ("/v1/rerank", {"query": "q"}, "documents"),
    ("/v1/rerank", {"documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": ["a"] * 21}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["word " * 2100]}, "documents[0]"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "truncate_prompt_tokens": -2}, "truncate"),
    ("/rerank", {"query": "q", "texts": [None]}, "texts[0]"),
    ("/v1/score", {"text_1": ["a", "b", "c"], "text_2": ["a", "b"]}, "text_1"),
    ("/v1/score", {"text_1": "a"}, "text_2"),
    ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [49152]}, "label_token_ids"),
    ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": []}, "label_token_ids"),
    ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": "yes"}, "label_token_ids"),
    ("/v1/score", {"query": "q", "items": [[1]], "label_token_ids": [1]}, "items[0]"),
    ("/v1/embeddings", {"input": "a", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"input": "a", "dimensions": 577}, "dimensions"),
    ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/embed", {"inputs": ["a", 2]}, "inputs[1]"),
    ("/embed", {"inputs": "a", "dimensions": 9999}, "dimensions"),
]


def test_bad_requests_are_400_naming_the_field(http):
    for path, body, field in BAD:
        err = post(http, path, body, 400)["error"]
        assert field in err["message"], (path, body, err)


TEXT = st.one_of(st.text(max_size=30), st.integers(-5, 60000), st.none(), st.booleans())
VALUE = st.one_of(TEXT, st.lists(TEXT, max_size=4), st.lists(st.integers(-2, 50000), max_size=4))
BODIES = {
    "/v1/rerank": ["query", "documents", "top_n", "return_documents", "truncate_prompt_tokens"],
    "/rerank": ["query", "texts", "raw_scores", "return_text", "truncate"],
    "/v1/score": ["text_1", "text_2", "queries", "documents", "query", "items",
                  "label_token_ids", "apply_softmax", "item_first"],
    "/embed": ["inputs", "normalize", "truncate", "dimensions"],
    "/v1/embeddings": ["input", "dimensions", "truncate_prompt_tokens", "encoding_format"],
}  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_of_the_new_endpoints_gives_no_5xx(http, data):
    path = data.draw(st.sampled_from(sorted(BODIES)))
    keys = data.draw(st.lists(st.sampled_from(BODIES[path]), max_size=4, unique=True))
    body = {k: data.draw(VALUE) for k in keys}
    r = http.post(path, json=body)
    assert r.status_code < 500, (path, body, r.text)
    if r.status_code != 200:
        assert r.json()["error"]["message"]


def test_a_model_without_template_or_classifier_cannot_rerank():
    with serve("--model", "sim", "--sim-vocab-size", "1000") as s:
        r = httpx.post(s.url + "/v1/rerank", json={"query": "q", "documents": ["a"]}, timeout=30)
        assert r.status_code == 400 and "--rerank-template" in r.json()["error"]["message"]
        body = {"query": [1, 2], "items": [[3], [4, 5]], "label_token_ids": [7, 9]}
        out = httpx.post(s.url + "/v1/score", json={**body, "apply_softmax": True}, timeout=30)
        assert out.status_code == 200, out.text
        assert all(math.isclose(sum(p), 1.0, rel_tol=1e-9) for p in out.json()["scores"])
