"""Typed, validated configuration: `EngineConfig`, which holds one of the model specs of
`aioprefill.models` (re-exported here). Every field is checked once, at construction, and a bad
one raises `InvalidConfig` naming the field.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass, field

from aioprefill.checks import finite_nonneg as _finite_nonneg
from aioprefill.checks import positive_int as _positive_int
from aioprefill.checks import require as _require
from aioprefill.kvstore.options import KV_STORE_BACKENDS, KVStoreOptions
from aioprefill.models import ARCHITECTURES, ROPE_TYPES, ModelSpec, PaddleModel, SimModel
from aioprefill.optional import import_optional
from aioprefill.parallel import check_parallel
from aioprefill.text.resolve import resolve_tokenizer
from aioprefill.text.tokenizer import Tokenizer
from aioprefill.transfer.options import KV_TRANSFER_BACKENDS, TransferOptions

__all__ = [
    "ARCHITECTURES",
    "PADDLE_EXTRA_HINT",
    "POLICIES",
    "ROPE_TYPES",
    "EngineConfig",
    "ModelSpec",
    "PaddleModel",
    "SimModel",
]

# ep-timer, forward-greedy: baselines (parallel.py; policies/forward.py)
POLICIES = ("forward", "eager", "timeout", "ep-timer", "forward-greedy")

PADDLE_EXTRA_HINT = (
    "pip install 'aioprefill[paddle]' (on a CUDA machine: paddlepaddle-gpu and safetensors)"
)


def _require_paddle_installed() -> None:
    """PaddleModel's workers import paddle and safetensors: say so now, naming the extra, if
    either is missing. `find_spec` locates a module without importing it (the engine process
    never imports paddle)."""
    missing = [m for m in ("paddle", "safetensors") if importlib.util.find_spec(m) is None]
    _require(
        not missing,
        "EngineConfig.model",
        f"PaddleModel needs {' and '.join(missing)}, not installed here: {PADDLE_EXTRA_HINT}",
    )


def _check_encoder(config: EngineConfig) -> None:
    """What an encoder model (BERT, XLM-RoBERTa) cannot do, refused naming the setting; its
    prefix cache (on by default) is turned off, with a log line: a bidirectional encoder's
    states depend on the whole prompt, so no prefix of one can serve another."""
    model = config.model
    assert isinstance(model, PaddleModel)
    arch = model.architecture
    positions = model.max_position_embeddings - model.position_offset
    for ok, name, why in (
        (config.tp_size == 1, "tp_size", "no tensor parallelism for encoders yet"),
        (not config.expert_parallel, "expert_parallel", "encoders have no experts"),
        (config.kv_transfer is None, "kv_transfer", "an encoder keeps no KV cache to send"),
        (config.kv_store is None, "kv_store", "an encoder has no prefix cache"),
        (config.kv_events_endpoint is None, "kv_events_endpoint", "it has no prefix cache"),
        (
            config.max_prompt_tokens is not None and config.max_prompt_tokens <= positions,
            "max_prompt_tokens",
            f"{config.max_prompt_tokens} exceeds its position table ({positions})",
        ),
        (
            config.max_prompt_tokens is not None
            and config.max_prompt_tokens <= config.max_batch_tokens,
            "max_prompt_tokens",
            f"{config.max_prompt_tokens} exceeds max_batch_tokens={config.max_batch_tokens}: "
            "an encoder's prompt is never chunked",
        ),
    ):
        _require(ok, f"EngineConfig.{name}", f"not for the encoder {arch}: {why}")
    if config.prefix_cache_bytes:
        logging.getLogger("aioprefill").info(
            "EngineConfig.prefix_cache_bytes: turned off for the encoder %s (its states depend "
            "on the whole prompt)",
            arch,
        )
        config.prefix_cache_bytes = 0


def _check_kv_transfer(kind: object, options: object) -> None:
    _require(
        kind is None or kind in KV_TRANSFER_BACKENDS,
        "EngineConfig.kv_transfer",
        f"must be None or one of {', '.join(KV_TRANSFER_BACKENDS)}; got {kind!r}",
    )
    _require(
        isinstance(options, TransferOptions),
        "EngineConfig.kv_transfer_options",
        f"must be aioprefill.transfer.TransferOptions(...), got {type(options).__name__}",
    )
    if kind is not None:  # InvalidConfig naming the extra (and libibverbs1) when missing
        from aioprefill.transfer.backend import load_mooncake

        load_mooncake()


def _check_endpoint(value: object, name: str) -> None:
    head, _, port = str(value).rpartition(":")
    _require(
        isinstance(value, str)
        and value.startswith("tcp://")
        and len(head) > len("tcp://")
        and port.isdigit()
        and 0 < int(port) < 65536,
        name,
        f"must be 'tcp://HOST:PORT' (HOST may be * to bind every address); got {value!r}",
    )


def _check_kv_events(endpoint: object, replay: object) -> None:
    if endpoint is None:
        _require(
            replay is None, "EngineConfig.kv_events_replay_endpoint", "needs kv_events_endpoint"
        )
        return
    _check_endpoint(endpoint, "EngineConfig.kv_events_endpoint")
    if replay is not None:
        _check_endpoint(replay, "EngineConfig.kv_events_replay_endpoint")
    import_optional("zmq", "events")  # InvalidConfig naming the extra when pyzmq is missing


def _check_kv_store(kind: object, options: object) -> None:
    _require(
        kind is None or kind in KV_STORE_BACKENDS,
        "EngineConfig.kv_store",
        f"must be None or one of {', '.join(KV_STORE_BACKENDS)}; got {kind!r}",
    )
    _require(
        isinstance(options, KVStoreOptions),
        "EngineConfig.kv_store_options",
        f"must be aioprefill.KVStoreOptions(...), got {type(options).__name__}",
    )
    if kind is not None:  # InvalidConfig naming the extra (and libibverbs1) when missing
        from aioprefill.kvstore.backend import load_store, load_xxhash

        load_store()
        if isinstance(options, KVStoreOptions) and options.secret is None:
            load_xxhash()
        if isinstance(options, KVStoreOptions) and options.peer_events:
            import_optional("zmq", "events")  # the workers subscribe to the nodes' events


@dataclass(slots=True, kw_only=True)
class EngineConfig:
    """Everything an `Engine` needs. Validated once, here; bad fields raise `InvalidConfig`."""

    model: ModelSpec = field(default_factory=SimModel)
    num_workers: int = 1
    policy: str = "forward"
    max_batch_tokens: int = 8192
    max_batch_size: int = 256
    batch_timeout_ms: float = 10.0
    # Enough for tens of thousands of concurrent callers; past it prefill() raises EngineOverloaded.
    max_pending: int = 65536
    # None: the model's max_position_embeddings.
    max_prompt_tokens: int | None = None
    # Prompts longer than max_batch_tokens are split over consecutive forwards on one worker.
    enable_chunked_prefill: bool = True
    # In-flight requests of a dead worker are retried this many times before WorkerCrashed.
    max_retries: int = 1
    # A forward running longer than this is treated as a hung worker (killed, restarted).
    forward_timeout_s: float | None = 300.0
    worker_start_timeout_s: float = 120.0
    # A worker that dies this many times within restart_window_s stops being restarted.
    max_restarts: int = 5
    restart_window_s: float = 60.0
    # Bytes per shared-memory ring; None sizes it from the batch budgets.
    ring_capacity: int | None = None
    # "spawn" | "forkserver"; None: forkserver with paddle preloaded for PaddleModel, else spawn.
    start_method: str | None = None
    # On a clean exit from `async with`, wait this long for accepted requests to finish.
    shutdown_timeout_s: float = 30.0
    # Ranks per replica (tensor parallelism); world = num_workers * tp_size processes.
    tp_size: int = 1
    # All replicas form one expert-parallel group that steps in lockstep (MoE experts sharded).
    expert_parallel: bool = False
    # Shared memory that KV exports (return_kv=True) may hold: requests in flight plus handles
    # not yet closed. Past it, return_kv requests raise KVBudgetExceeded.
    max_kv_export_bytes: int = 2 << 30
    # For str prompts: a Tokenizer, or the path of a checkpoint directory / .gguf file. None:
    # the model's own (a PaddleModel whose weights hold one), else no text prompts.
    tokenizer: Tokenizer | str | os.PathLike[str] | None = None
    # "mooncake": every KV export is registered with a Mooncake transfer engine and
    # `kv.transfer_params()` tells a decode node how to pull it (aioprefill.transfer).
    kv_transfer: str | None = None
    kv_transfer_options: TransferOptions = field(default_factory=TransferOptions)
    # Prefix cache, per worker process (every rank of a group): bytes of full blocks of
    # `prefix_block_tokens` prompt tokens kept for later prompts that start the same way
    # (touched as used, so memory grows with use); 0 turns it off. docs/prefix-cache.md.
    prefix_cache_bytes: int = 1 << 30
    prefix_block_tokens: int = 16
    # "tcp://HOST:PORT": publish the prefix cache's blocks there as vLLM KV events (ZMQ PUB)
    # for vllm-router's --policy kv_aware; a replay of recent ones is served on
    # kv_events_replay_endpoint (None: the same host, PORT + 1). See docs/kv-events.md.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    # "mooncake": a Mooncake Store is the prefix cache's second tier, shared by every worker
    # of every engine that names the same master (aioprefill.kvstore, docs/kv-store.md).
    kv_store: str | None = None
    kv_store_options: KVStoreOptions = field(default_factory=KVStoreOptions)

    def __post_init__(self) -> None:
        _require(
            isinstance(self.model, (SimModel, PaddleModel)),
            "EngineConfig.model",
            f"must be SimModel(...) or PaddleModel(...), got {type(self.model).__name__}",
        )
        if isinstance(self.model, PaddleModel):
            _require_paddle_installed()
        _positive_int(self.num_workers, "EngineConfig.num_workers")
        _require(
            self.policy in POLICIES,
            "EngineConfig.policy",
            f"must be one of {', '.join(POLICIES)}; got {self.policy!r}",
        )
        _positive_int(self.max_batch_tokens, "EngineConfig.max_batch_tokens")
        _positive_int(self.max_batch_size, "EngineConfig.max_batch_size")
        _finite_nonneg(self.batch_timeout_ms, "EngineConfig.batch_timeout_ms")
        _positive_int(self.max_pending, "EngineConfig.max_pending")
        if self.max_prompt_tokens is None:
            self.max_prompt_tokens = self.model.max_prompt_tokens
        _positive_int(self.max_prompt_tokens, "EngineConfig.max_prompt_tokens")
        _require(
            self.max_prompt_tokens <= self.model.max_position_embeddings,
            "EngineConfig.max_prompt_tokens",
            f"{self.max_prompt_tokens} exceeds the model's max_position_embeddings "
            f"({self.model.max_position_embeddings})",
        )
        window = getattr(self.model, "sliding_window", None)
        _require(
            window is None or self.max_prompt_tokens <= window,
            "EngineConfig.max_prompt_tokens",
            f"{self.max_prompt_tokens} exceeds the model's sliding_window ({window}): "
            "prompts longer than the window are not supported",
        )
        _require(
            self.enable_chunked_prefill or self.max_prompt_tokens <= self.max_batch_tokens,
            "EngineConfig.max_prompt_tokens",
            f"{self.max_prompt_tokens} exceeds max_batch_tokens={self.max_batch_tokens} "
            "and enable_chunked_prefill is off",
        )
        if isinstance(self.model, PaddleModel):
            from aioprefill.hf import check_spec_against_config

            check_spec_against_config(self.model)
        _positive_int(self.max_retries, "EngineConfig.max_retries", allow_zero=True)
        if self.forward_timeout_s is not None:
            _finite_nonneg(self.forward_timeout_s, "EngineConfig.forward_timeout_s")
            _require(self.forward_timeout_s > 0, "EngineConfig.forward_timeout_s", "must be > 0")
        _finite_nonneg(self.worker_start_timeout_s, "EngineConfig.worker_start_timeout_s")
        _positive_int(self.max_restarts, "EngineConfig.max_restarts", allow_zero=True)
        _finite_nonneg(self.restart_window_s, "EngineConfig.restart_window_s")
        _require(
            self.start_method in (None, "spawn", "forkserver"),
            "EngineConfig.start_method",
            f"must be None, 'spawn' or 'forkserver' (never 'fork'); got {self.start_method!r}",
        )
        _finite_nonneg(self.shutdown_timeout_s, "EngineConfig.shutdown_timeout_s")
        if isinstance(self.model, PaddleModel) and self.model.is_encoder:
            _check_encoder(self)
        check_parallel(
            self.model, self.num_workers, self.tp_size, self.expert_parallel, self.policy
        )
        _positive_int(self.max_kv_export_bytes, "EngineConfig.max_kv_export_bytes", allow_zero=True)
        _check_kv_transfer(self.kv_transfer, self.kv_transfer_options)
        _positive_int(self.prefix_cache_bytes, "EngineConfig.prefix_cache_bytes", allow_zero=True)
        _positive_int(self.prefix_block_tokens, "EngineConfig.prefix_block_tokens")
        _require(
            self.prefix_block_tokens <= 4096,
            "EngineConfig.prefix_block_tokens",
            f"must be at most 4096, got {self.prefix_block_tokens}",
        )
        _check_kv_events(self.kv_events_endpoint, self.kv_events_replay_endpoint)
        _require(
            self.kv_events_endpoint is None or self.prefix_cache_bytes > 0,
            "EngineConfig.kv_events_endpoint",
            "publishes the prefix cache's blocks: needs prefix_cache_bytes > 0",
        )
        _check_kv_store(self.kv_store, self.kv_store_options)
        _require(
            self.kv_store is None or self.prefix_cache_bytes > 0,
            "EngineConfig.kv_store",
            "the store is the prefix cache's second tier: it needs prefix_cache_bytes > 0",
        )
        _require(
            self.kv_store is None or self.tp_size == 1,
            "EngineConfig.kv_store",
            "not with tp_size > 1 yet (a group's ranks would first have to agree on the blocks "
            "they loaded)",
        )
        if self.ring_capacity is not None:
            _positive_int(self.ring_capacity, "EngineConfig.ring_capacity")
            _require(
                self.ring_capacity >= self.min_ring_capacity(),
                "EngineConfig.ring_capacity",
                f"{self.ring_capacity} bytes cannot hold a full batch; "
                f"need >= {self.min_ring_capacity()}",
            )
        self.tokenizer = resolve_tokenizer(self.tokenizer, self.model)

    def min_ring_capacity(self) -> int:
        """Bytes one full batch frame can take: int32 tokens + per-request columns + slack."""
        # request id, offset, start position, prompt length, flags; output options, top_k and
        # a KV export's segment name (~50 bytes of msgpack str) when a request asks for them.
        per_request = 8 + 4 + 4 + 4 + 1 + 1 + 4 + 64 + 12  # (+ prefix cache offsets)
        types = self.max_batch_tokens if getattr(self.model, "is_encoder", False) else 0
        return (4 * self.max_batch_tokens + types) + per_request * (self.max_batch_size + 1) + 4096

    def effective_ring_capacity(self) -> int:
        """The ring size used: room for at least four full batches, a power of two >= 1 MiB."""
        if self.ring_capacity is not None:
            return self.ring_capacity
        need = 4 * self.min_ring_capacity()
        return max(1 << 20, 1 << (need - 1).bit_length())
