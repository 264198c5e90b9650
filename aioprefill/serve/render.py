"""POST /v1/completions/render and /v1/chat/completions/render, shaped as vLLM shapes them: the
token ids a request's prompt becomes on this server, with nothing run.

vllm-router's `kv_aware` policy (and llm-d's scheduler) call them to route a text prompt by the
blocks its ids fill; a 404 makes them fall back to load-only routing. The completions form answers
a list, one entry per prompt; the chat form one entry for its conversation. Each entry is vLLM's
`GenerateRequest`: `request_id` ("cmpl-..." / "chatcmpl-..."), `token_ids`, `model`,
`sampling_params` (the request's sampling fields as sent), `stream`, `stream_options`,
`cache_salt`, `priority`, `kv_transfer_params`, `token_offsets` (each token's character span in
the prompt text, with `return_token_offsets`; else null) and `features` (null: no media).
"""

from __future__ import annotations

from typing import Any

import msgspec

from aioprefill.engine.validate import validate_prompt
from aioprefill.serve.routes import Service, decode_body
from aioprefill.serve.schemas import ChatRequest, CompletionRequest, RenderedPrompt

__all__ = ["render_chat", "render_completions"]

_SAMPLING = (
    "max_tokens", "max_completion_tokens", "min_tokens", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "seed", "stop",
    "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "n",
)  # fmt: skip
_any = msgspec.json.Decoder(dict[str, Any])
_completion = msgspec.json.Decoder(CompletionRequest)
_chat = msgspec.json.Decoder(ChatRequest)


def _common(raw: dict[str, Any], model: str) -> dict[str, Any]:
    return {
        "model": model,
        "sampling_params": {k: raw[k] for k in _SAMPLING if raw.get(k) is not None},
        "stream": bool(raw.get("stream")),
        "stream_options": raw.get("stream_options"),
        "priority": raw.get("priority") if isinstance(raw.get("priority"), int) else 0,
        "kv_transfer_params": raw.get("kv_transfer_params"),
    }


def _parse(decode: Any, body: bytes) -> tuple[Any, dict[str, Any]]:
    return decode_body(decode, body), decode_body(_any, body)


async def render_completions(
    service: Service, body: bytes, request_id: str
) -> list[RenderedPrompt]:
    """One entry per prompt of a completion request (text tokenized, ids checked)."""
    req, raw = _parse(_completion, body)
    offsets = req.return_token_offsets
    prompts = await service.prompts(req.prompt, "prompt", offsets=offsets)
    if len(prompts) == 1:  # a list's prompts were checked; a lone one is left to the engine
        validate_prompt(prompts[0].ids, service.vocab_size, service.max_model_len)
    common = _common(raw, service.settings.served_model_name)
    return [
        RenderedPrompt(
            request_id=f"cmpl-{request_id}-{i}",
            token_ids=p.ids,
            token_offsets=p.offsets if offsets else None,
            cache_salt=req.cache_salt,
            **common,
        )
        for i, p in enumerate(prompts)
    ]


async def render_chat(service: Service, body: bytes, request_id: str) -> RenderedPrompt:
    """The conversation's token ids, as /v1/chat/completions would run them."""
    req, raw = _parse(_chat, body)
    offsets = None
    if req.return_token_offsets:  # spans in the rendered prompt text
        text = service.chat_text(req)
        ids, offsets = service.need_tokenizer().encode_with_offsets(
            text, add_special_tokens=req.add_special_tokens
        )
    else:
        ids = await service.chat_ids(req)
    return RenderedPrompt(
        request_id=f"chatcmpl-{request_id}",
        token_ids=ids,
        token_offsets=offsets,
        cache_salt=req.cache_salt,
        **_common(raw, service.settings.served_model_name),
    )
