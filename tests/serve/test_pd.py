"""The decode hop end to end, on SmolLM2: vllm-router in `--vllm-pd-disaggregation` mode, in front
of `python -m aioprefill.serve --kv-transfer mooncake` (prefill) and
examples/pd_decode_transformers.py (decode, on transformers in the reference venv,
tests/refvenv.py: created on first use, ~75 s on 2 cores, reused after). For chat and
completions requests sent with the official client through the router, the decode node pulled
the prefill node's KV and generated from it, and the tokens equal transformers' own greedy
`generate` on the whole prompt (the same node asked without `kv_transfer_params`)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import refvenv
from tests.hf.smollm2 import gguf_path
from tests.serve.util import ROOT, free_port, serve
from tests.transfer.util import needs_mooncake

ROUTER = Path(sys.executable).parent / "vllm-router"
NEW_TOKENS = 12

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),  # the reference venv's first creation
    needs_mooncake,
    pytest.mark.skipif(not ROUTER.exists(), reason="needs vllm-router (the test extra)"),
]


def wait_health(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{url} exited:\n{log.read_text(errors='replace')}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not ready:\n{log.read_text(errors='replace')}")


def start(stack: ExitStack, cmd: list[str], env: dict[str, str] | None = None) -> Path:
    log = Path(tempfile.mkstemp(suffix=".log")[1])
    stack.callback(log.unlink)
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    stack.callback(lambda: (proc.kill(), proc.wait()))
    return proc, log


@pytest.fixture(scope="module")
def pd():
    with ExitStack() as stack:
        # The prefill node loads SmolLM2 while the reference venv is checked (or made) and the
        # decode node starts, rather than before them.
        prefill = stack.enter_context(
            serve("--kv-transfer", "mooncake", "--workers", "1", "--served-model-name", "smollm2",
                  ready=False)
        )  # fmt: skip
        python = refvenv.ensure()
        decode_port = free_port()
        decode_url = f"http://127.0.0.1:{decode_port}"
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        example = ROOT / "examples" / "pd_decode_transformers.py"
        proc, log = start(
            stack,
            [str(python), str(example), "--model", str(gguf_path()), "--port", str(decode_port),
             "--served-model-name", "smollm2", "--threads", "1"],
            env,
        )  # fmt: skip
        wait_health(decode_url, proc, log, 300)
        prefill.wait_ready()
        port = free_port()
        router, router_log = start(
            stack,
            [str(ROUTER), "--vllm-pd-disaggregation", "--prefill", prefill.url,
             "--decode", decode_url, "--host", "127.0.0.1", "--port", str(port),
             "--log-level", "warning", "--prometheus-host", "127.0.0.1",
             "--prometheus-port", str(free_port())],
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        wait_health(url, router, router_log, 60)
        yield prefill, decode_url, url


def kv_answers(prefill_url: str, route: str) -> float:
    text = httpx.get(prefill_url + "/metrics").text
    family = next(f for f in text_string_to_metric_families(text)
                  if f.name == "aioprefill_http_responses")  # fmt: skip
    return sum(s.value for s in family.samples
               if s.labels.get("route") == route and s.labels.get("status") == "200")  # fmt: skip


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a poet."},
        {"role": "user", "content": "Write one line about the sea."},
    ],
]
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n"]


def test_chat_through_the_router_equals_transformers_generate(pd):
    prefill, decode_url, url = pd
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
        for messages in CHATS:
            before = kv_answers(prefill.url, "/v1/chat/completions")
            out = client.chat.completions.create(
                model="smollm2", messages=messages, max_tokens=NEW_TOKENS, temperature=0
            )
            assert kv_answers(prefill.url, "/v1/chat/completions") == before + 1
            body = out.model_dump()
            assert body["kv_pulled"] is True  # the decode node read the prefill node's KV
            alone = httpx.post(
                decode_url + "/v1/chat/completions",
                json={"messages": messages, "max_tokens": NEW_TOKENS}, timeout=300,
            ).json()  # fmt: skip
            assert alone["kv_pulled"] is False
            assert body["prompt_token_ids"] == alone["prompt_token_ids"]
            assert body["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
            assert len(alone["choices"][0]["token_ids"]) >= 2
            assert out.choices[0].message.content == alone["choices"][0]["message"]["content"]


def test_completions_through_the_router_equal_transformers_generate(pd):
    prefill, decode_url, url = pd
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
        for prompt in PROMPTS:
            out = client.completions.create(
                model="smollm2", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0
            )
            body = out.model_dump()
            assert body["kv_pulled"] is True
            alone = httpx.post(
                decode_url + "/v1/completions",
                json={"prompt": prompt, "max_tokens": NEW_TOKENS}, timeout=300,
            ).json()  # fmt: skip
            assert body["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
            assert out.choices[0].text == alone["choices"][0]["text"]
    assert kv_answers(prefill.url, "/v1/completions") >= len(PROMPTS)
