"""aioprefill behind a bare ASGI app (no framework), served by uvicorn (httptools, uvloop).

    python examples/asgi_server.py --port 8000 [--model sim|paddle] [--workers 2]

The cheapest Python front measured in `benchmarks/bench_servers.py`: the same endpoints and
behaviour as `starlette_server.py` (lifespan engine, /prefill, /health, /metrics, 400 with the
library's message, cancel on disconnect, graceful SIGTERM) in plain ASGI calls.
"""

from __future__ import annotations

import asyncio
import contextlib
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

from aioprefill import AioprefillError, Engine, metrics

JSON = [(b"content-type", b"application/json")]


class App:
    def __init__(self, args: Any) -> None:
        self.args = args
        self.loads, self.dumps = codec(args.json)
        self.config = engine_config(args)
        self.engine: Engine | None = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self.lifespan(receive, send)
            return
        assert self.engine is not None
        path, method = scope["path"], scope["method"]
        if path == "/prefill" and method == "POST":
            request_id = next(
                (v.decode() for k, v in scope["headers"] if k == b"x-request-id"), None
            )
            status, headers, body = await self.prefill(receive, request_id)
        elif path == "/health" and method == "GET":
            h = self.engine.health()
            status, headers, body = (200 if h.is_running else 503), JSON, self.dumps(health_body(h))
        elif path == "/metrics" and method == "GET":
            body, content_type = metrics.render(self.registry)
            status, headers = 200, [(b"content-type", content_type.encode())]
        else:
            status, headers, body = 404, JSON, self.dumps({"error": "not found"})
        if status == 499:
            return  # the client is gone: nothing to send
        headers = [*headers, (b"content-length", b"%d" % len(body))]  # else uvicorn chunks it
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def prefill(self, receive: Any, request_id: str | None) -> tuple[int, list, bytes]:
        chunks = []
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return 499, [], b""
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        try:
            try:
                body = self.loads(b"".join(chunks))
            except ValueError as exc:  # every codec's decode error is a ValueError
                return 400, JSON, self.dumps({"error": f"invalid JSON ({exc})"})
            assert self.engine is not None
            tokens = tokens_from(body)
            options = options_from(body, request_id)
            job = asyncio.ensure_future(self.engine.prefill(tokens, **options))
        except AioprefillError as exc:
            return error_status(exc), JSON, self.dumps({"error": str(exc)})
        gone = asyncio.ensure_future(receive())  # the body was read: next is http.disconnect
        await asyncio.wait((job, gone), return_when=asyncio.FIRST_COMPLETED)
        if not job.done():
            job.cancel()
            with contextlib.suppress(asyncio.CancelledError, AioprefillError):
                await job
            return 499, [], b""
        gone.cancel()
        try:
            result = job.result()
        except AioprefillError as exc:
            return error_status(exc), JSON, self.dumps({"error": str(exc)})
        return 200, JSON, self.dumps(result_body(result))

    async def lifespan(self, receive: Any, send: Any) -> None:
        await receive()  # lifespan.startup
        with profiled(self.args.profile):
            try:
                async with Engine(self.config) as engine:
                    self.engine = engine
                    self.registry = metrics.registry_for(engine)
                    await send({"type": "lifespan.startup.complete"})
                    await receive()  # lifespan.shutdown: uvicorn finished every request
            except BaseException as exc:
                if self.engine is None:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                raise
        await send({"type": "lifespan.shutdown.complete"})


if __name__ == "__main__":  # workers re-import this module: the guard keeps them from serving
    args = parse_args(__doc__.splitlines()[0])
    uvicorn.run(
        App(args),
        host=args.host,
        port=args.port,
        loop="uvloop",
        http=args.http,
        lifespan="on",
        access_log=False,
        log_level="warning",
    )
