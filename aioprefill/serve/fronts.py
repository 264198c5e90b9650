"""The HTTP servers that can run the ASGI `App`: uvicorn (httptools, uvloop) and granian
(Rust). Measured side by side in benchmarks/bench_serve.py; uvicorn is the default."""

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
    )


def run_granian(app: Any, host: str, port: int) -> None:
    """Serve with granian's embedded server (Rust HTTP, the app on this process's uvloop):
    SIGTERM/SIGINT stop it, then the lifespan shutdown drains and closes the engine."""
    import asyncio
    import signal

    import uvloop
    from granian.constants import Interfaces
    from granian.log import LogLevels
    from granian.server.embed import Server

    async def serve() -> None:
        server = Server(
            app, address=host, port=port, interface=Interfaces.ASGI, log_level=LogLevels.warning
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.stop)
        await server.serve()

    uvloop.run(serve())
