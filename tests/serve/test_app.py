"""The ASGI app in this process (httpx's ASGI transport, a real engine with SimModel workers):
the statuses that need an engine in a given state: 429 past max_pending, a worker that dies
with no restart left turns /health to 503 and later requests to 503, never a hang."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from aioprefill import EngineConfig, SimModel
from aioprefill.serve.app import App
from aioprefill.serve.routes import ServeSettings

pytestmark = pytest.mark.asyncio


def app_for(**fields) -> App:
    return App(EngineConfig(**fields), ServeSettings(served_model_name="sim"))


async def test_overloaded_is_429():
    app = app_for(model=SimModel(fixed_ms=300, per_token_us=0), max_pending=1)
    async with app.running():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            replies = await asyncio.gather(
                *(c.post("/v1/completions", json={"prompt": [i + 1]}) for i in range(6))
            )
    statuses = sorted(r.status_code for r in replies)
    assert statuses.count(200) >= 2 and 429 in statuses, statuses
    err = next(r for r in replies if r.status_code == 429).json()["error"]
    assert err["type"] == "rate_limit_error" and "max_pending=1" in err["message"]


async def test_a_dead_engine_answers_503_on_health():
    app = app_for(model=SimModel(fixed_ms=1, crash_token=7), max_restarts=0, max_retries=0)
    async with app.running():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            assert (await c.get("/health")).status_code == 200
            r = await c.post("/v1/completions", json={"prompt": [1, 7]})
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            for _ in range(200):  # the engine gives the worker up right after its death
                health = await c.get("/health")
                if health.status_code == 503:
                    break
                await asyncio.sleep(0.01)
            assert health.status_code == 503 and not health.json()["is_running"]
            r = await c.post("/v1/completions", json={"prompt": [1, 2]})
            assert r.status_code == 503, r.text
