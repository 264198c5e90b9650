"""POST /v1/completions on a prefill engine: scoring (`echo` + `logprobs`, what lm-eval's
`local-completions` sends) and the first token (`max_tokens` 1).

One engine request per prompt, all submitted together so they share batches. `max_tokens` is 0
(prefill only: with `echo`, the prompt's logprobs) or 1 (the greedy next token, with its
top-`logprobs` alternatives); more is a 400, since this server computes no second token.

With `echo` and `logprobs` N > 0 every prompt position after the first gets vLLM's
`top_logprobs`: the N most likely tokens given the tokens before it, plus the prompt token itself
(the engine's `prompt_top_k`); what lm-eval's loglikelihood reads for `is_greedy`. With
`logprobs` 0 a position holds only its own token. `temperature` and the other sampling fields are
ignored (the token is the greedy one).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from aioprefill.errors import InvalidRequest
from aioprefill.result import PrefillResult
from aioprefill.serve.prompts import Prompt, TokenizerLike, token_text
from aioprefill.serve.schemas import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    PromptTokensDetails,
    Usage,
)

__all__ = ["MAX_LOGPROBS", "check_completion", "completion_body", "prefill_options"]

MAX_LOGPROBS = 20  # OpenAI's and vLLM's default cap


def check_completion(req: CompletionRequest) -> int:
    """Refuse what a prefill server cannot do; return the number of generated tokens (0/1)."""
    max_tokens = 1 if req.max_tokens is None else req.max_tokens
    if not 0 <= max_tokens <= 1:
        raise InvalidRequest(
            f"max_tokens must be 0 or 1, got {max_tokens}: this is a prefill server, it "
            "computes the prompt and at most the first generated token"
        )
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {req.logprobs}")
    if req.n != 1:
        raise InvalidRequest(f"n must be 1 on a prefill server (greedy, one token), got {req.n}")
    if req.stream:
        raise InvalidRequest("stream is not supported: the answer is one token, sent at once")
    if req.suffix:
        raise InvalidRequest("suffix is not supported by a prefill server")
    return max_tokens


def prefill_options(req: CompletionRequest, generate: int) -> dict[str, Any]:
    """engine.prefill()'s output options for this request."""
    options: dict[str, Any] = {}
    if req.logprobs is not None:
        if req.echo:
            options["prompt_logprobs"] = True
        if req.logprobs > 0 and (generate or req.echo):
            options["top_k"] = req.logprobs
            options["prompt_top_k"] = bool(req.echo)
    return options


def completion_body(
    req: CompletionRequest,
    generate: int,
    prompts: list[Prompt],
    results: list[PrefillResult],
    tokenizer: TokenizerLike | None,
    *,
    request_id: str,
    model: str,
    kv_transfer_params: dict[str, Any] | None = None,
) -> Completion:
    choices = [
        _choice(i, req, generate, p, r, tokenizer)
        for i, (p, r) in enumerate(zip(prompts, results, strict=True))
    ]
    prompt_tokens = sum(len(p.ids) for p in prompts)
    completion_tokens = generate * len(prompts)
    # with a prefix cache: the prompt tokens it served
    counts = [c for r in results if (c := getattr(r, "cached_tokens", None)) is not None]
    details = (
        PromptTokensDetails(cached_tokens=sum(counts)) if len(counts) == len(results) else None
    )
    return Completion(
        id=f"cmpl-{request_id}",
        created=int(time.time()),
        model=model,
        choices=choices,
        usage=Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=details,
        ),
        kv_transfer_params=msgspec.UNSET if kv_transfer_params is None else kv_transfer_params,
    )


def _choice(
    index: int,
    req: CompletionRequest,
    generate: int,
    prompt: Prompt,
    r: PrefillResult,
    tokenizer: TokenizerLike | None,
) -> CompletionChoice:
    prompt_text = ""
    if req.echo:
        prompt_text = prompt.text if prompt.text is not None else _decode(tokenizer, prompt.ids)
    new_text = token_text(tokenizer, r.token) if generate and tokenizer is not None else ""
    logprobs = None
    if req.logprobs is not None:
        logprobs = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        if req.echo:
            _echo_logprobs(logprobs, prompt, r, tokenizer)
        if generate:
            piece = token_text(tokenizer, r.token)
            logprobs.tokens.append(piece)
            logprobs.token_logprobs.append(r.logprob)
            logprobs.top_logprobs.append(_top(r, piece, tokenizer))
            logprobs.text_offset.append(len(prompt_text))
    return CompletionChoice(index=index, text=prompt_text + new_text, logprobs=logprobs)


def _decode(tokenizer: TokenizerLike | None, ids: list[int]) -> str:
    return "" if tokenizer is None else tokenizer.decode(ids)


def _echo_logprobs(
    out: CompletionLogprobs, prompt: Prompt, r: PrefillResult, tokenizer: TokenizerLike | None
) -> None:
    """The prompt's tokens: text, log-probability given the tokens before (None for the
    first), and character offset (the tokenizer's spans for a text prompt, else the running
    length of the decoded pieces)."""
    pieces = [token_text(tokenizer, t) for t in prompt.ids]
    assert r.prompt_logprobs is not None
    scores: list[float] = r.prompt_logprobs.tolist()
    out.tokens.extend(pieces)
    out.token_logprobs.extend([None, *scores][: len(pieces)])
    tops: list[dict[str, float] | None] = [None]
    for i, (piece, lp) in enumerate(zip(pieces[1:], scores, strict=True)):
        top: dict[str, float] = {}
        if r.prompt_top_k_ids is not None and r.prompt_top_k_logprobs is not None:
            ids, k_lps = r.prompt_top_k_ids[i].tolist(), r.prompt_top_k_logprobs[i].tolist()
            for t, k_lp in zip(ids, k_lps, strict=True):
                # the prompt token itself: the same value as in token_logprobs
                top.setdefault(token_text(tokenizer, t), lp if t == prompt.ids[i + 1] else k_lp)
        top.setdefault(piece, lp)
        tops.append(top)
    out.top_logprobs.extend(tops[: len(pieces)])
    if prompt.offsets is not None:
        out.text_offset.extend(start for start, _ in prompt.offsets)
    else:  # without a tokenizer the text is empty: every offset is 0
        at = 0
        for piece in pieces:
            out.text_offset.append(at)
            at += len(piece) if tokenizer is not None else 0


def _top(r: PrefillResult, piece: str, tokenizer: TokenizerLike | None) -> dict[str, float]:
    """The generated token's best alternatives, best first, the token itself always among
    them (OpenAI's shape; two ids that decode to one text keep the better logprob)."""
    top: dict[str, float] = {}
    if r.top_k_ids is not None and r.top_k_logprobs is not None:
        for t, lp in zip(r.top_k_ids.tolist(), r.top_k_logprobs.tolist(), strict=True):
            # the token itself: the same (float64-accurate) value as in token_logprobs
            top.setdefault(token_text(tokenizer, t), r.logprob if t == r.token else lp)
    top.setdefault(piece, r.logprob)
    return top
