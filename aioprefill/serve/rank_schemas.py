"""The bodies of the scoring endpoints, as msgspec Structs with their owners' field names:
Jina/Cohere's and TEI's rerank, vLLM's and SGLang's score, TEI's embed (`rerank.py`,
`score.py`, `embed.py` answer them).

Request fields that may hold several shapes (a string or a list, strings or token ids) are
declared `Any` and checked by the endpoint, so a bad one is a 400 naming the field and index.
"""

from __future__ import annotations

from typing import Any

import msgspec

from aioprefill.serve.schemas import PromptTokensDetails

__all__ = [
    "EmbedRequest",
    "RankUsage",
    "RerankDocument",
    "RerankRequest",
    "RerankResponse",
    "RerankResult",
    "SGLangScoreResponse",
    "ScoreData",
    "ScoreRequest",
    "ScoreResponse",
    "TEIRank",
]


class RerankRequest(msgspec.Struct, kw_only=True):
    """POST /v1/rerank and /rerank: Jina/Cohere's (`documents`, `top_n`, `return_documents`)
    or, when it has `texts`, TEI's (`texts`, `raw_scores`, `return_text`, `truncate`)."""

    query: Any = None
    documents: Any = None
    model: str | None = None
    top_n: int | None = None
    return_documents: bool | None = None
    texts: Any = None
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool | None = None
    truncation_direction: str = "right"
    truncate_prompt_tokens: int | None = None  # vLLM's
    cache_salt: str | None = None


class ScoreRequest(msgspec.Struct, kw_only=True):
    """POST /v1/score and /score: vLLM's `{text_1, text_2}` / `{queries, documents}`, or
    SGLang's `{query, items, label_token_ids, apply_softmax, item_first}`."""

    model: str | None = None
    text_1: Any = None
    text_2: Any = None
    queries: Any = None
    documents: Any = None
    query: Any = None
    items: Any = None
    label_token_ids: Any = None
    apply_softmax: bool = False
    item_first: bool = False
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None


class EmbedRequest(msgspec.Struct, kw_only=True):
    """POST /embed (TEI's): one text or a list, unit vectors unless `normalize` is false."""

    inputs: Any = None
    normalize: bool = True
    truncate: bool | None = None
    truncation_direction: str = "right"
    dimensions: int | None = None
    prompt_name: str | None = None


class RankUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class RerankDocument(msgspec.Struct, kw_only=True):
    text: str


class RerankResult(msgspec.Struct, kw_only=True):
    index: int
    relevance_score: float
    document: RerankDocument | msgspec.UnsetType = msgspec.UNSET


class RerankResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    results: list[RerankResult]
    usage: RankUsage


class TEIRank(msgspec.Struct, kw_only=True):
    index: int
    score: float
    text: str | msgspec.UnsetType = msgspec.UNSET


class ScoreData(msgspec.Struct, kw_only=True):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: RankUsage
    object: str = "list"


class SGLangScoreResponse(msgspec.Struct, kw_only=True):
    scores: list[list[float]]
    model: str
    usage: RankUsage
    object: str = "scoring"
