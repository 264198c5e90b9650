"""Chat templates: a conversation (OpenAI `messages`) to the prompt text a chat model was trained
on, rendered exactly as transformers' `apply_chat_template` renders it.

The template is the model's own (`tokenizer_config.json`'s `chat_template` or a
`chat_template.jinja` beside it, or a GGUF file's `tokenizer.chat_template`), run by jinja2 in the
environment transformers builds: `ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True)` with the `loopcontrols` extension, its JSON `tojson` filter (no HTML
escaping), `raise_exception`, `strftime_now`, and the restricted `dict` / `namespace` globals. A
template is untrusted code (from a checkpoint, or a request's `chat_template`): the sandbox keeps it
from reaching Python internals, and transformers refuses jinja2 older than 3.1.6, which had
sandbox escapes; so does this module. The messages' keys whose value is None are dropped first,
and the tokenizer's special tokens (`bos_token`, `eos_token`, ...) are variables, as in
transformers. The rendered text is tokenized without adding special tokens (the template writes
them).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

from aioprefill.errors import InvalidRequest
from aioprefill.optional import import_optional

__all__ = ["ChatTemplateError", "render_chat"]

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(InvalidRequest):
    """The template refused the conversation (its `raise_exception`), or could not render it."""


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    special_tokens: dict[str, str] | None = None,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The text `template` renders for `messages` (transformers' `render_jinja_template` for one
    conversation). `continue_final_message` leaves the last message open (its end-of-turn
    markup cut), so the model continues it; it excludes `add_generation_prompt`."""
    if not messages:
        raise InvalidRequest("messages must not be empty")
    if continue_final_message and add_generation_prompt:
        raise InvalidRequest(
            "continue_final_message and add_generation_prompt cannot both be set: continue the "
            "final message, or start a new assistant message"
        )
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    final = ""
    if continue_final_message:
        last = chat[-1] = dict(chat[-1])
        content = last.get("content")
        if not isinstance(content, str):
            raise InvalidRequest("continue_final_message needs a final message with text content")
        final, last["content"] = content, content + _CONTINUE_TAG
    variables = {**(special_tokens or {}), **(template_kwargs or {})}
    try:
        text: str = _compiled(template).render(
            messages=chat,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except InvalidRequest:
        raise
    except Exception as exc:  # the template's raise_exception, a sandbox refusal, a bad template
        raise ChatTemplateError(f"the chat template failed: {exc}") from None
    if continue_final_message:
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise InvalidRequest(
                "continue_final_message: the chat template drops part of the final message"
            )
        at = text.rindex(tag)
        text = (
            text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
        )
    return text


@lru_cache(maxsize=16)
def _compiled(template: str) -> Any:
    jinja2 = import_optional("jinja2", "serve")
    from jinja2 import ext, nodes, utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    major, minor, patch = (int(x) for x in jinja2.__version__.split(".")[:3])
    if (major, minor, patch) < (3, 1, 6):
        raise ChatTemplateError(
            f"chat templates need jinja2 >= 3.1.6 (older versions have sandbox escapes), "
            f"found {jinja2.__version__}"
        )

    class Generation(ext.Extension):
        """transformers' `{% generation %}` block (it marks assistant text): rendered as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_support")
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _support(self, caller: Any) -> str:
            return str(caller())

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check(name)
            utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: object) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template cannot store {name!r} on a namespace"
                )

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template is not valid jinja: {exc}") from None
