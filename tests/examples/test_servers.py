"""The example servers as real processes on 127.0.0.1, driven over HTTP by a real client.

Each example (aiohttp, Starlette+uvicorn, bare ASGI+uvicorn) is started with
`python examples/<name>_server.py` and a SimModel engine (CI stays fast), then: a few hundred
concurrent requests each get their own result; bad bodies get 400 with the library's own
message; a client that disconnects mid-flight has its request cancelled inside the engine;
SIGTERM with requests in flight answers all of them and leaves no worker process and no
/dev/shm entry.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aioprefill import InvalidRequest
from aioprefill.engine.validate import validate_prompt
from aioprefill.text.resolve import no_tokenizer
from aioprefill.workers.sim import expected_token

pytestmark = [
    pytest.mark.asyncio,
    pytest.mark.parametrize("example", ["aiohttp", "starlette", "asgi"]),
]

ROOT = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")
VOCAB = 32000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def run_example(example: str, *flags: str) -> Iterator[Server]:
    port = free_port()
    with tempfile.NamedTemporaryFile("w+b", suffix=".log", delete=False) as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "examples" / f"{example}_server.py"),
                "--port",
                str(port),
                *flags,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
    server = Server(proc, port, Path(log.name))
    try:
        yield server
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.unlink(log.name)


async def wait_ready(client: httpx.AsyncClient, server: Server) -> dict:
    for _ in range(600):
        assert server.proc.poll() is None, server.output()
        try:
            r = await client.get(server.url + "/health")
            if r.status_code == 200:
                return r.json()
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.1)  # start-up only: never on a measured path
    raise AssertionError("server did not become ready:\n" + server.output())


async def scrape(client: httpx.AsyncClient, server: Server) -> dict[str, float]:
    r = await client.get(server.url + "/metrics")
    assert r.status_code == 200
    return {
        s.name: s.value
        for f in text_string_to_metric_families(r.text)
        for s in f.samples
        if not s.labels
    }


async def until(client: httpx.AsyncClient, server: Server, check, what: str) -> dict:
    for _ in range(300):
        m = await scrape(client, server)
        if check(m):
            return m
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}: {m}")


def library_message(tokens) -> str:
    if isinstance(tokens, str):  # a text prompt, and the example's engine has no tokenizer
        return str(no_tokenizer())
    with pytest.raises(InvalidRequest) as info:
        validate_prompt(tokens, VOCAB, 4000)
    return str(info.value)


async def test_load_bad_bodies_and_disconnect(example):
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    # 500 us a token: the 3000-token request below stays in flight 1.5 s, long enough for the
    # disconnect and the deadline checks to land inside it on a loaded 2-core CI machine.
    flags = ("--sim-fixed-ms", "5", "--sim-per-token-us", "500", "--max-prompt-tokens", "4000")
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
    with run_example(example, *flags) as server:
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            await wait_ready(client, server)
            # A few hundred concurrent requests, each answered with its own prompt's token.
            prompts = [
                [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 24))] for _ in range(300)
            ]
            replies = await asyncio.gather(
                *(client.post(server.url + "/prefill", json={"tokens": p}) for p in prompts)
            )
            for p, r in zip(prompts, replies, strict=True):
                assert r.status_code == 200, r.text
                assert r.json()["token"] == expected_token(p)
            assert len({r.json()["batch_size"] for r in replies}) > 1  # they were batched

            # Bad bodies: 400, and for bad prompts the library's own message.
            for tokens in (
                [1, True],
                [1, None],
                [-1, 2**63],
                [],
                [1.5],
                [[1, 2]],
                [5] * 4001,
                "abc",
                [VOCAB],
            ):
                r = await client.post(server.url + "/prefill", json={"tokens": tokens})
                assert r.status_code == 400, (tokens, r.text)
                assert r.json() == {"error": library_message(tokens)}
            for body in (b"{not json", b'{"no_tokens": 1}', b"[1, 2]", b""):
                r = await client.post(server.url + "/prefill", content=body)
                assert r.status_code == 400 and r.json()["error"], (body, r.text)

            # A client that disconnects mid-flight: its request is cancelled in the engine.
            before = await scrape(client, server)
            _, writer = await asyncio.open_connection("127.0.0.1", server.port)
            body = b'{"tokens": [%s]}' % b",".join([b"7"] * 3000)  # a 1.5 s forward
            writer.write(
                b"POST /prefill HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
            await until(
                client,
                server,
                lambda m: m["aioprefill_requests_in_flight"] == 1,
                "the long request in flight",
            )
            writer.close()
            m = await until(
                client,
                server,
                lambda m: (
                    m["aioprefill_requests_cancelled_total"]
                    == before["aioprefill_requests_cancelled_total"] + 1
                ),
                "the disconnected request to be cancelled",
            )
            assert (
                m["aioprefill_requests_completed_total"]
                == before["aioprefill_requests_completed_total"]
            )
            r = await client.post(server.url + "/prefill", json={"tokens": [9, 9]})
            assert r.status_code == 200 and r.json()["token"] == expected_token([9, 9])

            # Per-request controls: a bad deadline_s is a 400; one that passes while the worker
            # is busy is a 504 naming the X-Request-Id.
            r = await client.post(server.url + "/prefill", json={"tokens": [1], "deadline_s": -1})
            assert r.status_code == 400 and "deadline_s must be" in r.json()["error"]
            # Other tokens than the cancelled request's: its blocks were cached by its forward,
            # so [7] * 3000 would now be a prefix-cache hit, in flight for a moment only.
            long = asyncio.ensure_future(
                client.post(server.url + "/prefill", json={"tokens": [8] * 3000})
            )
            await until(
                client,
                server,
                lambda m: m["aioprefill_requests_in_flight"] == 1,
                "the long request in flight",
            )
            r = await client.post(
                server.url + "/prefill",
                json={"tokens": [1], "deadline_s": 0.01},
                headers={"X-Request-Id": "abc-1"},
            )
            assert r.status_code == 504, r.text
            assert r.json()["error"].startswith("request 'abc-1': not dispatched within")
            assert (await long).status_code == 200
            assert server.proc.poll() is None, server.output()


async def test_sigterm_answers_every_request_in_flight_and_leaves_nothing(example):
    # 2 s forwards: the probe below must still see work in flight after the last of 200
    # requests has arrived, even when a loaded machine makes it late by a second.
    flags = ("--sim-fixed-ms", "2000", "--sim-per-token-us", "0")
    limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
    with run_example(example, *flags) as server:
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            health = await wait_ready(client, server)
            assert health["is_running"] and health["state"] == "running"
            worker_pids = [w["pid"] for w in health["workers"]]
            assert [w["state"] for w in health["workers"]] == ["ready"] and worker_pids[0] > 0
            prompts = [[i % VOCAB, 1, 2] for i in range(200)]
            replies = [
                asyncio.ensure_future(client.post(server.url + "/prefill", json={"tokens": p}))
                for p in prompts
            ]
            async with httpx.AsyncClient(timeout=60) as probe:
                m = await until(
                    probe,
                    server,
                    lambda m: m["aioprefill_requests_submitted_total"] == 200,
                    "every request to reach the engine",
                )
            assert m["aioprefill_requests_in_flight"] > 0
            server.proc.send_signal(signal.SIGTERM)
            done = await asyncio.gather(*replies)
            for p, r in zip(prompts, done, strict=True):
                assert r.status_code == 200, r.text
                assert r.json()["token"] == expected_token(p)
        code = await asyncio.to_thread(server.proc.wait, 60)
        # aiohttp exits 0; uvicorn re-raises the signal it caught once it shut down cleanly.
        assert code in (0, -signal.SIGTERM), server.output()
        assert "Traceback" not in server.output(), server.output()
        for pid in worker_pids:
            for _ in range(100):
                if not Path(f"/proc/{pid}").exists():
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"worker {pid} outlived the server")
        assert not list(SHM.glob(f"aioprefill-{server.proc.pid}-*"))
