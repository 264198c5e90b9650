"""What each endpoint does, apart from HTTP: `Service` turns a request body into a response
body using the engine and the tokenizer. `app.py` does the HTTP around it (routing, body
limits, disconnects, request ids, statuses).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

import aioprefill
from aioprefill.engine.loop import Engine
from aioprefill.errors import InvalidRequest
from aioprefill.result import PrefillResult
from aioprefill.serve import chat, completions, embed
from aioprefill.serve.auth import cache_salt
from aioprefill.serve.prompts import Prompt, TokenizerLike, parse_prompts
from aioprefill.serve.schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from aioprefill.serve.scoring import Scorer, all_or_none

__all__ = ["ServeSettings", "Service"]


@dataclass(slots=True, kw_only=True)
class ServeSettings:
    """The server's own settings (the engine's are its EngineConfig)."""

    served_model_name: str
    pooling: str | None = None  # how /v1/embeddings pools: None: the model's own, else mean
    normalize: bool | None = None  # L2-normalise embeddings (None: the model's own, else no)
    prompts: dict[str, str] = field(default_factory=dict)  # named prompts (`prompt_name`)
    default_prompt: str | None = None  # put before every text input to the embedding endpoints
    rerank_template: str | None = None  # a decoder's rerank template (or file); scoring.py
    label_tokens: tuple[str, ...] = ("yes", "no")  # its label tokens, the relevant one first
    max_documents: int = 1000  # documents in one rerank / score request; more is a 400
    max_prompts: int = 1024  # prompts in one request; more is a 413 (TEI's batch limit)
    max_body_bytes: int = 16 << 20  # request bodies; larger is a 413
    vllm_pd: Any = None  # VllmPDOptions: --kv-transfer vllm-mooncake (serve/vllm_pd.py)


def _decoder(kind: type) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(kind)


class Service:
    """The endpoints of one server process over one running engine."""

    def __init__(
        self, engine: Engine, tokenizer: TokenizerLike | None, settings: ServeSettings
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self.created = int(time.time())
        config = engine.config
        self.vocab_size = config.model.vocab_size
        self.max_model_len = config.max_prompt_tokens or 0
        self.encode = self._encode = msgspec.json.Encoder().encode
        self._completion = _decoder(CompletionRequest)
        self._chat = _decoder(ChatRequest)
        self._embedding = _decoder(EmbeddingRequest)
        self._tokenize = _decoder(TokenizeRequest)
        self._detokenize = _decoder(DetokenizeRequest)
        # KV transfer (vllm-router's PD mode) only where a transfer engine is configured.
        self.kv_transfer = config.kv_transfer is not None
        self.vllm_pd: Any = None  # VllmPD with --kv-transfer vllm-mooncake (App sets it)
        self.scorer = Scorer(
            engine,
            tokenizer,
            template=settings.rerank_template,
            label_tokens=settings.label_tokens,
            max_documents=settings.max_documents,
        )
        self.embed_size = int(getattr(config.model, "hidden_size", 0) or 16)  # SimModel: 16

    def pooling(self) -> tuple[str, bool]:
        """(embed, normalize) for embeddings: the server's flags, else the model's own (an
        encoder's directory), else mean pooling, not normalised."""
        spec = self.engine.config.model
        pooling = self.settings.pooling or getattr(spec, "pooling", None) or "mean"
        own = bool(getattr(spec, "normalize", False))
        return pooling, own if self.settings.normalize is None else self.settings.normalize

    def salt_option(self, tenant: str | None, body_salt: str | None) -> dict[str, Any]:
        """engine.prefill()'s `cache_salt` for a request: the tenant's and the body's."""
        salt = cache_salt(tenant, body_salt)
        return {"cache_salt": salt} if salt is not None else {}

    # ---- scoring and embeddings -------------------------------------------------------

    async def completions(self, body: bytes, request_id: str, tenant: str | None = None) -> bytes:
        req = decode_body(self._completion, body)
        generate = completions.check_completion(req)
        pd_id = self.vllm_transfer_id(req.kv_transfer_params)
        want_kv = req.kv_transfer_params is not None and self.kv_transfer
        options = completions.prefill_options(req, generate)
        options |= self.salt_option(tenant, req.cache_salt)
        if want_kv or pd_id is not None:
            options["return_kv"] = True
        echo_offsets = req.echo and req.logprobs is not None
        prompts = await self.prompts(req.prompt, "prompt", offsets=echo_offsets)
        if (want_kv or pd_id is not None) and len(prompts) != 1:
            raise InvalidRequest("kv_transfer_params needs exactly one prompt")
        results = await self._run(prompts, options, request_id, pd_id)
        params = _kv_params(results[0]) if want_kv else None
        out = completions.completion_body(
            req,
            generate,
            prompts,
            results,
            self.tokenizer,
            request_id=request_id,
            model=self.settings.served_model_name,
            kv_transfer_params=params,
        )
        return self._encode(out)

    async def chat_completions(
        self, body: bytes, request_id: str, tenant: str | None = None
    ) -> bytes:
        req = decode_body(self._chat, body)
        generate = chat.check_chat(req)
        ids = await self.chat_ids(req)
        options = chat.prefill_options(req, generate) | self.salt_option(tenant, req.cache_salt)
        pd_id = self.vllm_transfer_id(req.kv_transfer_params)
        want_kv = req.kv_transfer_params is not None and self.kv_transfer
        if want_kv or pd_id is not None:
            options["return_kv"] = True
        r = (await self._run([Prompt(ids)], options, request_id, pd_id))[0]
        tokenizer = self.need_tokenizer()
        out = chat.chat_body(
            req,
            generate,
            ids,
            r,
            tokenizer,
            request_id=request_id,
            model=self.settings.served_model_name,
            kv_transfer_params=_kv_params(r) if want_kv else None,
        )
        return self._encode(out)

    async def chat_ids(self, req: Any) -> list[int]:
        """The token ids of a chat request's conversation (`ChatRequest`, or /tokenize's chat
        form), the template's text tokenized without special tokens unless asked."""
        text = self.chat_text(req)
        special = bool(req.add_special_tokens)
        return await self.need_tokenizer().encode_async(text, add_special_tokens=special)

    def chat_text(self, req: Any) -> str:
        """The prompt text of a chat request's conversation."""
        return chat.chat_prompt(
            self.tokenizer,
            req.messages,
            chat_template=req.chat_template,
            template_kwargs=req.chat_template_kwargs,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            documents=getattr(req, "documents", None),
        )

    async def embeddings(self, body: bytes, request_id: str, tenant: str | None = None) -> bytes:
        return await embed.embeddings(self, body, request_id, tenant)

    async def prompts(self, value: Any, field: str, *, offsets: bool = False) -> list[Prompt]:
        return await parse_prompts(
            value,
            self.tokenizer,
            field=field,
            vocab_size=self.vocab_size,
            max_prompt_tokens=self.max_model_len,
            max_prompts=self.settings.max_prompts,
            offsets=offsets,
        )

    def vllm_transfer_id(self, params: dict[str, Any] | None) -> str | None:
        """With --kv-transfer vllm-mooncake, a request's `transfer_id` when it asks for a
        remote decode (vllm-router's `{do_remote_decode: true, transfer_id}`), else None."""
        if self.vllm_pd is None or not params or not params.get("do_remote_decode"):
            return None
        tid = params.get("transfer_id")
        if not isinstance(tid, str) or not 0 < len(tid) <= 256:
            raise InvalidRequest(
                "kv_transfer_params.transfer_id: a string is required with do_remote_decode "
                f"(vLLM's MooncakeConnector); got {tid!r}"
            )
        return tid

    async def _run(
        self,
        prompts: list[Prompt],
        options: dict[str, Any],
        request_id: str,
        pd_id: str | None = None,
    ) -> list[PrefillResult]:
        """Every prompt's engine request, submitted together; if one fails the others are
        cancelled (nothing keeps running for an answer that will not be sent). With `pd_id`
        the one prompt's KV export goes to the vLLM transfer of that id."""
        if pd_id is not None:
            try:
                r = await self.engine.prefill(prompts[0].ids, request_id=request_id, **options)
            except BaseException as exc:
                self.vllm_pd.fail(pd_id, repr(exc))
                raise
            self.vllm_pd.offer(pd_id, r.kv)
            return [r]
        prefill = self.engine.prefill
        if len(prompts) == 1:
            return [await prefill(prompts[0].ids, request_id=request_id, **options)]
        return await all_or_none(
            prefill(p.ids, request_id=f"{request_id}/{i}", **options) for i, p in enumerate(prompts)
        )

    # ---- tokenizer --------------------------------------------------------------------

    async def tokenize(self, body: bytes) -> bytes:
        req = decode_body(self._tokenize, body)
        tok = self.need_tokenizer()
        if req.messages is not None:
            ids = await self.chat_ids(req)
        elif req.prompt is None:
            raise InvalidRequest("prompt or messages is required")
        else:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = tok.encode(req.prompt, add_special_tokens=special)
        strs = tok.token_strings(ids) if req.return_token_strs else msgspec.UNSET
        return self._encode(
            TokenizeResponse(
                count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs
            )
        )

    async def detokenize(self, body: bytes) -> bytes:
        req = decode_body(self._detokenize, body)
        bad = next((t for t in req.tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary ({self.vocab_size})")
        text = self.need_tokenizer().decode(req.tokens) if req.tokens else ""
        return self._encode(DetokenizeResponse(prompt=text))

    def need_tokenizer(self) -> TokenizerLike:
        if self.tokenizer is None:
            raise InvalidRequest("this server has no tokenizer")
        return self.tokenizer

    # ---- state ------------------------------------------------------------------------

    def models(self) -> bytes:
        name = self.settings.served_model_name
        card = ModelCard(id=name, created=self.created, max_model_len=self.max_model_len, root=name)
        return self._encode(ModelList(data=[card]))

    def health(self) -> tuple[int, bytes]:
        """200 while the engine can serve, else 503 (closing, or every worker given up), so
        a router takes this server out of its rotation."""
        h = self.engine.health()
        return (200 if h.is_running else 503), self._encode(h)

    def server_info(self) -> bytes:
        """What this server runs. Deliberately no `model_path` / `tokenizer_path`:
        sglang-router tries to download whatever hub path it finds there."""
        c = self.engine.config
        return self._encode(
            {
                "served_model_name": self.settings.served_model_name,
                "max_model_len": self.max_model_len,
                "vocab_size": self.vocab_size,
                "has_tokenizer": self.tokenizer is not None,
                "pooling": self.pooling()[0],
                "normalize": self.pooling()[1],
                "version": aioprefill.__version__,
                **({"vllm_pd": self.vllm_pd.stats()} if self.vllm_pd is not None else {}),
                "engine": {
                    "num_workers": c.num_workers,
                    "tp_size": c.tp_size,
                    "expert_parallel": c.expert_parallel,
                    "policy": c.policy,
                    "max_batch_tokens": c.max_batch_tokens,
                    "max_batch_size": c.max_batch_size,
                    "max_pending": c.max_pending,
                },
            }
        )


def _kv_params(r: PrefillResult) -> dict[str, Any] | None:
    """The transfer params of a result's KV export (the transfer engine keeps the export)."""
    if r.kv is None:
        return None
    params: dict[str, Any] = r.kv.transfer_params()  # type: ignore[attr-defined,unused-ignore]
    return params


def decode_body(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON ({exc})") from None
