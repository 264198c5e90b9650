"""aioprefill: forward-aware prefill batching for asyncio servers.

    async with Engine(EngineConfig(model=PaddleModel(seed=0), num_workers=2)) as engine:
        result = await engine.prefill(token_ids)

Where things are (bottom layer first; a module imports only from its own layer or below,
tests/test_layers.py checks it and docs/architecture.md draws it):

    errors, optional, checks   the exception tree, optional imports, field checks
    shm/                       shared-memory rings and eventfd channels (the transport)
    hf/                        every file format: config.json, safetensors, GGUF
    text/                      tokenizer, chat templates, which tokenizer an engine uses
    models, parallel, config   SimModel / PaddleModel specs, worker arrangement, EngineConfig
    wire/                      what crosses the process boundary: messages, outputs, KV export
    transfer/, kvstore/        KV to decode nodes (Mooncake); the prefix cache's second tier
    workers/                   inside a worker process: the runner, and paddle/ (the model)
    sched/                     pure bookkeeping: requests, batches, policies/, prefix/ cache
    result                     PrefillResult
    engine/                    the Engine on its event loop, and pool/ (the worker processes)
    kv_events/, metrics        vLLM KV events (ZMQ), the Prometheus exporter
    serve/, bench/             the HTTP server and the benchmark (python -m ...)
"""

from aioprefill.config import EngineConfig, PaddleModel, SimModel
from aioprefill.engine.health import EngineHealth
from aioprefill.engine.loop import Engine
from aioprefill.engine.stats import EngineStats
from aioprefill.errors import (
    AioprefillError,
    DeadlineExceeded,
    EngineClosed,
    EngineOverloaded,
    ForwardFailed,
    InvalidConfig,
    InvalidRequest,
    InvalidRequestType,
    KVExportClosed,
    ProtocolError,
    TransferError,
    WorkerCrashed,
    WorkerStartFailed,
    WrongLoop,
)
from aioprefill.kvstore.options import KVStoreOptions
from aioprefill.result import PrefillResult
from aioprefill.text.tokenizer import Tokenizer

__all__ = [
    "AioprefillError",
    "DeadlineExceeded",
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "EngineHealth",
    "EngineOverloaded",
    "EngineStats",
    "ForwardFailed",
    "InvalidConfig",
    "InvalidRequest",
    "InvalidRequestType",
    "KVExportClosed",
    "KVStoreOptions",
    "PaddleModel",
    "PrefillResult",
    "ProtocolError",
    "SimModel",
    "Tokenizer",
    "TransferError",
    "WorkerCrashed",
    "WorkerStartFailed",
    "WrongLoop",
]
__version__ = "0.1.0"
