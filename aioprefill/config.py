"""Typed, validated configuration: `EngineConfig` and the two model specs.

Model specs (`SimModel`, `PaddleModel`) are frozen msgspec Structs: the engine sends them to
worker processes msgspec-encoded, never pickled. Every field is checked once, at construction,
and a bad one raises `InvalidConfig` naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from aioprefill.errors import InvalidConfig
from aioprefill.parallel import check_parallel

__all__ = ["POLICIES", "EngineConfig", "ModelSpec", "PaddleModel", "SimModel"]

POLICIES = ("forward", "eager", "timeout", "ep-timer")  # ep-timer: a baseline, see parallel.py


def _require(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise InvalidConfig(f"{name}: {why}")


def _positive_int(value: object, name: str, *, allow_zero: bool = False) -> None:
    _require(
        isinstance(value, int) and not isinstance(value, bool),
        name,
        f"must be an int, got {value!r}",
    )
    assert isinstance(value, int)
    _require(
        value >= (0 if allow_zero else 1), name, f"must be >= {0 if allow_zero else 1}, got {value}"
    )


def _finite_nonneg(value: object, name: str) -> None:
    _require(
        isinstance(value, (int, float)) and not isinstance(value, bool),
        name,
        f"must be a number, got {value!r}",
    )
    assert isinstance(value, (int, float))
    _require(math.isfinite(value) and value >= 0, name, f"must be finite and >= 0, got {value}")


class SimModel(msgspec.Struct, frozen=True, kw_only=True, tag="sim"):
    """A worker whose forward sleeps `fixed_ms + per_token_us*tokens + attn_ns*sum(len^2)`.

    It returns a deterministic token per request (a CRC32 of the prompt's int32 bytes, modulo
    `vocab_size`), so tests can check that every result reaches its caller. See
    `aioprefill.workers.sim.expected_token`.
    """

    fixed_ms: float = 15.0
    per_token_us: float = 20.0
    attn_ns: float = 0.0
    vocab_size: int = 32000
    max_position_embeddings: int = 1 << 20
    # Fault injection for tests and drills: a forward whose batch holds this token id raises
    # (fail_token), kills its worker process (crash_token), or hangs for an hour (hang_token).
    fail_token: int = -1
    crash_token: int = -1
    hang_token: int = -1
    # ... and in a group of ranks, rank `slow_rank` answers each batch `slow_rank_ms` after the
    # step's barrier (a straggler's late answer, for the tensor-parallel race tests).
    slow_rank: int = -1
    slow_rank_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("fixed_ms", "per_token_us", "attn_ns", "slow_rank_ms"):
            _finite_nonneg(getattr(self, name), f"SimModel.{name}")
        _positive_int(self.vocab_size, "SimModel.vocab_size")
        _positive_int(self.max_position_embeddings, "SimModel.max_position_embeddings")

    def forward_seconds(self, seq_lens: list[int]) -> float:
        """The cost model: how long one forward over these (chunk) lengths sleeps."""
        tokens = sum(seq_lens)
        square = sum(n * n for n in seq_lens)
        return (
            self.fixed_ms * 1e-3 + self.per_token_us * 1e-6 * tokens + self.attn_ns * 1e-9 * square
        )


class PaddleModel(msgspec.Struct, frozen=True, kw_only=True, tag="paddle"):
    """A Llama-style decoder run by PaddlePaddle inside each worker process.

    `PaddleModel(seed=0)` is the tiny model of the design brief: 4 layers, hidden 256, 8 heads
    (4 KV heads), FFN 768, vocab 32000, about 19.6 M parameters. `weights=` loads a safetensors
    file with Hugging Face Llama tensor names instead of random initialisation.

    `num_experts > 0` makes every layer's MLP a Mixtral-style mixture of experts: a router
    (`block_sparse_moe.gate`) picks `num_experts_per_tok` experts per token, each an
    `intermediate_size` SwiGLU MLP (`block_sparse_moe.experts.{e}.w1/w2/w3`). The spec always
    describes the whole model; how it is split over ranks is the engine's setting.
    """

    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 768
    vocab_size: int = 32000
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    seed: int = 0
    weights: str | None = None
    device: Literal["auto", "cpu", "gpu"] = "auto"
    num_threads: int = 1
    deterministic: bool = False
    num_experts: int = 0  # 0: dense MLPs
    num_experts_per_tok: int = 2

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
            "num_threads",
        ):
            _positive_int(getattr(self, name), f"PaddleModel.{name}")
        _require(
            self.hidden_size % self.num_heads == 0,
            "PaddleModel.hidden_size",
            f"{self.hidden_size} is not divisible by num_heads={self.num_heads}",
        )
        _require(
            self.num_heads % self.num_kv_heads == 0,
            "PaddleModel.num_kv_heads",
            f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}",
        )
        _require(
            (self.hidden_size // self.num_heads) % 2 == 0,
            "PaddleModel.num_heads",
            "head_dim (hidden_size // num_heads) must be even for RoPE",
        )
        _finite_nonneg(self.rope_theta, "PaddleModel.rope_theta")
        _finite_nonneg(self.rms_norm_eps, "PaddleModel.rms_norm_eps")
        _require(isinstance(self.seed, int), "PaddleModel.seed", "must be an int")
        _positive_int(self.num_experts, "PaddleModel.num_experts", allow_zero=True)
        _positive_int(self.num_experts_per_tok, "PaddleModel.num_experts_per_tok")
        if self.num_experts:
            _require(
                self.num_experts_per_tok <= self.num_experts,
                "PaddleModel.num_experts_per_tok",
                f"{self.num_experts_per_tok} exceeds num_experts={self.num_experts}",
            )
            _require(
                not self.deterministic,
                "PaddleModel.deterministic",
                "bitwise batch invariance is not implemented for mixture-of-experts layers",
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


ModelSpec = SimModel | PaddleModel


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

    def __post_init__(self) -> None:
        _require(
            isinstance(self.model, (SimModel, PaddleModel)),
            "EngineConfig.model",
            f"must be SimModel(...) or PaddleModel(...), got {type(self.model).__name__}",
        )
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
            self.max_prompt_tokens = self.model.max_position_embeddings
        _positive_int(self.max_prompt_tokens, "EngineConfig.max_prompt_tokens")
        _require(
            self.max_prompt_tokens <= self.model.max_position_embeddings,
            "EngineConfig.max_prompt_tokens",
            f"{self.max_prompt_tokens} exceeds the model's max_position_embeddings "
            f"({self.model.max_position_embeddings})",
        )
        _require(
            self.enable_chunked_prefill or self.max_prompt_tokens <= self.max_batch_tokens,
            "EngineConfig.max_prompt_tokens",
            f"{self.max_prompt_tokens} exceeds max_batch_tokens={self.max_batch_tokens} "
            "and enable_chunked_prefill is off",
        )
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
        check_parallel(
            self.model, self.num_workers, self.tp_size, self.expert_parallel, self.policy
        )
        if self.ring_capacity is not None:
            _positive_int(self.ring_capacity, "EngineConfig.ring_capacity")
            _require(
                self.ring_capacity >= self.min_ring_capacity(),
                "EngineConfig.ring_capacity",
                f"{self.ring_capacity} bytes cannot hold a full batch; "
                f"need >= {self.min_ring_capacity()}",
            )

    def min_ring_capacity(self) -> int:
        """Bytes one full batch frame can take: int32 tokens + per-request columns + slack."""
        per_request = 8 + 4 + 4 + 4 + 1  # request id, offset, start position, prompt length, flags
        return 4 * self.max_batch_tokens + per_request * (self.max_batch_size + 1) + 4096

    def effective_ring_capacity(self) -> int:
        """The ring size used: room for at least four full batches, a power of two >= 1 MiB."""
        if self.ring_capacity is not None:
            return self.ring_capacity
        need = 4 * self.min_ring_capacity()
        return max(1 << 20, 1 << (need - 1).bit_length())
