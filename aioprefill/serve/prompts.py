"""A request's `prompt` / `input` as token-id prompts: the four shapes OpenAI accepts (a
string, a list of strings, a list of ids, a list of lists of ids), tokenized, each checked
before any of them is queued.

Every prompt of a list is validated up front (`validate_prompt`, the engine's own check), so a
bad fifth prompt refuses the request before the first four have run; a lone prompt is left to
the engine, which runs the same check before queueing it. Long texts are
tokenized off the event loop (`encode_async`), so one huge prompt does not stall the other
clients' requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from aioprefill.engine.validate import validate_prompt
from aioprefill.errors import InvalidRequest
from aioprefill.serve.errors import HTTPError

__all__ = ["Prompt", "TokenizerLike", "parse_prompts", "token_text"]


class TokenizerLike(Protocol):
    """What the server uses of `aioprefill.text.tokenizer.Tokenizer`."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def encode_with_offsets(
        self, text: str, add_special_tokens: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]: ...
    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...
    def token_strings(self, ids: list[int]) -> list[str]: ...

    @property
    def eos_token_id(self) -> int | None: ...


@dataclass(slots=True)
class Prompt:
    """One prompt: its ids, and its text when it came as text (with each token's character
    offsets when they were asked for)."""

    ids: list[int]
    text: str | None = None
    offsets: list[tuple[int, int]] | None = None


async def parse_prompts(
    value: str | list[Any],
    tokenizer: TokenizerLike | None,
    *,
    field: str,
    vocab_size: int,
    max_prompt_tokens: int,
    max_prompts: int,
    offsets: bool = False,
) -> list[Prompt]:
    """The prompts of `value` (a request's `prompt` or `input`); of a list, each checked as
    the engine would, `InvalidRequest` (400) naming the field and index of the first bad one;
    `HTTPError(413)` refuses more than `max_prompts` at once."""
    single = True
    if isinstance(value, str):
        prompts = [await _from_text(value, tokenizer, field, offsets)]
    elif not value:
        raise InvalidRequest(f"{field} must not be empty")
    elif isinstance(value[0], (int, float)):  # ids (validate_prompt names a bad one)
        prompts = [Prompt(value)]
    else:
        single = False
        if len(value) > max_prompts:
            raise HTTPError(
                413, f"{field} holds {len(value)} prompts, more than this server takes in one "
                f"request ({max_prompts}); split it"
            )  # fmt: skip
        prompts = []
        for i, item in enumerate(value):
            if isinstance(item, str):
                prompts.append(await _from_text(item, tokenizer, f"{field}[{i}]", offsets))
            elif isinstance(item, list):
                prompts.append(Prompt(item))
            else:
                raise InvalidRequest(
                    f"{field}[{i}] must be a string or a list of token ids, got "
                    f"{type(item).__name__} {_short(item)}"
                )
    if single:
        return prompts  # the engine checks it, before anything is queued
    for i, p in enumerate(prompts):
        try:
            validate_prompt(p.ids, vocab_size, max_prompt_tokens)
        except InvalidRequest as exc:
            raise type(exc)(f"{field}[{i}]: {exc}") from None
    return prompts


async def _from_text(
    text: str, tokenizer: TokenizerLike | None, where: str, offsets: bool
) -> Prompt:
    if tokenizer is None:
        raise InvalidRequest(
            f"{where}: this server has no tokenizer (start it with --tokenizer or a checkpoint "
            "that has one): send token ids instead of text"
        )
    if not text:
        raise InvalidRequest(f"{where} is an empty string")
    if offsets:
        ids, spans = tokenizer.encode_with_offsets(text)
        return Prompt(ids, text, spans)
    return Prompt(await tokenizer.encode_async(text), text)  # a long text: off the loop


def _short(x: object) -> str:
    s = repr(x)
    return s if len(s) <= 40 else s[:37] + "..."


def token_text(tokenizer: TokenizerLike | None, token: int) -> str:
    """One token as text: its decoded piece, or `token_id:N` (vLLM's form for
    `--return-tokens-as-token-ids`) on a server without a tokenizer."""
    if tokenizer is None:
        return f"token_id:{token}"
    return tokenizer.decode([token])
