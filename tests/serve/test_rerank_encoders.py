"""The scoring endpoints on encoder models (one server each for the module): a synthetic BERT
cross-encoder (tests/data/encoder/bert_cls, transformers' goldens) reranks by sigmoid(logit) as
sentence-transformers' CrossEncoder.predict does (within 1e-5), TEI's raw_scores give the
logit; all-MiniLM-L6-v2 as its package ships it answers /embed and /v1/embeddings (the official
openai client) with sentence-transformers' normalised embeddings (24 golden sentences, 8 past
max_seq_length truncated as it truncates) (cosine >= 0.99999, max |d| <= 1e-5), and /v1/score and
/v1/rerank by cosine; label_token_ids scoring is a decoder's (400). Named prompts
(`config_sentence_transformers.json`, here a copy of MiniLM's directory given two) go before
each text as `SentenceTransformer.encode(prompt_name=)` puts them."""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest

from tests.encoder_models import DATA, minilm_dir
from tests.serve.util import serve

pytestmark = pytest.mark.slow

CLS = json.loads((DATA / "bert_cls" / "expected.json").read_text())
MINI = json.loads((DATA / "minilm" / "expected.json").read_text())


@pytest.fixture(scope="module")
def bert():
    with serve("--model", str(DATA / "bert_cls"), "--workers", "1") as s:
        yield s


PROMPTS = {"query": "query: ", "passage": "passage: "}


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    # MiniLM as shipped, but for the named prompts E5-style models carry (no default prompt,
    # so every other test's inputs are embedded as they are)
    model = tmp_path_factory.mktemp("minilm-prompts")
    for f in minilm_dir().iterdir():
        if f.name != "config_sentence_transformers.json":
            (model / f.name).symlink_to(f)
    (model / "config_sentence_transformers.json").write_text(json.dumps({"prompts": PROMPTS}))
    with serve("--model", str(model), "--served-model-name", "minilm", "--workers", "1") as s:
        yield s


def test_cross_encoder_rerank_equals_crossencoder_predict(bert):
    by_query: dict[str, list[int]] = {}
    for i, p in enumerate(CLS["pairs"]):
        by_query.setdefault(p["query"], []).append(i)
    with httpx.Client(base_url=bert.url, timeout=60) as http:
        for query, rows in by_query.items():
            docs = [CLS["pairs"][i]["document"] for i in rows]
            out = http.post("/v1/rerank", json={"query": query, "documents": docs}).json()
            got = {r["index"]: r["relevance_score"] for r in out["results"]}
            want = [CLS["pairs"][i]["crossencoder_predict"] for i in rows]
            np.testing.assert_allclose([got[k] for k in range(len(rows))], want, atol=1e-5)
            assert [r["index"] for r in out["results"]] == list(np.argsort(-np.asarray(want)))
            tei = http.post("/rerank", json={"query": query, "texts": docs, "raw_scores": True})
            logits = {r["index"]: r["score"] for r in tei.json()}
            want_logits = [CLS["pairs"][i]["logit"] for i in rows]
            np.testing.assert_allclose(
                [logits[k] for k in range(len(rows))], want_logits, atol=1e-5
            )
        pairs = CLS["pairs"][:3]
        body = {"text_1": [p["query"] for p in pairs], "text_2": [p["document"] for p in pairs]}
        scores = [d["score"] for d in http.post("/score", json=body).json()["data"]]
        np.testing.assert_allclose(scores, [p["crossencoder_predict"] for p in pairs], atol=1e-5)


def test_minilm_embeddings_equal_sentence_transformers_through_embed_and_openai(minilm):
    # 24 of the 200 golden sentences (the engine-level test has them all): 8 past
    # max_seq_length, cut as sentence-transformers cuts them, and 16 others
    lengths = np.asarray(MINI["untruncated_lengths"])
    long = np.flatnonzero(lengths > MINI["max_seq_length"])[:8]
    pick = sorted([*long, *np.flatnonzero(lengths <= MINI["max_seq_length"])[:16]])
    want = np.load(DATA / "minilm" / "embeddings.npy")[pick]
    sentences = [MINI["sentences"][i] for i in pick]
    with httpx.Client(base_url=minilm.url, timeout=120) as http:
        tei = np.asarray(http.post("/embed", json={"inputs": sentences}).json())
    with openai.OpenAI(base_url=minilm.url + "/v1", api_key="none", max_retries=0) as client:
        got = client.embeddings.create(model="minilm", input=sentences)  # base64 on the wire
    oa = np.asarray([d.embedding for d in got.data])
    for vectors in (tei, oa):
        assert vectors.shape == want.shape
        cos = (vectors * want).sum(axis=1) / np.linalg.norm(vectors, axis=1)
        assert cos.min() >= 0.99999 and np.abs(vectors - want).max() <= 1e-5


def test_minilm_scores_by_cosine_and_refuses_label_scoring(minilm):
    want = np.load(DATA / "minilm" / "embeddings.npy")
    s = MINI["sentences"]
    with httpx.Client(base_url=minilm.url, timeout=60) as http:
        out = http.post("/v1/score", json={"text_1": s[0], "text_2": s[1:4]}).json()
        np.testing.assert_allclose(
            [d["score"] for d in out["data"]], want[1:4] @ want[0], atol=1e-5
        )
        ranked = http.post("/v1/rerank", json={"query": s[0], "documents": s[1:4]}).json()
        assert [r["index"] for r in ranked["results"]] == list(np.argsort(-(want[1:4] @ want[0])))
        r = http.post("/v1/score", json={"query": "a", "items": ["b"], "label_token_ids": [1]})
        assert r.status_code == 400 and "decoder" in r.json()["error"]["message"]
        short = http.post("/embed", json={"inputs": s[0], "dimensions": 32}).json()[0]
        v = want[0][:32] / np.linalg.norm(want[0][:32])
        np.testing.assert_allclose(short, v, atol=1e-5)  # Matryoshka: cut, back to unit length


def test_named_prompts_go_before_each_text_and_unknown_names_are_400(minilm):
    texts = MINI["sentences"][:3]
    with httpx.Client(base_url=minilm.url, timeout=60) as http:
        named = http.post("/embed", json={"inputs": texts, "prompt_name": "query"}).json()
        spelled = http.post("/embed", json={"inputs": [PROMPTS["query"] + t for t in texts]})
        plain = http.post("/embed", json={"inputs": texts}).json()
        assert named == spelled.json() and named != plain
        spelled = http.post("/embed", json={"inputs": [PROMPTS["passage"] + t for t in texts]})
    with openai.OpenAI(base_url=minilm.url + "/v1", api_key="none", max_retries=0) as client:
        got = client.embeddings.create(
            model="minilm", input=texts, extra_body={"prompt_name": "passage"}
        )
    oa = [d.embedding for d in got.data]
    np.testing.assert_array_equal(np.float32(oa), np.float32(spelled.json()))
    with httpx.Client(base_url=minilm.url, timeout=60) as http:
        r = http.post("/embed", json={"inputs": texts, "prompt_name": "document"})
        assert r.status_code == 400 and "'passage', 'query'" in r.json()["error"]["message"]
        r = http.post("/v1/embeddings", json={"input": [[101, 102]], "prompt_name": "query"})
        assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
