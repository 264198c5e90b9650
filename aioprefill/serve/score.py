"""/v1/score and /score: vLLM's pair scoring and SGLang's label-token scoring.

- vLLM's `{model, text_1, text_2}` (or `{queries, documents}`), each a string or a list:
  one first text against N second texts, or N against N pairwise; answers `{id, object:
  "list", model, data: [{index, object: "score", score}], usage}`, each score as rerank's
  relevance (`scoring.py`: template + labels, classifier, or cosine).
- SGLang's `{query, items, label_token_ids, apply_softmax, item_first}` (a decoder LM): each
  item's prompt is query + item (`item_first`: item + query; strings joined then tokenized,
  or token-id lists joined); answers `{scores: [[p per label] per item], usage}`, p the
  probability of each label token at the prompt's last position (`apply_softmax`: renormalised
  over the labels).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from aioprefill.errors import InvalidRequest
from aioprefill.serve.rank_schemas import (
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    SGLangScoreResponse,
)
from aioprefill.serve.rerank import truncation, usage
from aioprefill.serve.scoring import Pair, run_all, softmax, texts
from aioprefill.wire.outputs import parse_labels

if TYPE_CHECKING:
    from aioprefill.serve.routes import Service

__all__ = ["score"]

_decoder = msgspec.json.Decoder(ScoreRequest)
_encode = msgspec.json.Encoder().encode


async def score(svc: Service, body: bytes, request_id: str, tenant: str | None) -> bytes:
    from aioprefill.serve.routes import decode_body

    req = decode_body(_decoder, body)
    salt = svc.salt_option(tenant, req.cache_salt)
    if req.items is not None or req.label_token_ids is not None:
        return await _sglang(svc, req, request_id, salt)
    first = _pick(req.text_1, req.queries, "text_1", "queries")
    second = _pick(req.text_2, req.documents, "text_2", "documents")
    a = texts(first[0], first[1])
    b = texts(second[0], second[1])
    if len(a) != 1 and len(a) != len(b):
        raise InvalidRequest(
            f"{first[1]} holds {len(a)} texts and {second[1]} {len(b)}: send one against many, "
            "or as many as pairs"
        )
    cut = truncation(None, req.truncate_prompt_tokens)
    if len(b) > svc.scorer.max_documents:
        raise InvalidRequest(f"{second[1]} holds {len(b)}, more than {svc.scorer.max_documents}")
    if len(a) == 1:
        groups = [await svc.scorer.pairs(a[0], b, second[1], cut)]
    else:
        groups = [
            await svc.scorer.pairs(q, [d], f"{second[1]}[{i}]", cut)
            for i, (q, d) in enumerate(zip(a, b, strict=True))
        ]
    results = await run_all(svc.engine, [p for g in groups for p in g], request_id, salt)
    scores, at = [], 0
    for g in groups:
        scores += svc.scorer.scores(results[at : at + len(g)])
        at += len(g)
    data = [ScoreData(index=i, score=s) for i, s in enumerate(scores)]
    model = svc.settings.served_model_name
    return _encode(
        ScoreResponse(
            id=f"score-{request_id}",
            created=int(time.time()),
            model=model,
            data=data,
            usage=usage(results),
        )
    )


def _pick(value: Any, other: Any, name: str, other_name: str) -> tuple[Any, str]:
    if value is not None and other is not None:
        raise InvalidRequest(f"send {name} or {other_name}, not both")
    if value is None and other is None:
        raise InvalidRequest(f"{name} (or {other_name}) is required")
    return (value, name) if value is not None else (other, other_name)


async def _sglang(svc: Service, req: ScoreRequest, request_id: str, salt: dict[str, Any]) -> bytes:
    if svc.scorer.kind != "template":
        raise InvalidRequest("label_token_ids scoring needs a decoder LM; this model is an encoder")
    if req.label_token_ids is None:
        raise InvalidRequest("label_token_ids is required with items")
    if not isinstance(req.label_token_ids, list):
        raise InvalidRequest("label_token_ids must be a list of token ids")
    labels = parse_labels(req.label_token_ids, svc.vocab_size).tolist()
    if req.query is None or req.items is None:
        raise InvalidRequest("query and items are required")
    query = texts(req.query, "query", allow_ids=True, one=True)[0]
    items = texts(req.items, "items", allow_ids=True)
    if len(items) > svc.scorer.max_documents:
        raise InvalidRequest(f"items holds {len(items)}, more than {svc.scorer.max_documents}")
    text = isinstance(query, str)
    pairs = []
    for i, item in enumerate(items):
        if isinstance(item, str) != text:
            raise InvalidRequest(f"items[{i}]: query and items must both be text or both token ids")
        joined = item + query if req.item_first else query + item
        ids = await svc.scorer.text_ids(joined, f"items[{i}]") if text else joined
        if len(ids) > svc.scorer.limit:
            raise InvalidRequest(
                f"items[{i}]: the prompt is {len(ids)} tokens, more than {svc.scorer.limit}"
            )
        pairs.append(Pair(ids, {"label_token_ids": labels}))
    results = await run_all(svc.engine, pairs, request_id, salt)
    scores = []
    for r in results:
        lps = r.label_logprobs
        assert lps is not None
        p = softmax(lps) if req.apply_softmax else np.exp(lps.astype(np.float64))
        scores.append([float(x) for x in p])
    model = svc.settings.served_model_name
    return _encode(SGLangScoreResponse(scores=scores, model=model, usage=usage(results)))
