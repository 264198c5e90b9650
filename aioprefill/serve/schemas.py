"""The request and response bodies of `aioprefill.serve`, as msgspec Structs, with the field
names their owners use: OpenAI's chat and legacy completions and embeddings, vLLM's /tokenize,
/detokenize and render endpoints.

Requests tolerate unknown fields (msgspec ignores them): routers and clients add their own
(vllm-router injects `no_stop_trim`, `ignore_eos`, `skip_special_tokens`,
`return_hidden_states`, `stream` into every completion body). Fields a prefill server cannot
honour are declared so that they can be refused with a message (`n`, `stream`, `suffix`,
`max_tokens` > 1) rather than silently ignored. A prompt is `str | list`: msgspec allows one
array type per union, so `prompts.py` tells a list of ids from a list of strings or of lists.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = [
    "ChatChoice",
    "ChatCompletion",
    "ChatLogprob",
    "ChatLogprobs",
    "ChatMessage",
    "ChatRequest",
    "ChatTopLogprob",
    "Completion",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "Embedding",
    "EmbeddingRequest",
    "EmbeddingResponse",
    "EmbeddingUsage",
    "ErrorBody",
    "ErrorInfo",
    "ModelCard",
    "ModelList",
    "PromptTokensDetails",
    "RenderedPrompt",
    "TokenizeRequest",
    "TokenizeResponse",
    "Usage",
]

# ---- requests ----------------------------------------------------------------------------


class CompletionRequest(msgspec.Struct, kw_only=True):
    """POST /v1/completions. `max_tokens` None counts as 1: a prefill server computes the
    first token only (OpenAI's default of 16 would make every plain request an error)."""

    prompt: str | list[Any]
    model: str | None = None
    max_tokens: int | None = None
    echo: bool = False
    logprobs: int | None = None
    n: int = 1
    stream: bool | None = False
    suffix: str | None = None
    # vllm-router's PD mode: present -> the answer carries the KV export's transfer params.
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None  # vLLM's: requests with different salts share no cached block
    return_token_offsets: bool = False  # /v1/completions/render only


class ChatRequest(msgspec.Struct, kw_only=True):
    """POST /v1/chat/completions (and /v1/chat/completions/render), with vLLM's extra fields
    (`chat_template`, `chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`,
    `add_special_tokens`, `cache_salt`, `kv_transfer_params`). `max_tokens` /
    `max_completion_tokens` None count as 1, as for completions."""

    messages: list[dict[str, Any]]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    n: int = 1
    stream: bool | None = False
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None
    return_token_ids: bool = False  # vLLM's: the prompt's and the answer's token ids
    return_token_offsets: bool = False  # /v1/chat/completions/render only


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """POST /v1/embeddings."""

    input: str | list[Any]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the last N ids (-1: the limit)
    prompt_name: str | None = None  # TEI's: one of the model's named prompts before each text


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /tokenize: vLLM's completion form (`prompt`) or chat form (`messages`, rendered with
    the chat template; there `add_special_tokens` defaults to False, as in vLLM)."""

    prompt: str | None = None
    model: str | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    messages: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /detokenize."""

    tokens: list[int]
    model: str | None = None


# ---- responses ---------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int  # prompt tokens read from the prefix cache, not computed


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # completions and chat


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """Per returned token (the echoed prompt's, then the generated one): its text, its
    log-probability (None for the first prompt token, which nothing predicts), the best
    alternatives, and the character offset of its text in `text`."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str = "length"
    stop_reason: None = None


class Completion(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    object: str = "text_completion"
    # Only with `kv_transfer_params` in the request and a transfer engine configured.
    kv_transfer_params: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET


class ChatTopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprob(msgspec.Struct, kw_only=True):
    """One generated token in OpenAI's chat shape: its text, logprob, UTF-8 bytes and the best
    alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatLogprob] | None
    refusal: None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | None
    refusal: None = None
    tool_calls: list[Any] = msgspec.field(default_factory=list)


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: str = "length"
    stop_reason: None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET  # with return_token_ids


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    kv_transfer_params: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET


class RenderedPrompt(msgspec.Struct, kw_only=True):
    """What vLLM's render endpoints answer for one prompt (their `GenerateRequest`: the token
    ids a token-in server takes, with the request's settings carried along)."""

    request_id: str
    token_ids: list[int]
    model: str
    sampling_params: dict[str, Any]
    stream: bool = False
    stream_options: Any = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    token_offsets: list[tuple[int, int]] | None = None
    features: None = None


class Embedding(msgspec.Struct, kw_only=True):
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage
    object: str = "list"


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | msgspec.UnsetType = msgspec.UNSET


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "aioprefill"
    root: str | None = None
    parent: None = None


class ModelList(msgspec.Struct, kw_only=True):
    data: list[ModelCard]
    object: str = "list"


class ErrorInfo(msgspec.Struct, kw_only=True):
    message: str
    type: str
    code: int
    param: str | None = None


class ErrorBody(msgspec.Struct, kw_only=True):
    """OpenAI's error object: `{"error": {"message", "type", "code", "param"}}`."""

    error: ErrorInfo
