"""The HTTP side of `aioprefill.serve`: a bare ASGI 3 application (no framework: the cheapest
Python front measured in benchmarks/bench_servers.py), run by uvicorn or granian.

- lifespan: the engine starts before the first request and closes (draining what it accepted)
  after the server finished its last one, so SIGTERM leaves no worker and no segment behind;
- routing is one dict lookup by path; 404 for an unknown path, 405 for a wrong method;
- a body larger than `max_body_bytes` is refused with 413 as soon as it is announced
  (Content-Length) or read past the limit, before it is decoded;
- a client that disconnects while its prompts run cancels them in the engine;
- with API keys (`serve/auth.py`), a request to a protected route without a valid
  `Authorization: Bearer` key is a 401 before its body is read;
- `X-Request-Id` names the request in the engine (errors, logs) and is echoed back; without
  one the server makes one;
- every error is OpenAI's error object with the status of `aioprefill.serve.errors`;
- `/metrics` adds the HTTP answers by route and status to the engine's series.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from aioprefill.config import EngineConfig
from aioprefill.engine.loop import Engine
from aioprefill.serve import embed, render, rerank, score
from aioprefill.serve.auth import APIKeys, is_protected
from aioprefill.serve.errors import HTTPError, error_body, error_status
from aioprefill.serve.routes import ServeSettings, Service

__all__ = ["App"]

log = logging.getLogger("aioprefill.serve")

JSON = b"application/json"
_GONE = 499  # nginx's "client closed request": counted, never sent
_MAX_REQUEST_ID = 128


class App:
    """`App(config, settings)` is the ASGI callable; the engine lives in its
    lifespan."""

    def __init__(
        self, config: EngineConfig, settings: ServeSettings, keys: APIKeys | None = None
    ) -> None:
        self.config = config
        self.settings = settings
        self.keys = keys  # None: no authentication
        self.service: Service | None = None
        self.answers: Counter[tuple[str, int]] = Counter()  # (route, status) -> count
        self._ids = itertools.count(1)
        self._id_prefix = f"{os.getpid():x}-{os.urandom(3).hex()}-"
        self._registry: Any = None
        # path -> (method, handler, reads the engine: races the client's disconnect)
        self.routes: dict[str, tuple[str, Callable[..., Awaitable[Any]], bool]] = {
            "/v1/completions": ("POST", self._completions, True),
            "/v1/chat/completions": ("POST", self._chat, True),
            "/v1/completions/render": ("POST", self._render_completions, False),
            "/v1/chat/completions/render": ("POST", self._render_chat, False),
            "/v1/embeddings": ("POST", self._embeddings, True),
            "/v1/rerank": ("POST", self._rerank, True),
            "/rerank": ("POST", self._rerank, True),
            "/v1/score": ("POST", self._score, True),
            "/score": ("POST", self._score, True),
            "/embed": ("POST", self._embed, True),
            "/tokenize": ("POST", self._tokenize, False),
            "/detokenize": ("POST", self._detokenize, False),
            "/v1/models": ("GET", self._models, False),
            "/health": ("GET", self._health, False),
            "/metrics": ("GET", self._metrics, False),
            "/server_info": ("GET", self._server_info, False),
        }

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    # ---- one request ------------------------------------------------------------------

    async def _http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        request_id, length, authorization = self._headers(scope["headers"])
        status, out, content_type = await self.answer(
            scope["path"],
            scope["method"],
            request_id,
            lambda: self._read(receive, length),
            receive,
            authorization,
        )
        if status == _GONE:
            return  # the client is gone: nothing to send
        headers = [
            (b"content-type", content_type),
            (b"content-length", b"%d" % len(out)),  # else uvicorn chunks it
            (b"x-request-id", request_id.encode()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": out})

    async def answer(
        self,
        path: str,
        method: str,
        request_id: str,
        read: Callable[[], Awaitable[bytes | None]],
        gone: Callable[[], Awaitable[Any]],
        authorization: bytes | str | None = None,
    ) -> tuple[int, bytes, bytes]:
        """(status, body, content type) for one request, whatever the server interface:
        `read()` gives the body (None: the client left), `gone()` returns once it leaves,
        `authorization` is the Authorization header's value."""
        route = self.routes.get(path)
        label = path if route is not None else "other"
        content_type = JSON
        try:
            if route is None:
                raise HTTPError(404, f"no route {path}")
            want, handler, races = route
            tenant = None
            if self.keys is not None and is_protected(path):
                tenant = self.keys.check(authorization)  # 401 before the body is read
            if method != want:
                raise HTTPError(405, f"{path} takes {want}, not {method}")
            if want == "POST":
                body = await read()
                if body is None:
                    status, out = _GONE, b""
                else:
                    job = handler(body, request_id, tenant)
                    status, out = await (self._race(job, gone) if races else job)
            else:
                status, out, content_type = await handler()
        except Exception as exc:
            status = error_status(exc)
            if status >= 500 and not isinstance(exc, HTTPError):
                log.error("request %s to %s failed: %r", request_id, path, exc)
            out = error_body(status, str(exc))
        self.answers[label, status] += 1
        return status, out, content_type

    def request_id(self, value: bytes | str | None) -> str:
        """The client's X-Request-Id if usable (1-128 ASCII characters), else a fresh one."""
        if value and len(value) <= _MAX_REQUEST_ID and value.isascii():
            return value if isinstance(value, str) else value.decode()
        return f"{self._id_prefix}{next(self._ids)}"

    def _headers(self, headers: list[tuple[bytes, bytes]]) -> tuple[str, int, bytes | None]:
        """The request id to use (the client's X-Request-Id if usable, else a fresh one), the
        announced Content-Length (-1 when absent) and the Authorization header."""
        request_id, length, authorization = None, -1, None
        for key, value in headers:
            if key == b"x-request-id":
                request_id = value
            elif key == b"content-length" and value.isdigit():
                length = int(value)
            elif key == b"authorization":
                authorization = value
        return self.request_id(request_id), length, authorization

    async def _read(self, receive: Any, length: int) -> bytes | None:
        """The whole body, or None when the client left first."""
        limit = self.settings.max_body_bytes
        if length > limit:
            raise HTTPError(413, f"request body of {length} bytes is over {limit} bytes")
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise HTTPError(413, f"request body is over {limit} bytes")
            chunks.append(chunk)
            if not msg.get("more_body"):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _race(
        self, job: Awaitable[Any], gone: Callable[[], Awaitable[Any]]
    ) -> tuple[int, bytes]:
        """Run `job` unless the client disconnects first (then cancel it): the body was read,
        so the next message from the server is http.disconnect. A done callback, not
        `asyncio.wait`: this runs for every request."""
        work = asyncio.ensure_future(job)
        left = asyncio.ensure_future(gone())
        cancel = lambda _: work.cancel()  # noqa: E731
        left.add_done_callback(cancel)
        try:
            return await work  # type: ignore[no-any-return,unused-ignore]
        except asyncio.CancelledError:
            if left.done() and not left.cancelled():
                return _GONE, b""  # the client left: nothing to answer
            raise  # the server itself is cancelling this request
        finally:
            left.remove_done_callback(cancel)
            left.cancel()

    # ---- handlers: (status, body) for POST, (status, body, content type) for GET ----------

    def _svc(self) -> Service:
        if self.service is None:
            raise HTTPError(503, "the engine is not running")
        return self.service

    async def _completions(self, body: bytes, request_id: str, tenant: Any) -> tuple[int, bytes]:
        return 200, await self._svc().completions(body, request_id, tenant)

    async def _chat(self, body: bytes, request_id: str, tenant: Any) -> tuple[int, bytes]:
        return 200, await self._svc().chat_completions(body, request_id, tenant)

    async def _render_completions(self, body: bytes, request_id: str, _: Any) -> tuple[int, bytes]:
        svc = self._svc()
        return 200, svc.encode(await render.render_completions(svc, body, request_id))

    async def _render_chat(self, body: bytes, request_id: str, _: Any) -> tuple[int, bytes]:
        svc = self._svc()
        return 200, svc.encode(await render.render_chat(svc, body, request_id))

    async def _embeddings(self, body: bytes, request_id: str, tenant: Any) -> tuple[int, bytes]:
        return 200, await self._svc().embeddings(body, request_id, tenant)

    async def _rerank(self, body: bytes, request_id: str, tenant: Any) -> tuple[int, bytes]:
        return 200, await rerank.rerank(self._svc(), body, request_id, tenant)

    async def _score(self, body: bytes, request_id: str, tenant: Any) -> tuple[int, bytes]:
        return 200, await score.score(self._svc(), body, request_id, tenant)

    async def _embed(self, body: bytes, request_id: str, tenant: Any) -> tuple[int, bytes]:
        return 200, await embed.embed(self._svc(), body, request_id, tenant)

    async def _tokenize(self, body: bytes, request_id: str, _: Any) -> tuple[int, bytes]:
        return 200, await self._svc().tokenize(body)

    async def _detokenize(self, body: bytes, request_id: str, _: Any) -> tuple[int, bytes]:
        return 200, await self._svc().detokenize(body)

    async def _models(self) -> tuple[int, bytes, bytes]:
        return 200, self._svc().models(), JSON

    async def _health(self) -> tuple[int, bytes, bytes]:
        status, body = self._svc().health()
        return status, body, JSON

    async def _server_info(self) -> tuple[int, bytes, bytes]:
        return 200, self._svc().server_info(), JSON

    async def _metrics(self) -> tuple[int, bytes, bytes]:
        from aioprefill import metrics

        self._svc()
        body, content_type = metrics.render(self._registry)
        return 200, body, content_type.encode()

    # ---- lifespan ---------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The engine started and served from, closed (draining) at exit."""
        async with Engine(self.config) as engine:
            self.service = Service(engine, engine.tokenizer, self.settings)
            self._registry = _registry(engine, self.answers, self.keys)
            pd = await _vllm_pd(engine, self.settings.vllm_pd)  # --kv-transfer vllm-mooncake
            self.service.vllm_pd = pd
            reload = self.keys is not None and self.keys.file is not None
            if reload:  # a key file is re-read on SIGHUP
                assert self.keys is not None
                asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.keys.reload)
            try:
                yield
            finally:
                self.service = None
                if pd is not None:
                    await pd.close()
                if reload:
                    asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        await receive()  # lifespan.startup
        started = False
        try:
            async with self.running():
                started = True
                await send({"type": "lifespan.startup.complete"})
                await receive()  # lifespan.shutdown: the server answered its last request
        except BaseException as exc:
            if not started:
                await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                return
            raise
        await send({"type": "lifespan.shutdown.complete"})


async def _vllm_pd(engine: Engine, options: Any) -> Any:
    """vLLM's MooncakeConnector, prefill side (`serve/vllm_pd.py`), started; None without."""
    if options is None:
        return None
    from aioprefill.serve.vllm_pd import VllmPD
    from aioprefill.transfer.vllm.geometry import KVShape
    from aioprefill.wire.kv import kv_layout

    layout = kv_layout(engine.config.model)
    pd = VllmPD(options, KVShape(layout.num_layers, layout.num_kv_heads, layout.head_dim))
    await pd.start()
    return pd


def _registry(engine: Engine, answers: Counter[tuple[str, int]], keys: APIKeys | None) -> Any:
    """The engine's Prometheus series plus `aioprefill_http_responses_total{route,status}`
    and, with API keys, `aioprefill_http_auth_failures_total`."""
    from prometheus_client.core import CounterMetricFamily
    from prometheus_client.registry import Collector

    from aioprefill import metrics

    class HTTPAnswers(Collector):
        def collect(self) -> Iterator[Any]:
            family = CounterMetricFamily(
                "aioprefill_http_responses",
                "HTTP answers by route and status (499: the client left first, nothing sent).",
                labels=["route", "status"],
            )
            for (route, status), n in sorted(answers.items()):
                family.add_metric([route, str(status)], n)
            yield family
            if keys is not None:
                yield CounterMetricFamily(
                    "aioprefill_http_auth_failures",
                    "Requests refused for a missing or unknown API key (401).",
                    value=keys.failures,
                )

    registry = metrics.registry_for(engine)
    registry.register(HTTPAnswers())
    return registry
