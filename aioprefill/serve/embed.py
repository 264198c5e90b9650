"""/v1/embeddings (OpenAI's, with vLLM's `truncate_prompt_tokens`) and TEI's /embed.

Pooling is the model's own unless the server's `--pooling` / `--normalize` say otherwise: an
encoder's from its directory (sentence-transformers' Pooling and Normalize modules), a decoder
directory's `modules.json` likewise (`model_pooling`), else mean pooling, not normalised.
`dimensions` (Matryoshka) keeps the first N values, re-normalised when the vector was unit
length; 0 or more than the model's size is a 400. `encoding_format: "base64"` is the
little-endian float32 bytes, as OpenAI's client decodes them. `truncate_prompt_tokens` keeps
the last N token ids (vLLM's rule; -1: the model's limit); TEI's `truncate` keeps the first
(`truncation_direction: "left"`: the last) tokens that fit. An encoder's text is tokenized with
its special tokens and cut to its `max_seq_length` as sentence-transformers cuts it.
`prompt_name` (TEI's; also taken on /v1/embeddings) puts one of the model directory's named
prompts (`config_sentence_transformers.json`) before each text input, as
`SentenceTransformer.encode(prompt_name=)` does; without it the server's default prompt
(--default-prompt-name / --default-prompt, else the directory's `default_prompt_name`) applies.
Token-id inputs are taken as they are: a `prompt_name` with them is a 400.
"""

from __future__ import annotations

import base64
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from aioprefill.engine.validate import validate_prompt
from aioprefill.errors import InvalidConfig, InvalidRequest
from aioprefill.serve.errors import HTTPError
from aioprefill.serve.rank_schemas import EmbedRequest
from aioprefill.serve.schemas import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from aioprefill.serve.scoring import run_all, texts

if TYPE_CHECKING:
    from aioprefill.serve.routes import Service

__all__ = ["embed", "embeddings", "model_pooling"]

_embedding = msgspec.json.Decoder(EmbeddingRequest)
_embed = msgspec.json.Decoder(EmbedRequest)
_encode = msgspec.json.Encoder().encode


def model_pooling(path: str | None) -> tuple[str | None, bool | None]:
    """(pooling, normalize) a decoder checkpoint directory asks for in its sentence-transformers
    modules (`modules.json`), or (None, None) where it has none."""
    if path is None or not (Path(path) / "modules.json").is_file():
        return None, None
    from aioprefill.hf.encoder import sentence_transformers_fields

    fields = sentence_transformers_fields(Path(path))
    if fields["pooling"] not in ("mean", "last"):
        raise InvalidConfig(
            f"{path}/modules.json: pooling {fields['pooling']!r} is not available for a decoder "
            "LM (mean or last token): pass --pooling"
        )
    return fields["pooling"], bool(fields["normalize"])


async def embeddings(svc: Service, body: bytes, request_id: str, tenant: str | None) -> bytes:
    from aioprefill.serve.routes import decode_body

    req = decode_body(_embedding, body)
    dims = _dimensions(svc, req.dimensions)
    keep = req.truncate_prompt_tokens
    if keep is not None and (keep == 0 or keep < -1):
        raise InvalidRequest(f"truncate_prompt_tokens must be -1 or positive, got {keep}")
    cut = None if keep is None else ("left", keep)
    ids = await _prompts(svc, req.input, "input", cut, _prompt(svc, req.prompt_name))
    vectors, n = await _run(svc, ids, request_id, tenant, None, dims)
    data = []
    for i, v in enumerate(vectors):
        vector: list[float] | str
        if req.encoding_format == "base64":
            vector = base64.b64encode(v.astype("<f4").tobytes()).decode()
        else:
            vector = v.tolist()
        data.append(Embedding(index=i, embedding=vector))
    usage = EmbeddingUsage(prompt_tokens=n, total_tokens=n)
    model = svc.settings.served_model_name
    out = EmbeddingResponse(
        id=f"embd-{request_id}", created=int(time.time()), model=model, data=data, usage=usage
    )
    return _encode(out)


async def embed(svc: Service, body: bytes, request_id: str, tenant: str | None) -> bytes:
    """TEI's /embed: `[[float, ...], ...]`, one vector per input."""
    from aioprefill.serve.routes import decode_body

    req = decode_body(_embed, body)
    dims = _dimensions(svc, req.dimensions)
    if req.truncation_direction.lower() not in ("left", "right"):
        raise InvalidRequest("truncation_direction must be 'left' or 'right'")
    cut = (req.truncation_direction.lower(), -1) if req.truncate else None
    ids = await _prompts(svc, req.inputs, "inputs", cut, _prompt(svc, req.prompt_name))
    vectors, _ = await _run(svc, ids, request_id, tenant, req.normalize, dims)
    return _encode([v.tolist() for v in vectors])


def _prompt(svc: Service, name: str | None) -> tuple[str, bool] | None:
    """(text put before each text input, whether the request named it), or None."""
    if name is None:
        default = svc.settings.default_prompt
        return None if not default else (default, False)
    prompts = svc.settings.prompts
    if name not in prompts:
        raise InvalidRequest(
            f"prompt_name {name!r} is not one of the model's prompts: {sorted(prompts) or 'none'}"
        )
    return prompts[name], True


def _dimensions(svc: Service, dims: int | None) -> int | None:
    if dims is None:
        return None
    size = svc.embed_size
    if isinstance(dims, bool) or not 1 <= dims <= size:
        raise InvalidRequest(f"dimensions must be in [1, {size}] (the model's size), got {dims}")
    return dims


async def _prompts(
    svc: Service,
    value: Any,
    field: str,
    cut: tuple[str, int] | None,
    prompt: tuple[str, bool] | None = None,
) -> list[list[int]]:
    """Each input's ids (text tokenized, after `prompt`'s text; an encoder's with its special
    tokens and its own truncation), cut per `cut` = (side kept from: "left" keeps the last
    ids, n; -1: the model's limit), each checked (400 naming the field and index)."""
    if value is None:
        raise InvalidRequest(f"{field} is required")
    items = texts(value, field, allow_ids=True)
    if len(items) > svc.settings.max_prompts:
        raise HTTPError(
            413, f"{field} holds {len(items)} inputs, more than {svc.settings.max_prompts}"
        )
    limit = svc.scorer.limit
    out = []
    for i, item in enumerate(items):
        where = field if isinstance(value, str) or len(items) == 1 else f"{field}[{i}]"
        if isinstance(item, str):
            if not item:
                raise InvalidRequest(f"{where} is an empty string")
            ids = await svc.scorer.text_ids(item if prompt is None else prompt[0] + item, where)
        elif prompt is not None and prompt[1]:
            raise InvalidRequest(f"{where}: prompt_name applies to text, not token ids")
        else:
            ids = item
        if cut is not None:
            n = limit if cut[1] == -1 else min(cut[1], limit)
            ids = ids[-n:] if cut[0] == "left" else ids[:n]
        try:
            validate_prompt(ids, svc.vocab_size, limit)
        except InvalidRequest as exc:
            raise type(exc)(f"{where}: {exc}") from None
        out.append(ids)
    return out


async def _run(
    svc: Service,
    prompts: list[list[int]],
    request_id: str,
    tenant: str | None,
    normalize: bool | None,
    dims: int | None,
) -> tuple[list[np.ndarray], int]:
    """The pooled vectors (cut to `dims`) and the prompt tokens they took."""
    from aioprefill.serve.scoring import Pair

    pooling, unit = svc.pooling()
    if normalize is not None:
        unit = normalize
    options = {"embed": pooling, "normalize": unit} | svc.salt_option(tenant, None)
    results = await run_all(svc.engine, [Pair(p) for p in prompts], request_id, options)
    vectors = []
    for r in results:
        assert r.embedding is not None
        v = r.embedding
        if dims is not None and dims < len(v):
            v = v[:dims]
            if unit:  # Matryoshka: the first dims values, back to unit length
                v = (v / np.linalg.norm(v.astype(np.float64))).astype(np.float32)
        vectors.append(v)
    return vectors, sum(len(p) for p in prompts)
