"""What both example servers share: command-line flags, the engine config, JSON bodies, and the
mapping from aioprefill's errors to HTTP statuses. The servers themselves are
`aiohttp_server.py` and `starlette_server.py`."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from aioprefill import (
    EngineConfig,
    EngineHealth,
    InvalidRequest,
    PaddleModel,
    PrefillResult,
    SimModel,
)

# 400 for a bad prompt (the library's message is the body), 429 overloaded, 503 when the engine
# cannot take it now (closing, no worker), 504 past its deadline_s, 500 when it failed while
# running: the one mapping, shared with `python -m aioprefill.serve`.
from aioprefill.serve.errors import error_status as error_status

BODY_HINT = 'the body must be a JSON object like {"tokens": [1, 2, 3]}'


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", choices=["sim", "paddle"], default="sim")
    p.add_argument("--workers", type=int, default=1, help="engine worker processes")
    p.add_argument("--policy", default="forward")
    p.add_argument("--sim-fixed-ms", type=float, default=5.0)
    p.add_argument("--sim-per-token-us", type=float, default=20.0)
    p.add_argument("--max-prompt-tokens", type=int, default=None)
    p.add_argument(
        "--json",
        choices=["msgspec", "orjson", "stdlib"],
        default="msgspec",
        help="JSON codec for request and response bodies",
    )
    p.add_argument(
        "--http",
        choices=["httptools", "h11"],
        default="httptools",
        help="uvicorn's HTTP parser (ASGI servers only)",
    )
    p.add_argument(
        "--profile",
        metavar="PATH",
        default=None,
        help="cProfile the server's event-loop thread, written to PATH at shutdown",
    )
    return p.parse_args()


@contextlib.contextmanager
def profiled(path: str | None) -> Iterator[None]:
    """cProfile the server (benchmarks/bench_servers.py --profile) from startup to shutdown."""
    if path is None:
        yield
        return
    import cProfile
    import time

    prof = cProfile.Profile(time.thread_time)  # CPU time: the loop's idle waits cost nothing
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        prof.dump_stats(path)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    model: SimModel | PaddleModel
    if args.model == "sim":
        model = SimModel(fixed_ms=args.sim_fixed_ms, per_token_us=args.sim_per_token_us)
    else:
        model = PaddleModel(seed=0)
    return EngineConfig(
        model=model,
        num_workers=args.workers,
        policy=args.policy,
        max_prompt_tokens=args.max_prompt_tokens,
    )


def codec(name: str) -> tuple[Callable[[bytes], Any], Callable[[Any], bytes]]:
    """(loads, dumps) for the chosen JSON library, picked once at startup."""
    if name == "orjson":
        import orjson

        return orjson.loads, orjson.dumps
    if name == "stdlib":
        return json.loads, lambda obj: json.dumps(obj).encode()
    return msgspec.json.decode, msgspec.json.encode


def tokens_from(body: Any) -> Any:
    """The prompt from a decoded body; the engine validates the ids themselves."""
    if not isinstance(body, dict) or "tokens" not in body:
        raise InvalidRequest(BODY_HINT)
    return body["tokens"]


def options_from(body: dict[str, Any], request_id: str | None) -> dict[str, Any]:
    """prefill()'s per-request controls: `"deadline_s"` from the body, the request id from the
    X-Request-Id header (it then names the request in the engine's errors and logs)."""
    options: dict[str, Any] = {}
    if "deadline_s" in body:
        options["deadline_s"] = body["deadline_s"]
    if request_id is not None:
        options["request_id"] = request_id
    return options


def result_body(r: PrefillResult) -> dict[str, Any]:
    return {
        "token": r.token,
        "logprob": r.logprob,
        "worker": r.worker,
        "batch_size": r.batch_size,
        "num_tokens": r.num_tokens,
        "ttft_us": r.ttft_ns // 1000,
    }


def health_body(h: EngineHealth) -> dict[str, Any]:
    """GET /health: 200 with this body while `h.is_running`, else 503 (draining, closed, or
    every worker given up), so a load balancer stops routing here."""
    return msgspec.to_builtins(h)  # {"is_running", "state", "workers": [{index, state, pid...}]}
