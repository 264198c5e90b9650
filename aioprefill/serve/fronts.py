"""The HTTP servers that can run the `App`: uvicorn (httptools, uvloop; ASGI) and granian
(Rust; ASGI or RSGI). Measured side by side in benchmarks/bench_serve.py."""

from __future__ import annotations

from typing import Any

__all__ = ["run_granian", "run_uvicorn"]


def run_uvicorn(app: Any, host: str, port: int) -> None:
    """Serve until SIGTERM/SIGINT: uvicorn stops accepting, finishes every request in flight,
    then runs the lifespan shutdown (the engine drains and closes)."""
    import uvicorn

    uvicorn.run(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
        timeout_keep_alive=30,
        # Per-request work nobody asked for: the X-Forwarded-* middleware around the app,
        # and a Server header (each response header is checked with two regexes).
        proxy_headers=False,
        server_header=False,
    )


def run_granian(app: Any, host: str, port: int, *, rsgi: bool = False) -> None:
    """Serve with granian's embedded server (Rust HTTP, the app on this process's uvloop), as
    ASGI (the engine in the lifespan) or RSGI (the engine started around the server: RSGI has
    no async lifespan). SIGTERM/SIGINT stop the server, then the engine drains and closes."""
    import asyncio
    import contextlib
    import signal

    import uvloop
    from granian.constants import Interfaces
    from granian.log import LogLevels
    from granian.server.embed import Server

    from aioprefill.serve.rsgi import RSGIApp

    async def serve() -> None:
        running = app.running() if rsgi else contextlib.nullcontext()
        async with running:
            server = Server(
                RSGIApp(app) if rsgi else app,
                address=host,
                port=port,
                interface=Interfaces.RSGI if rsgi else Interfaces.ASGI,
                log_level=LogLevels.warning,
            )
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, server.stop)
            await server.serve()

    uvloop.run(serve())
