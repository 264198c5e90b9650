"""vllm-router's `kv_aware` policy takes the render endpoints' answers: two servers (SimModel with
SmolLM2's tokenizer, so text prompts tokenize) behind the router with static KV event sources; a
text completion and a chat request sent through the router make it call
`/v1/completions/render` and `/v1/chat/completions/render` on the servers, and its routing
decision counts exactly the token ids the servers gave (its debug log's `input_tokens`)."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from tests.hf.smollm2 import gguf_path
from tests.serve.util import free_port, serve

ROUTER = Path(sys.executable).parent / "vllm-router"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def renders(url: str, route: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f'aioprefill_http_responses_total{{route="{route}",status="200"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.slow
@pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed (test extra)")
def test_kv_aware_routing_counts_the_rendered_ids():
    flags = ["--model", "sim", "--sim-vocab-size", "49152", "--tokenizer", str(gguf_path()),
             "--served-model-name", "smollm2"]  # fmt: skip
    with ExitStack() as stack:
        a = stack.enter_context(serve(*flags))
        b = stack.enter_context(serve(*flags))
        log = stack.enter_context(tempfile.NamedTemporaryFile("w+b", suffix=".log"))
        port = free_port()
        router = subprocess.Popen(
            [str(ROUTER), "--worker-urls", a.url, b.url, "--host", "127.0.0.1",
             "--port", str(port), "--policy", "kv_aware", "--kv-event-model", "smollm2",
             "--kv-event-source", f"{a.url}=tcp://127.0.0.1:{free_port()}",
             "--kv-event-source", f"{b.url}=tcp://127.0.0.1:{free_port()}",
             "--log-level", "debug", "--prometheus-host", "127.0.0.1",
             "--prometheus-port", str(free_port())],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        stack.callback(lambda: (router.kill(), router.wait()))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert router.poll() is None and time.monotonic() < deadline, log.name
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        text = "The quick brown fox jumps over the lazy dog. " * 8
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
        want = [
            len(httpx.post(a.url + "/tokenize", json={"prompt": text}).json()["tokens"]),
            len(httpx.post(a.url + "/tokenize", json={"messages": messages}).json()["tokens"]),
        ]
        assert want[0] != want[1]
        done = httpx.post(url + "/v1/completions",
                          json={"model": "smollm2", "prompt": text, "max_tokens": 1})  # fmt: skip
        assert done.status_code == 200, done.text
        chat = {"model": "smollm2", "messages": messages, "max_tokens": 1}
        done = httpx.post(url + "/v1/chat/completions", json=chat)
        assert done.status_code == 200, done.text
        for route in ("/v1/completions/render", "/v1/chat/completions/render"):
            assert renders(a.url, route) + renders(b.url, route) >= 1, route
        lines = ANSI.sub("", Path(log.name).read_text(errors="replace")).splitlines()
        found = [re.search(r"input_tokens=(\d+)", line) for line in lines
                 if "KV prefix decision" in line]  # fmt: skip
        counted = [int(m.group(1)) for m in found if m]
        assert counted == want, "\n".join(lines[-40:])
