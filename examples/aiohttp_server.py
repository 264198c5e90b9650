"""aioprefill behind a minimal aiohttp server.

    python examples/aiohttp_server.py --port 8000 [--model sim|paddle] [--workers 2]
    curl -s localhost:8000/prefill -d '{"tokens": [1, 2, 3]}'

- The engine lives in a `cleanup_ctx` hook: started on the server's event loop before the first
  request, closed (draining accepted requests) after the last handler finished on shutdown.
- POST /prefill {"tokens": [...]} -> {"token", "logprob", ...}; a bad prompt -> 400 with the
  library's message; overloaded or closing -> 503.
- GET /health -> 200 while the engine can serve, else 503; GET /metrics -> Prometheus text.
- `handler_cancellation=True`: a client that disconnects cancels its handler, and with it the
  request inside the engine.
- SIGTERM/SIGINT: aiohttp stops accepting, waits for in-flight handlers, then the engine closes;
  no worker process or shared-memory segment is left.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

from aiohttp import web
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

from aioprefill import AioprefillError, Engine, metrics

ENGINE = web.AppKey("engine", Engine)
REGISTRY = web.AppKey("metrics", object)  # a prometheus_client CollectorRegistry


def create_app(args: argparse.Namespace) -> web.Application:
    loads, dumps = codec(args.json)
    config = engine_config(args)
    app = web.Application()

    async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
        with profiled(args.profile):
            async with Engine(config) as engine:
                app[ENGINE] = engine
                app[REGISTRY] = metrics.registry_for(engine)
                yield

    def json_response(obj: object, status: int = 200) -> web.Response:
        return web.Response(body=dumps(obj), status=status, content_type="application/json")

    async def prefill(request: web.Request) -> web.Response:
        engine = request.app[ENGINE]
        try:
            try:
                body = loads(await request.read())
            except ValueError as exc:  # every codec's decode error is a ValueError
                return json_response({"error": f"invalid JSON ({exc})"}, 400)
            tokens = tokens_from(body)
            options = options_from(body, request.headers.get("X-Request-Id"))
            result = await engine.prefill(tokens, **options)
        except AioprefillError as exc:
            return json_response({"error": str(exc)}, error_status(exc))
        return json_response(result_body(result))

    async def health(request: web.Request) -> web.Response:
        engine = request.app[ENGINE]
        h = engine.health()  # each worker's state; is_running: False once it cannot serve
        return json_response(health_body(h), 200 if h.is_running else 503)

    async def metrics_endpoint(request: web.Request) -> web.Response:
        body, content_type = metrics.render(request.app[REGISTRY])  # type: ignore[arg-type]
        return web.Response(body=body, headers={"Content-Type": content_type})

    app.cleanup_ctx.append(engine_ctx)
    app.router.add_post("/prefill", prefill)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_endpoint)
    return app


if __name__ == "__main__":  # workers re-import this module: the guard keeps them from serving
    args = parse_args(__doc__.splitlines()[0])
    web.run_app(
        create_app(args),
        host=args.host,
        port=args.port,
        handler_cancellation=True,
        access_log=None,
        print=lambda *a: print(*a, flush=True),
    )
