"""POST /v1/chat/completions on a prefill engine: the conversation rendered with the model's chat
template (`aioprefill.text.chat_template`, as transformers' `apply_chat_template` renders
it), then one engine request, answered in OpenAI's chat shape.

`max_tokens` / `max_completion_tokens` is 0 (prefill only) or 1 (the greedy first token); more is
a 400, as for completions. `logprobs` + `top_logprobs` (<= 20) give the token's logprob, its
UTF-8 bytes and its best alternatives (`choices[].logprobs.content[]`). Tools, functions, images
or audio and `stream` are 400s that say so. The request fields vLLM adds are taken as vLLM takes
them: `chat_template` (a template for this request), `chat_template_kwargs` (variables),
`add_generation_prompt` (default True), `continue_final_message`, `add_special_tokens` (default
False: the template writes them), `cache_salt`, `kv_transfer_params`.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from aioprefill.errors import InvalidRequest
from aioprefill.result import PrefillResult
from aioprefill.serve.completions import MAX_LOGPROBS
from aioprefill.serve.prompts import TokenizerLike
from aioprefill.serve.schemas import (
    ChatChoice,
    ChatCompletion,
    ChatLogprob,
    ChatLogprobs,
    ChatMessage,
    ChatRequest,
    ChatTopLogprob,
    PromptTokensDetails,
    Usage,
)
from aioprefill.text.chat_template import render_chat

__all__ = ["chat_body", "chat_prompt", "check_chat", "plain_messages", "prefill_options"]

_MEDIA = {"image_url", "input_image", "image", "input_audio", "audio_url", "video_url", "file"}


def check_chat(req: ChatRequest) -> int:
    """Refuse what a prefill server cannot do; return the number of generated tokens (0/1)."""
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    generate = 1 if limit is None else limit
    if not 0 <= generate <= 1:
        raise InvalidRequest(
            f"max_tokens / max_completion_tokens must be 0 or 1, got {generate}: this is a "
            "prefill server, it computes the prompt and at most the first generated token"
        )
    if req.n != 1:
        raise InvalidRequest(f"n must be 1 on a prefill server (greedy, one token), got {req.n}")
    if req.stream:
        raise InvalidRequest("stream is not supported: the answer is one token, sent at once")
    if req.tools or req.functions or req.tool_choice not in (None, "none"):
        raise InvalidRequest("tools and functions are not supported by this server")
    top = req.top_logprobs
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {top}")
    if top and not req.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true")
    return generate


def plain_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as a text-only template reads them: each `content` a string (a list of text
    parts joined with newlines, as vLLM does for such templates). Tool calls, tool results and
    media are refused by name."""
    out = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str):
            raise InvalidRequest(f"messages[{i}].role must be a string, got {role!r}")
        if (
            role in ("tool", "function")
            or message.get("tool_calls")
            or message.get("function_call")
        ):
            raise InvalidRequest(f"messages[{i}]: tool calls and results are not supported")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in _MEDIA:
                    raise InvalidRequest(
                        f"messages[{i}].content[{j}]: {kind} is not supported: this server "
                        "serves a text-only model"
                    )
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequest(f"messages[{i}].content[{j}] must be a text part")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string or a list of parts")
        out.append({**message, "content": content})
    return out


def chat_prompt(
    tokenizer: TokenizerLike | None,
    messages: list[dict[str, Any]],
    *,
    chat_template: str | None,
    template_kwargs: dict[str, Any] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    documents: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text of a conversation: the request's template, else the model's; a model
    with neither is a 400 that says what to do."""
    if tokenizer is None:
        raise InvalidRequest("this server has no tokenizer: chat needs one (start it with one)")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequest(
            "this model has no chat template: send one in the request's `chat_template`, or "
            "use /v1/completions with the prompt as text"
        )
    return render_chat(
        template,
        plain_messages(messages),
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        special_tokens=getattr(tokenizer, "special_tokens", None),
        documents=documents,
        template_kwargs=template_kwargs,
    )


def prefill_options(req: ChatRequest, generate: int) -> dict[str, Any]:
    """engine.prefill()'s output options for this request."""
    if generate and req.logprobs and req.top_logprobs:
        return {"top_k": req.top_logprobs}
    return {}


def chat_body(
    req: ChatRequest,
    generate: int,
    ids: list[int],
    r: PrefillResult,
    tokenizer: TokenizerLike,
    *,
    request_id: str,
    model: str,
    kv_transfer_params: dict[str, Any] | None = None,
) -> ChatCompletion:
    eos = getattr(tokenizer, "eos_token_id", None)
    content, logprobs, finish = "", None, "length"
    if generate:
        content = tokenizer.decode([r.token], skip_special_tokens=True)
        finish = "stop" if r.token == eos else "length"
        if req.logprobs:
            logprobs = ChatLogprobs(content=[_logprob(r, tokenizer)])
    usage = Usage(
        prompt_tokens=len(ids),
        completion_tokens=generate,
        total_tokens=len(ids) + generate,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=r.cached_tokens),
    )
    return ChatCompletion(
        id=f"chatcmpl-{request_id}",
        created=int(time.time()),
        model=model,
        choices=[
            ChatChoice(
                index=0,
                message=ChatMessage(role="assistant", content=content),
                logprobs=logprobs,
                finish_reason=finish,
                token_ids=[r.token][:generate] if req.return_token_ids else msgspec.UNSET,
            )
        ],
        usage=usage,
        prompt_token_ids=ids if req.return_token_ids else msgspec.UNSET,
        kv_transfer_params=msgspec.UNSET if kv_transfer_params is None else kv_transfer_params,
    )


def _entry(tokenizer: TokenizerLike, token: int) -> tuple[str, list[int]]:
    text = tokenizer.decode([token])
    return text, list(text.encode("utf-8"))


def _logprob(r: PrefillResult, tokenizer: TokenizerLike) -> ChatLogprob:
    """The generated token and its best alternatives, best first (the token's own value is the
    float64-accurate one of `logprob`, wherever it ranks)."""
    text, raw = _entry(tokenizer, r.token)
    top = []
    if r.top_k_ids is not None and r.top_k_logprobs is not None:
        for t, lp in zip(r.top_k_ids.tolist(), r.top_k_logprobs.tolist(), strict=True):
            t_text, t_raw = _entry(tokenizer, t)
            value = r.logprob if t == r.token else lp
            top.append(ChatTopLogprob(token=t_text, logprob=value, bytes=t_raw))
    return ChatLogprob(token=text, logprob=r.logprob, bytes=raw, top_logprobs=top)
