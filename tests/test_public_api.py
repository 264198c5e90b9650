"""The public names outside checks rely on (DESIGN.md): pinned, so a rename fails here."""

import aioprefill


def test_public_names_are_pinned():
    assert sorted(aioprefill.__all__) == sorted(
        [
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
    )
    for name in aioprefill.__all__:
        assert getattr(aioprefill, name) is not None


def test_error_tree():
    err = aioprefill
    for cls in (
        err.InvalidRequest,
        err.EngineOverloaded,
        err.EngineClosed,
        err.WorkerCrashed,
        err.ForwardFailed,
        err.WorkerStartFailed,
        err.InvalidConfig,
        err.ProtocolError,
        err.WrongLoop,
        err.DeadlineExceeded,
        err.KVExportClosed,
        err.TransferError,
    ):
        assert issubclass(cls, err.AioprefillError)
    assert issubclass(err.InvalidRequest, ValueError)
    assert issubclass(err.InvalidRequestType, TypeError)
    assert issubclass(err.InvalidConfig, ValueError)
    assert issubclass(err.WrongLoop, RuntimeError)  # DESIGN.md: also a RuntimeError
    assert issubclass(err.DeadlineExceeded, TimeoutError)
    assert issubclass(err.TransferError, ConnectionError)


def test_prefill_result_has_the_contract_fields():
    fields = set(aioprefill.PrefillResult.__struct_fields__)
    assert {
        "token",
        "logprob",
        "worker",
        "batch_id",
        "batch_size",
        "batch_tokens",
        "submitted_ns",
        "forward_start_ns",
        "forward_end_ns",
        "finished_ns",
    } <= fields


def test_engine_contract_methods():
    for name in (
        "prefill",
        "worker_pids",
        "stats",
        "health",
        "drain",
        "submit_threadsafe",
        "__aenter__",
        "__aexit__",
    ):
        assert callable(getattr(aioprefill.Engine, name))
    cfg = aioprefill.EngineConfig(
        model=aioprefill.SimModel(fixed_ms=15.0, per_token_us=20.0, attn_ns=0.0, vocab_size=32000),
        num_workers=1,
        policy="forward",
        max_batch_tokens=8192,
        max_batch_size=256,
        batch_timeout_ms=10.0,
        max_pending=100,
        max_prompt_tokens=1000,
    )
    assert cfg.max_prompt_tokens == 1000
    assert aioprefill.PaddleModel(seed=0).num_layers == 4
