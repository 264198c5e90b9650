"""aioprefill: forward-aware prefill batching for asyncio servers.

async with Engine(EngineConfig(model=PaddleModel(seed=0), num_workers=2)) as engine:
    result = await engine.prefill(token_ids)
"""

from aioprefill.config import EngineConfig, PaddleModel, SimModel
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
from aioprefill.health import EngineHealth
from aioprefill.kvstore.options import KVStoreOptions
from aioprefill.loop import Engine
from aioprefill.result import PrefillResult
from aioprefill.stats import EngineStats
from aioprefill.tokenizer import Tokenizer

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
