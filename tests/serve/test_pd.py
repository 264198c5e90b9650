"""The decode hop end to end, on SmolLM2: vllm-router in `--vllm-pd-disaggregation` mode, in front
of `python -m aioprefill.serve --kv-transfer mooncake` (prefill) and a decode node, a process of
its own that pulls the prefill node's KV through Mooncake and generates greedily from it. For
chat and completions requests sent with the official client through the router, the decode
node pulled the KV, and the prompt's token ids, the new tokens and their text equal
transformers' own greedy `generate` on the whole prompt (tests/data/smollm2/pd_generate.json,
made by benchmarks/tools/make_pd_goldens.py in the reference venv).

Two decode nodes, one fixture each:
- `reference`: tests/serve/pd_decode_reference.py, the float64 NumPy reference model
  (tests/model/reference.py) in the project's venv. Always runs: the test run installs no torch
  and no transformers.
- `transformers`: examples/pd_decode_transformers.py, the user-facing example, on torch and
  transformers in the reference venv (tests/refvenv.py). Runs only where that venv is already
  made (`python3 tests/refvenv.py`); skipped otherwise, never created here."""

from __future__ import annotations

import json
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
GOLDEN = json.loads((ROOT / "tests" / "data" / "smollm2" / "pd_generate.json").read_text())
NEW_TOKENS = GOLDEN["meta"]["max_tokens"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
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


def decode_command(kind: str, port: int) -> list[str]:
    common = ["--model", str(gguf_path()), "--port", str(port), "--served-model-name", "smollm2"]
    if kind == "reference":
        return [sys.executable, "-m", "tests.serve.pd_decode_reference", *common]
    python = refvenv.made()
    if python is None:
        pytest.skip(
            "examples/pd_decode_transformers.py needs torch and transformers: the reference venv "
            "(`python3 tests/refvenv.py`), which the test run never makes, is not made"
        )
    example = ROOT / "examples" / "pd_decode_transformers.py"
    return [str(python), str(example), *common, "--threads", "1"]


@pytest.fixture(scope="module", params=["reference", "transformers"])
def pd(request):
    with ExitStack() as stack:
        decode_port = free_port()
        decode_url = f"http://127.0.0.1:{decode_port}"
        cmd = decode_command(request.param, decode_port)
        # The prefill node loads SmolLM2 while the decode node starts, rather than before it.
        prefill = stack.enter_context(
            serve("--kv-transfer", "mooncake", "--workers", "1", "--served-model-name", "smollm2",
                  ready=False)
        )  # fmt: skip
        # one BLAS thread: the reference node's float64 steps, beside the prefill node
        env = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1")
        proc, log = start(stack, cmd, env)
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
        yield prefill, url


def kv_answers(prefill_url: str, route: str) -> float:
    text = httpx.get(prefill_url + "/metrics").text
    family = next(f for f in text_string_to_metric_families(text)
                  if f.name == "aioprefill_http_responses")  # fmt: skip
    return sum(s.value for s in family.samples
               if s.labels.get("route") == route and s.labels.get("status") == "200")  # fmt: skip


def test_chat_through_the_router_equals_transformers_generate(pd):
    prefill, url = pd
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
        for want in GOLDEN["chat"]:
            before = kv_answers(prefill.url, "/v1/chat/completions")
            out = client.chat.completions.create(
                model="smollm2", messages=want["messages"], max_tokens=NEW_TOKENS, temperature=0
            )
            assert kv_answers(prefill.url, "/v1/chat/completions") == before + 1
            body = out.model_dump()
            assert body["kv_pulled"] is True  # the decode node read the prefill node's KV
            assert body["prompt_token_ids"] == want["prompt_token_ids"]
            assert body["choices"][0]["token_ids"] == want["token_ids"]
            assert len(want["token_ids"]) >= 2
            assert out.choices[0].message.content == want["text"]


def test_completions_through_the_router_equal_transformers_generate(pd):
    prefill, url = pd
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
        for want in GOLDEN["completions"]:
            before = kv_answers(prefill.url, "/v1/completions")
            out = client.completions.create(
                model="smollm2", prompt=want["prompt"], max_tokens=NEW_TOKENS, temperature=0
            )
            assert kv_answers(prefill.url, "/v1/completions") == before + 1
            body = out.model_dump()
            assert body["kv_pulled"] is True
            assert body["prompt_token_ids"] == want["prompt_token_ids"]
            assert body["choices"][0]["token_ids"] == want["token_ids"]
            assert out.choices[0].text == want["text"]
