"""/v1/rerank and /rerank: one query against a list of documents, best first.

Jina/Cohere's body `{model, query, documents, top_n, return_documents}` answers
`{id, model, results: [{index, relevance_score, document?: {text}}], usage}` (`top_n` best,
`return_documents` default true; a document may be a string or `{"text": ...}`); a body with
`texts` is TEI's `{query, texts, raw_scores, return_text, truncate}` and answers
`[{index, score, text?}]`. How the model scores a pair: `scoring.py`. `usage.prompt_tokens`
counts every prompt's tokens, `prompt_tokens_details.cached_tokens` those read from the prefix
cache (with a query-first template, all but the first document's share of the query).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from aioprefill.errors import InvalidRequest
from aioprefill.serve.rank_schemas import (
    RankUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    TEIRank,
)
from aioprefill.serve.schemas import PromptTokensDetails
from aioprefill.serve.scoring import run_all, texts

if TYPE_CHECKING:
    from aioprefill.result import PrefillResult
    from aioprefill.serve.routes import Service

__all__ = ["rerank", "truncation", "usage"]

_decoder = msgspec.json.Decoder(RerankRequest)
_encode = msgspec.json.Encoder().encode


async def rerank(svc: Service, body: bytes, request_id: str, tenant: str | None) -> bytes:
    from aioprefill.serve.routes import decode_body

    req = decode_body(_decoder, body)
    tei = req.texts is not None
    field = "texts" if tei else "documents"
    raw = req.texts if tei else req.documents
    if req.query is None:
        raise InvalidRequest("query is required")
    query = texts(req.query, "query", one=True)[0]
    if raw is None:
        raise InvalidRequest("documents is required (or TEI's texts)")
    if isinstance(raw, list):  # Cohere/Jina: a document may be {"text": ...}
        raw = [
            d["text"] if isinstance(d, dict) and isinstance(d.get("text"), str) else d for d in raw
        ]
    documents = texts(raw, field)
    top_n = len(documents) if req.top_n is None else req.top_n
    if isinstance(top_n, bool) or top_n < 1:
        raise InvalidRequest(f"top_n must be a positive int, got {req.top_n}")
    if tei and req.truncation_direction.lower() not in ("left", "right"):
        raise InvalidRequest("truncation_direction must be 'left' or 'right'")
    pairs = await svc.scorer.pairs(
        query, documents, field, truncation(req.truncate, req.truncate_prompt_tokens)
    )
    results = await run_all(svc.engine, pairs, request_id, svc.salt_option(tenant, req.cache_salt))
    scores = svc.scorer.scores(results, raw=tei and req.raw_scores)
    order = sorted(range(len(documents)), key=lambda i: -scores[i])  # stable: ties by index
    if tei:
        return _encode(
            [
                TEIRank(
                    index=i, score=scores[i], **({"text": documents[i]} if req.return_text else {})
                )
                for i in order
            ]
        )
    give = req.return_documents is not False
    out = [
        RerankResult(
            index=i,
            relevance_score=scores[i],
            **({"document": RerankDocument(text=documents[i])} if give else {}),
        )
        for i in order[:top_n]
    ]
    model = svc.settings.served_model_name
    return _encode(
        RerankResponse(id=f"rerank-{request_id}", model=model, results=out, usage=usage(results))
    )


def truncation(truncate: bool | None, truncate_prompt_tokens: int | None) -> int | None:
    """The token limit a request asks its prompts to be cut to: TEI's `truncate` (the model's
    limit) or vLLM's `truncate_prompt_tokens` (N, or -1: the model's limit); None: no cutting
    (a prompt over the limit is a 400)."""
    n = truncate_prompt_tokens
    if n is not None:
        if isinstance(n, bool) or n == 0 or n < -1:
            raise InvalidRequest(f"truncate_prompt_tokens must be -1 or positive, got {n}")
        return 1 << 30 if n == -1 else n
    return 1 << 30 if truncate else None


def usage(results: list[PrefillResult]) -> RankUsage:
    n = sum(r.num_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    details = PromptTokensDetails(cached_tokens=cached)
    return RankUsage(prompt_tokens=n, total_tokens=n, prompt_tokens_details=details)
