"""The server's process life on each HTTP front (uvicorn, granian): SIGTERM with requests in
flight answers every one of them, then exits leaving no worker process and no /dev/shm segment;
a client that disconnects has its request cancelled inside the engine."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from aioprefill.workers.sim import expected_token
from tests.serve.util import gone, segments_of, serve

pytestmark = pytest.mark.parametrize("front", ["uvicorn", "granian", "granian-rsgi"])


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()))
            out[key] = s.value
    return out


def until(url: str, check, what: str, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = scrape(url)
        if check(m):
            return m
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}: {m}")


def test_sigterm_answers_every_request_in_flight_and_leaves_nothing(front):
    # 1.5 s forwards: every request is still in flight when SIGTERM lands.
    flags = ["--model", "sim", "--sim-fixed-ms", "1500", "--server", front]
    with serve(*flags) as server:
        health = httpx.get(server.url + "/health").json()
        pids = [w["pid"] for w in health["workers"]]
        prompts = [[i, 1, 2] for i in range(100)]

        async def clients() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=200)
            async with httpx.AsyncClient(timeout=60, limits=limits) as c:
                jobs = [
                    asyncio.ensure_future(
                        c.post(server.url + "/v1/completions", json={"prompt": p})
                    )
                    for p in prompts
                ]
                await asyncio.to_thread(
                    until,
                    server.url,
                    lambda m: m["aioprefill_requests_submitted_total"] == len(prompts),
                    "every request to reach the engine",
                )
                server.proc.send_signal(signal.SIGTERM)
                return await asyncio.gather(*jobs)

        replies = uvloop.run(clients())
        for p, r in zip(prompts, replies, strict=True):
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(p)
        code = server.proc.wait(60)
        assert code in (0, -signal.SIGTERM), server.output()
        assert "Traceback" not in server.output(), server.output()
        assert gone(pids), f"workers {pids} outlived the server"
        assert not segments_of(server.proc.pid)


def test_disconnect_cancels_the_request(front):
    flags = ["--model", "sim", "--sim-fixed-ms", "1", "--sim-per-token-us", "500",
             "--server", front]  # fmt: skip
    with serve(*flags) as server:
        before = scrape(server.url)

        async def leave() -> None:
            _, writer = await asyncio.open_connection("127.0.0.1", server.port)
            body = b'{"prompt": [%s]}' % b",".join([b"7"] * 3000)  # a 1.5 s forward
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
            await asyncio.to_thread(
                until,
                server.url,
                lambda m: m["aioprefill_requests_in_flight"] == 1,
                "the long request in flight",
            )
            writer.close()

        uvloop.run(leave())
        cancelled = "aioprefill_requests_cancelled_total"
        m = until(server.url, lambda m: m[cancelled] == before[cancelled] + 1, "the cancellation")
        key = "aioprefill_http_responses_total,route=/v1/completions,status=499"
        assert m[key] == 1
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [9, 9], "logprobs": 0})
        assert r.status_code == 200
        assert r.json()["choices"][0]["logprobs"]["tokens"] == [
            f"token_id:{expected_token([9, 9])}"
        ]
