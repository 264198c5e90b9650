"""A ModernBERT cross-encoder behind the scoring endpoints (tests/data/encoder/modernbert_cls,
transformers' goldens): /v1/rerank gives sigmoid(logit), TEI's /rerank with raw_scores the
logit, within 1e-5 and in the goldens' order. ModernBERT has no token types: its tokenizer's
pair template marks the document type 1, which the server does not send (a model with one
token type reads none)."""

from __future__ import annotations

import json
import math

import httpx
import numpy as np
import pytest

from tests.encoder_models import DATA
from tests.serve.util import serve

pytestmark = pytest.mark.slow

PAIRS = json.loads((DATA / "modernbert_cls" / "expected.json").read_text())["pairs"]


def test_modernbert_cross_encoder_reranks_by_its_logits() -> None:
    by_query: dict[str, list[int]] = {}
    for i, p in enumerate(PAIRS):
        by_query.setdefault(p["query"], []).append(i)
    with (
        serve("--model", str(DATA / "modernbert_cls"), "--workers", "1") as s,
        httpx.Client(base_url=s.url, timeout=60) as http,
    ):
        for query, rows in by_query.items():
            docs = [PAIRS[i]["document"] for i in rows]
            logits = np.array([PAIRS[i]["logit"] for i in rows])
            out = http.post("/v1/rerank", json={"query": query, "documents": docs})
            assert out.status_code == 200, out.text
            got = {r["index"]: r["relevance_score"] for r in out.json()["results"]}
            want = [1 / (1 + math.exp(-x)) for x in logits]
            np.testing.assert_allclose([got[k] for k in range(len(rows))], want, atol=1e-5)
            assert [r["index"] for r in out.json()["results"]] == list(np.argsort(-logits))
            tei = http.post("/rerank", json={"query": query, "texts": docs, "raw_scores": True})
            raw = {r["index"]: r["score"] for r in tei.json()}
            np.testing.assert_allclose([raw[k] for k in range(len(rows))], logits, atol=1e-5)
