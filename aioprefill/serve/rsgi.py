"""The app under granian's RSGI interface (`--server granian-rsgi`): the same routes and
answers as the ASGI app (`App.answer`), without ASGI's per-message dicts. RSGI has no async
lifespan, so the engine is started around the server (`fronts.run_granian`)."""

from __future__ import annotations

from typing import Any

from aioprefill.serve.app import _GONE, App
from aioprefill.serve.errors import HTTPError

__all__ = ["RSGIApp"]


class RSGIApp:
    def __init__(self, app: App) -> None:
        self.app = app

    async def __rsgi__(self, scope: Any, protocol: Any) -> None:
        if scope.proto != "http":
            return
        headers = scope.headers
        request_id = self.app.request_id(headers.get("x-request-id"))
        length = headers.get("content-length")
        limit = self.app.settings.max_body_bytes

        async def read() -> bytes | None:
            if length is not None and length.isdigit() and int(length) > limit:
                raise HTTPError(413, f"request body of {length} bytes is over {limit} bytes")
            chunks, size = [], 0
            async for chunk in protocol:
                size += len(chunk)
                if size > limit:
                    raise HTTPError(413, f"request body is over {limit} bytes")
                chunks.append(chunk)
            return b"".join(chunks)

        status, out, content_type = await self.app.answer(
            scope.path,
            scope.method,
            request_id,
            read,
            protocol.client_disconnect,
            headers.get("authorization"),
        )
        if status == _GONE:
            return
        protocol.response_bytes(
            status, [("content-type", content_type.decode()), ("x-request-id", request_id)], out
        )
