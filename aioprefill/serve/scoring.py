"""How this server's model scores a (query, document) pair, for /v1/rerank and /v1/score.

- a decoder LM, by a template and label tokens (generative reranking): the template's text
  with the query and the document in it, and relevance = the softmax over the label tokens'
  logprobs at its last position, taken for the first label ("yes" of "yes"/"no"). The
  Qwen3-Reranker template and "yes"/"no" are the default for Qwen3 checkpoints;
  `--rerank-template` (a format string with {query} and {document}, or a file holding one) and
  `--label-tokens` set others; without a template a decoder cannot rerank (400). The template
  is tokenized in three pieces, ids joined: the text before {document} (the query in it;
  special tokens such as BOS added), the document, the text after it. So with the query first
  every document's prompt starts with the same ids, and the prefix cache computes the query's
  blocks once for all of them (a request's documents are submitted together).
- a cross-encoder (an encoder with a one-label classifier): the pair tokenized as the model's
  tokenizer pairs two texts (token types), relevance = sigmoid(logit).
- an embedding model (an encoder without a classifier): cosine of the two pooled embeddings.
"""

from __future__ import annotations

import asyncio
import importlib
import math
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aioprefill.engine.loop import Engine
from aioprefill.errors import InvalidConfig, InvalidRequest
from aioprefill.result import PrefillResult
from aioprefill.serve.prompts import TokenizerLike

__all__ = ["QWEN3_RERANK_TEMPLATE", "Pair", "Scorer", "run_all", "texts"]

QWEN3_RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that "
    "answer the query\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


@dataclass(slots=True)
class Pair:
    """One engine request of a scoring call: its ids and options (token types, labels)."""

    ids: list[int]
    options: dict[str, Any] = field(default_factory=dict)


def texts(value: Any, field_name: str, *, allow_ids: bool = False, one: bool = False) -> list[Any]:
    """A request field holding a string or a list of strings (or token-id lists with
    `allow_ids`) as a list, each checked: 400 naming the field and index otherwise."""
    if isinstance(value, str) or (allow_ids and _is_ids(value)):
        return [value]
    if one:
        raise InvalidRequest(f"{field_name} must be a string, got {_kind(value)}")
    if not isinstance(value, list):
        raise InvalidRequest(
            f"{field_name} must be a string or a list of strings, got {_kind(value)}"
        )
    if not value:
        raise InvalidRequest(f"{field_name} must not be empty")
    for i, item in enumerate(value):
        if not (isinstance(item, str) or (allow_ids and _is_ids(item))):
            what = "a string or a list of token ids" if allow_ids else "a string"
            raise InvalidRequest(f"{field_name}[{i}] must be {what}, got {_kind(item)}")
    return value


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


class Scorer:
    """What the server's model does for rerank and score, decided once at start."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: TokenizerLike | None,
        *,
        template: str | None,
        label_tokens: tuple[str, ...],
        max_documents: int,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_documents = max_documents
        spec = engine.config.model
        self.limit = engine.config.max_prompt_tokens or spec.max_prompt_tokens
        self.num_labels = int(getattr(spec, "num_labels", 0) or 0)
        # a model with one token type reads none: a pair's type ids (ModernBERT's template
        # gives the second text type 1) are not sent
        self._typed = int(getattr(spec, "type_vocab_size", 0) or 0) > 1
        encoder = bool(getattr(spec, "is_encoder", False))
        self.kind = "classifier" if self.num_labels else "embedding" if encoder else "template"
        if template is None and getattr(spec, "architecture", "") == "Qwen3ForCausalLM":
            template = QWEN3_RERANK_TEMPLATE
        self.template = None if encoder else load_template(template)
        self.label_tokens = label_tokens
        self._label_ids: list[int] | None = None
        self._pairs: Any = None  # the encoder's pair tokenizer, made on first use

    def why_not(self) -> str | None:
        """Why this model cannot rerank (None: it can)."""
        if self.kind == "template" and self.template is None:
            return (
                "this model cannot rerank or score pairs: a decoder LM needs a template (start "
                "the server with --rerank-template '...{query}...{document}...' and "
                "--label-tokens yes,no); cross-encoders and embedding models need none"
            )
        if self.kind == "classifier" and self.num_labels != 1:
            return f"this classifier has {self.num_labels} labels; rerank needs a one-label one"
        if self.tokenizer is None:
            return "this server has no tokenizer: rerank and score need text"
        return None

    def label_ids(self) -> list[int]:
        """The label tokens' ids (each must be one token of the tokenizer)."""
        if self._label_ids is None:
            assert self.tokenizer is not None
            ids = []
            for label in self.label_tokens:
                got = self.tokenizer.encode(label, add_special_tokens=False)
                if len(got) != 1:
                    raise InvalidConfig(
                        f"--label-tokens: {label!r} is {len(got)} tokens, not one: {got}"
                    )
                ids.append(got[0])
            self._label_ids = ids
        return self._label_ids

    async def pairs(
        self, query: str, documents: list[str], field_name: str, truncate: int | None
    ) -> list[Pair]:
        """The engine requests that score `query` against each document. `truncate`: cut a
        document's tail so its prompt fits in min(truncate, the model's limit) tokens (None: a
        prompt over the limit is a 400 naming the document)."""
        if len(documents) > self.max_documents:
            raise InvalidRequest(
                f"{field_name} holds {len(documents)} documents, more than this server takes "
                f"in one request ({self.max_documents}, --max-documents)"
            )
        why = self.why_not()
        if why is not None:
            raise InvalidRequest(why)
        limit = self.limit if truncate is None else min(truncate, self.limit)
        if self.kind == "classifier":
            return self._cross_pairs(query, documents, field_name, limit, truncate is not None)
        if self.kind == "embedding":
            return [Pair(await self._embed_ids(t)) for t in [query, *documents]]
        return await self._template_pairs(query, documents, field_name, limit, truncate)

    async def _template_pairs(
        self, query: str, documents: list[str], field_name: str, limit: int, truncate: Any
    ) -> list[Pair]:
        assert self.template is not None and self.tokenizer is not None
        head, tail = self.template
        tok = self.tokenizer
        first = await tok.encode_async(head.replace("{query}", query)) if head else []
        tail_text = tail.replace("{query}", query)
        last = tok.encode(tail_text, add_special_tokens=False) if tail_text else []
        room = limit - len(first) - len(last)
        labels = {"label_token_ids": self.label_ids()}
        out = []
        for i, doc in enumerate(documents):
            ids = await tok.encode_async(doc, add_special_tokens=False) if doc else []
            if len(ids) > room:
                if truncate is None or room < 0:
                    raise InvalidRequest(
                        f"{field_name}[{i}]: the template, query and document are "
                        f"{len(first) + len(ids) + len(last)} tokens, more than {limit}; "
                        "shorten it or ask for truncation"
                    )
                ids = ids[:room]
            out.append(Pair([*first, *ids, *last], labels))
        if not out[0].ids:
            raise InvalidRequest(f"{field_name}: the prompt is empty")
        return out

    def _cross_pairs(
        self, query: str, documents: list[str], field_name: str, limit: int, cut: bool
    ) -> list[Pair]:
        pairs = self._pair_tokenizer()
        out = []
        for i, (ids, types) in enumerate(pairs.encode_pairs([(query, d) for d in documents])):
            if len(ids) > limit and not cut:
                raise InvalidRequest(f"{field_name}[{i}]: {len(ids)} tokens, more than {limit}")
            out.append(Pair(ids[:limit], {"token_type_ids": types[:limit]} if self._typed else {}))
        return out

    async def _embed_ids(self, text: str) -> list[int]:
        return list(self._pair_tokenizer().encode(text))

    async def text_ids(self, text: str, where: str) -> list[int]:
        """A text's ids as the model reads it: an encoder's with its special tokens, cut to
        its max_seq_length as sentence-transformers cuts it; a decoder's as tokenized."""
        if self.tokenizer is None:
            raise InvalidRequest(f"{where}: this server has no tokenizer: send token ids")
        if self.kind != "template":
            return await self._embed_ids(text)
        return await self.tokenizer.encode_async(text)

    def _pair_tokenizer(self) -> Any:
        """The encoder's text-to-ids (special tokens, pairs, the model's truncation)."""
        if self._pairs is None:
            try:
                module = importlib.import_module("aioprefill.text.encoder_text")
            except ImportError:
                raise InvalidRequest(
                    "rerank and score on encoder models need aioprefill.text.encoder_text "
                    "(encoder pair tokenization), which this build lacks"
                ) from None
            self._pairs = module.EncoderText.for_model(self.tokenizer, self.engine.config.model)
        return self._pairs

    def scores(self, results: list[PrefillResult], *, raw: bool = False) -> list[float]:
        """Relevance per document from its pair's results (`raw`: a classifier's logit)."""
        if self.kind == "embedding":
            q = _unit(results[0])
            return [float(q @ _unit(r)) for r in results[1:]]
        if self.kind == "classifier":
            logits = [float(r.scores[0]) for r in results]  # type: ignore[index]
            return logits if raw else [_sigmoid(x) for x in logits]
        return [float(softmax(r.label_logprobs)[0]) for r in results]  # type: ignore[arg-type]


def softmax(logprobs: np.ndarray) -> np.ndarray:
    """Softmax over label logprobs, in float64 (their probabilities renormalised)."""
    x = np.asarray(logprobs, dtype=np.float64)
    e = np.exp(x - x.max())
    out: np.ndarray = e / e.sum()
    return out


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _unit(r: PrefillResult) -> np.ndarray:
    assert r.embedding is not None
    v = r.embedding.astype(np.float64)
    n = np.linalg.norm(v)
    return v / n if n > 0 else v


def load_template(template: str | None) -> tuple[str, str] | None:
    """(text before {document}, text after it) of a template string or file; InvalidConfig
    when it lacks {query} or {document}."""
    if template is None:
        return None
    if "{document}" not in template and Path(template).is_file():
        template = Path(template).read_text()
    for name in ("{query}", "{document}"):
        if template.count(name) != 1:
            raise InvalidConfig(f"--rerank-template must hold {name} once: {template[:80]!r}")
    head, tail = template.split("{document}")
    return head, tail


async def run_all(
    engine: Engine, pairs: list[Pair], request_id: str, common: dict[str, Any]
) -> list[PrefillResult]:
    """Every pair's engine request, submitted together (a query-first template's documents
    share its cached blocks); one failing cancels the others."""
    return await all_or_none(
        engine.prefill(p.ids, request_id=f"{request_id}/{i}", **p.options, **common)
        for i, p in enumerate(pairs)
    )


async def all_or_none(requests: Iterable[Awaitable[PrefillResult]]) -> list[PrefillResult]:
    """One HTTP request's engine requests, submitted together; the first to fail cancels the
    others (and is raised once they are done): nothing of a failed request keeps running."""
    jobs = [asyncio.ensure_future(r) for r in requests]
    try:
        return await asyncio.gather(*jobs)
    except BaseException:
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        raise
