"""The bootstrap HTTP server of vLLM's MooncakeConnector, prefill side: `GET /query` tells a
decode node (and vllm-router) this node's engine id and its ZMQ side channel,

    {"0": {"engine_id": E, "worker_addr": {"0": {"0": "tcp://HOST:PORT"}}}}

(data-parallel rank 0, one TP rank and one PP stage: one aioprefill process holds every KV
head). `POST /register` is vLLM's own workers announcing themselves: answered 200 and
ignored. Anything else is 404. A bare asyncio server (one request per connection, bounded
header size and time), so no framework is needed for two routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

__all__ = ["BootstrapServer"]

log = logging.getLogger("aioprefill.serve")

_MAX_HEADER = 16 << 10
_MAX_BODY = 1 << 20
_READ_S = 10.0


class BootstrapServer:
    def __init__(self, host: str, port: int, engine_id: str, side_channel: str) -> None:
        self.host, self.port = host, port
        self.query = json.dumps(
            {"0": {"engine_id": engine_id, "worker_addr": {"0": {"0": side_channel}}}}
        ).encode()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._client, self.host, self.port, reuse_address=True
        )

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            status, body = await asyncio.wait_for(self._answer(reader), _READ_S)
        except (TimeoutError, asyncio.LimitOverrunError, ValueError, OSError):
            status, body = 400, b'{"error": "bad request"}'
        except asyncio.IncompleteReadError:
            status, body = 0, b""
        try:
            if status:
                reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(status, "")
                head = (
                    f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
                )
                writer.write(head.encode() + body)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, bytes]:
        head = await reader.readuntil(b"\r\n\r\n")
        if len(head) > _MAX_HEADER:
            return 400, b'{"error": "headers too large"}'
        lines = head.decode("latin-1").split("\r\n")
        method, path, *_ = lines[0].split(" ")
        length = 0
        for line in lines[1:]:
            key, _, value = line.partition(":")
            if key.strip().lower() == "content-length":
                length = int(value.strip())
        if not 0 <= length <= _MAX_BODY:
            return 400, b'{"error": "body too large"}'
        if length:
            await reader.readexactly(length)
        path = path.split("?", 1)[0]
        if method == "GET" and path == "/query":
            return 200, self.query
        if method == "POST" and path == "/register":
            return 200, b"{}"  # vLLM's workers announcing themselves: this node has its own
        log.info("vllm-mooncake bootstrap: %s %s: 404", method, path)
        return 404, b'{"error": "not found"}'
