"""Two serve processes behind vllm-router (regular mode, round-robin, health checks every
second), driven by the official client through the router: completions and embeddings
answered by both servers in turn; a server killed with SIGKILL leaves the rotation through
its failed /health checks, and the router's clients see no error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest

from aioprefill.workers.sim import expected_token
from tests.serve.util import free_port, gone, serve

ROUTER = Path(sys.executable).parent / "vllm-router"


def router_workers(url: str) -> dict[str, bool]:
    return {w["url"]: w["is_healthy"] for w in httpx.get(url + "/workers").json()["workers"]}


def answered(server_url: str) -> float:
    text = httpx.get(server_url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("aioprefill_http_responses_total{") and 'status="200"' in line
        and "/v1/" in line
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed (test extra)")
def test_two_servers_behind_vllm_router():
    flags = ["--model", "sim", "--served-model-name", "sim"]
    with ExitStack() as stack:
        a = stack.enter_context(serve(*flags))
        b = stack.enter_context(serve(*flags))
        port = free_port()
        log = stack.enter_context(tempfile.TemporaryFile())
        router = subprocess.Popen(
            [str(ROUTER), "--worker-urls", a.url, b.url, "--host", "127.0.0.1",
             "--port", str(port), "--policy", "round_robin",
             "--health-check-interval-secs", "1", "--log-level", "warning",
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        stack.callback(lambda: (router.kill(), router.wait()))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if router.poll() is not None:
                log.seek(0)
                raise AssertionError(f"vllm-router exited: {log.read().decode(errors='replace')}")
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        client = stack.enter_context(
            openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        )
        for i in range(10):
            prompt = [i + 1, 2, 3]
            out = client.completions.create(model="sim", prompt=prompt, max_tokens=1, logprobs=0)
            assert out.choices[0].logprobs.tokens == [f"token_id:{expected_token(prompt)}"]
            emb = client.embeddings.create(model="sim", input=prompt)
            assert len(emb.data) == 1 and len(emb.data[0].embedding) > 0
        assert answered(a.url) == answered(b.url) == 10  # round-robin, 20 requests

        pids = [w["pid"] for w in httpx.get(a.url + "/health").json()["workers"]]
        os.kill(a.proc.pid, signal.SIGKILL)
        a.proc.wait()
        assert gone(pids), "the killed server's workers outlived it"
        for i in range(20):  # the router retries the dead server's share on the live one
            out = client.completions.create(model="sim", prompt=[i + 7], max_tokens=1)
            assert len(out.choices) == 1
        deadline = time.monotonic() + 30
        while router_workers(url)[a.url] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert router_workers(url) == {a.url: False, b.url: True}
