"""aioprefill behind Starlette, served by uvicorn (httptools parser, uvloop).

    python examples/starlette_server.py --port 8000 [--model sim|paddle] [--workers 2]
    curl -s localhost:8000/prefill -d '{"tokens": [1, 2, 3]}'

- The engine lives in the app's `lifespan`: started on uvicorn's event loop before the first
  request, closed (draining accepted requests) after uvicorn's graceful shutdown.
- POST /prefill {"tokens": [...]} -> {"token", "logprob", ...}; a bad prompt -> 400 with the
  library's message; overloaded or closing -> 503.
- GET /health -> 200 while the engine can serve, else 503; GET /metrics -> Prometheus text.
- Client disconnect: ASGI servers do not cancel a handler when its client goes away, so the
  handler awaits the prefill and the next ASGI `receive()` (which returns `http.disconnect`)
  together and cancels the prefill if the client left first.
- SIGTERM/SIGINT: uvicorn stops accepting, waits for in-flight requests, then runs the lifespan's
  shutdown, which closes the engine; no worker process or shared-memory segment is left.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from serving import (
    codec,
    engine_config,
    error_status,
    health_body,
    options_from,
    parse_args,
    profiled,
    result_body,
    tokens_from,
)
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from aioprefill import AioprefillError, Engine, PrefillResult, metrics


async def prefill_unless_disconnected(
    engine: Engine, request: Request, tokens: Any, options: dict[str, Any]
) -> PrefillResult | None:
    """The prefill's result, or None (prefill cancelled) if the client disconnected first."""
    job = asyncio.ensure_future(engine.prefill(tokens, **options))
    gone = asyncio.ensure_future(request.receive())  # the body was read: next is disconnect
    try:
        await asyncio.wait((job, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (job, gone):
            if not task.done():
                task.cancel()
    if not job.done() or job.cancelled():
        with contextlib.suppress(asyncio.CancelledError, AioprefillError):
            await job
        return None
    return job.result()


def create_app(args: argparse.Namespace) -> Starlette:
    loads, dumps = codec(args.json)
    config = engine_config(args)
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        with profiled(args.profile):
            async with Engine(config) as engine:
                state["engine"] = engine
                state["registry"] = metrics.registry_for(engine)
                yield

    def json_response(obj: object, status: int = 200) -> Response:
        return Response(dumps(obj), status_code=status, media_type="application/json")

    async def prefill(request: Request) -> Response:
        engine: Engine = state["engine"]
        try:
            try:
                body = loads(await request.body())
            except ValueError as exc:  # every codec's decode error is a ValueError
                return json_response({"error": f"invalid JSON ({exc})"}, 400)
            tokens = tokens_from(body)
            options = options_from(body, request.headers.get("x-request-id"))
            result = await prefill_unless_disconnected(engine, request, tokens, options)
        except AioprefillError as exc:
            return json_response({"error": str(exc)}, error_status(exc))
        if result is None:
            return Response(status_code=499)  # nobody is listening; nginx's "client closed"
        return json_response(result_body(result))

    async def health(request: Request) -> Response:
        engine: Engine = state["engine"]
        h = engine.health()  # each worker's state; is_running: False once it cannot serve
        return json_response(health_body(h), 200 if h.is_running else 503)

    async def metrics_endpoint(request: Request) -> Response:
        body, content_type = metrics.render(state["registry"])
        return Response(body, headers={"Content-Type": content_type})

    routes = [
        Route("/prefill", prefill, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


if __name__ == "__main__":  # workers re-import this module: the guard keeps them from serving
    args = parse_args(__doc__.splitlines()[0])
    uvicorn.run(
        create_app(args),
        host=args.host,
        port=args.port,
        loop="uvloop",
        http=args.http,
        lifespan="on",
        access_log=False,
        log_level="warning",
    )
