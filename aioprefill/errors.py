"""The exception tree. Every error aioprefill raises on purpose derives from `AioprefillError`.

AioprefillError
├── InvalidConfig(ValueError)         an EngineConfig / model field is wrong
├── InvalidRequest(ValueError)        a prompt was refused before anything was queued
│   └── InvalidRequestType(TypeError) ... because of its type (not a list/1-D int array)
├── EngineOverloaded                  max_pending requests already wait
│   └── KVBudgetExceeded              open KV exports fill max_kv_export_bytes
├── EngineClosed(RuntimeError)        the engine is closing, draining or closed
├── WrongLoop(RuntimeError)           called from a loop or thread other than the engine's
├── DeadlineExceeded(TimeoutError)    a request was not dispatched by its deadline_s
├── KVExportClosed(ValueError)        a KV export handle was used (or pulled) after close()
├── TransferError(ConnectionError)    a KV transfer failed: engine unreachable, timed out, refused
├── WorkerCrashed                     the worker running the request died (after retries)
├── WorkerStartFailed                 a worker could not start (or keeps dying)
├── ForwardFailed(RuntimeError)       the model raised inside a forward; carries its message
└── ProtocolError                     bytes in shared memory or on the wire are malformed
    └── FrameTooLarge(ValueError)     a frame does not fit in the ring at all
"""

from __future__ import annotations

__all__ = [
    "AioprefillError",
    "DeadlineExceeded",
    "EngineClosed",
    "EngineOverloaded",
    "ForwardFailed",
    "FrameTooLarge",
    "InvalidConfig",
    "InvalidRequest",
    "InvalidRequestType",
    "KVBudgetExceeded",
    "KVExportClosed",
    "ProtocolError",
    "TransferError",
    "WorkerCrashed",
    "WorkerStartFailed",
    "WrongLoop",
]


class AioprefillError(Exception):
    """Root of every error aioprefill raises on purpose."""


class InvalidConfig(AioprefillError, ValueError):
    """A configuration field is invalid; the message names the field and why."""


class InvalidRequest(AioprefillError, ValueError):
    """A prompt was refused before anything was queued (empty, out of vocabulary, too long...)."""


class InvalidRequestType(InvalidRequest, TypeError):
    """A prompt has the wrong type: not a list of ints or a 1-D integer array."""


class EngineOverloaded(AioprefillError):
    """`max_pending` requests are already waiting; retry later or use `wait=True`."""


class KVBudgetExceeded(EngineOverloaded):
    """A `return_kv` request would pass `max_kv_export_bytes`: close some `KVExport`s first."""


class EngineClosed(AioprefillError, RuntimeError):
    """The engine is closing or closed; it never reopens."""


class WrongLoop(AioprefillError, RuntimeError):
    """A coroutine of the engine was awaited on a loop or thread other than the one that
    started it. An engine's state belongs to one event loop; from another thread use
    `engine.submit_threadsafe()`."""


class DeadlineExceeded(AioprefillError, TimeoutError):
    """The request was not dispatched to a worker by its `deadline_s`; it never ran."""


class KVExportClosed(AioprefillError, ValueError):
    """A `KVExport` was read after `close()` (or after its engine closed), or a decode node
    pulled an export that was closed, evicted or expired (`aioprefill.transfer.pull_kv`)."""


class TransferError(AioprefillError, ConnectionError):
    """A KV transfer failed: the prefill engine is unreachable or dead, the pull timed out, or
    the owner refused the read (parameters that name no registered memory)."""


class WorkerCrashed(AioprefillError):
    """The worker process serving this request died, and retries (if any) ran out."""


class WorkerStartFailed(AioprefillError):
    """A worker process failed to start, or keeps dying right after it starts."""


class ForwardFailed(AioprefillError, RuntimeError):
    """The model raised inside a forward; the message carries the worker's error."""

    def __init__(self, message: str, *, worker: int = -1, error_type: str = "") -> None:
        super().__init__(message)
        self.worker = worker
        self.error_type = error_type


class ProtocolError(AioprefillError):
    """Malformed bytes: a corrupt ring header, a lying length, an undecodable message."""


class FrameTooLarge(ProtocolError, ValueError):
    """A frame is larger than the ring can ever hold."""
