"""The model specs, `SimModel` and `PaddleModel`: frozen msgspec Structs, validated at
construction (a bad field raises `InvalidConfig` naming it).

The engine sends a spec to its worker processes msgspec-encoded, never pickled. `EngineConfig`
(in `aioprefill.config`) holds one of them.
"""

from __future__ import annotations

import os
from typing import Literal

import msgspec

from aioprefill.checks import finite_nonneg as _finite_nonneg
from aioprefill.checks import positive_int as _positive_int
from aioprefill.checks import require as _require

__all__ = [
    "ARCHITECTURES",
    "ENCODER_ARCHITECTURES",
    "POOLINGS",
    "ROPE_TYPES",
    "ModelSpec",
    "PaddleModel",
    "SimModel",
]


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
    # Nominal KV bytes per token, so a prefix cache budget holds as many blocks as for a real
    # model: Llama-3-8B's (32 layers x 8 KV heads x 128 x K,V x 2 bytes = 128 KiB).
    kv_bytes_per_token: int = 131072
    # Fault injection for tests and drills: a forward whose batch holds this token id raises
    # (fail_token), kills its worker process (crash_token), or hangs for an hour (hang_token).
    fail_token: int = -1
    crash_token: int = -1
    hang_token: int = -1
    # ... and in a group of ranks, rank `slow_rank` answers each batch `slow_rank_ms` after the
    # step's barrier (a straggler's late answer, for the tensor-parallel race tests).
    slow_rank: int = -1
    slow_rank_ms: float = 0.0
    # ... and with `fail_rank` >= 0 only that rank raises on `fail_token`, before the step's
    # barrier: an out-of-step failure whose peers wait at the barrier for it (default: every
    # rank raises after the barrier, in step).
    fail_rank: int = -1

    def __post_init__(self) -> None:
        for name in ("fixed_ms", "per_token_us", "attn_ns", "slow_rank_ms"):
            _finite_nonneg(getattr(self, name), f"SimModel.{name}")
        _positive_int(self.vocab_size, "SimModel.vocab_size")
        _positive_int(self.kv_bytes_per_token, "SimModel.kv_bytes_per_token")
        _positive_int(self.max_position_embeddings, "SimModel.max_position_embeddings")
        _require(
            isinstance(self.fail_rank, int)
            and not isinstance(self.fail_rank, bool)
            and self.fail_rank >= -1,
            "SimModel.fail_rank",
            f"must be an int >= -1, got {self.fail_rank!r}",
        )

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt this model takes: its max_position_embeddings."""
        return self.max_position_embeddings

    def forward_seconds(self, seq_lens: list[int], cached: list[int] | None = None) -> float:
        """The cost model: how long one forward over these (chunk) lengths sleeps. `cached`:
        tokens each chunk reads from the prefix cache, which cost only attention over them
        (a chunk of n tokens after c cached ones: (c + n)^2 - c^2)."""
        tokens = sum(seq_lens)
        square = sum(n * n for n in seq_lens)
        if cached:
            square += 2 * sum(n * c for n, c in zip(seq_lens, cached, strict=True))
        return (
            self.fixed_ms * 1e-3 + self.per_token_us * 1e-6 * tokens + self.attn_ns * 1e-9 * square
        )


ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
)
# Bidirectional encoders (BERT, (XLM-)RoBERTa, ModernBERT): no LM head, a pooled embedding per
# prompt and, for the *ForSequenceClassification ones, the classifier's logits (embedding.md).
ENCODER_ARCHITECTURES = tuple(
    f"{family}{kind}"
    for family in ("Bert", "XLMRoberta", "Roberta", "ModernBert")
    for kind in ("Model", "ForSequenceClassification", "ForMaskedLM")
)
ARCHITECTURES += ENCODER_ARCHITECTURES
POOLINGS = ("cls", "mean", "last")
ROPE_TYPES = ("default", "linear", "llama3")


class PaddleModel(msgspec.Struct, frozen=True, kw_only=True, tag="paddle"):
    """A Llama-style decoder run by PaddlePaddle inside each worker process.

    `PaddleModel(seed=0)` is the tiny model of the design brief: 4 layers, hidden 256, 8 heads
    (4 KV heads), FFN 768, vocab 32000, about 19.6 M parameters. `weights=` loads a safetensors
    file, or a checkpoint directory (`model.safetensors` or a sharded index), with Hugging Face
    tensor names instead of random initialisation. `PaddleModel.from_pretrained(path)` reads every
    field from a Hugging Face checkpoint directory's `config.json`.

    The variants a Hugging Face architecture needs are fields: `head_dim` (0: hidden_size //
    num_heads), `attention_bias` (q/k/v projections with a bias, Qwen2), `qk_norm` (per-head RMSNorm
    on queries and keys before RoPE, Qwen3), `rope_type` "linear" / "llama3" with its `rope_*`
    parameters, and `sliding_window` (attention span; prompts longer than it are refused, since
    the forward computes full causal attention). `architecture` only names what the spec was read
    from.

    `num_experts > 0` makes every layer's MLP a Mixtral-style mixture of experts: a router
    (`block_sparse_moe.gate`) picks `num_experts_per_tok` experts per token, each an
    `intermediate_size` SwiGLU MLP (`block_sparse_moe.experts.{e}.w1/w2/w3`). The spec always
    describes the whole model; how it is split over ranks is the engine's setting.
    """

    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 0
    intermediate_size: int = 768
    vocab_size: int = 32000
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    rope_type: Literal["default", "linear", "llama3"] = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    architecture: str = "LlamaForCausalLM"
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    seed: int = 0
    weights: str | None = None
    device: Literal["auto", "cpu", "gpu"] = "auto"
    num_threads: int = 1
    deterministic: bool = False
    num_experts: int = 0  # 0: dense MLPs
    num_experts_per_tok: int = 2
    # Encoders only (ENCODER_ARCHITECTURES; all zero/None for decoders): LayerNorm's epsilon,
    # the token type table's rows, the first position id (XLM-R: padding_idx + 1), the
    # classifier's labels (0: no classifier), the model's own pooling of the last hidden states
    # and whether it L2-normalises (sentence-transformers' Pooling and Normalize modules), and
    # the longest prompt it takes (sentence-transformers' max_seq_length; 0: the position table).
    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 0
    position_offset: int = 0
    num_labels: int = 0
    pooling: Literal["cls", "mean", "last"] | None = None
    normalize: bool = False
    max_seq_length: int = 0
    # ModernBERT only (ModernBertConfig's defaults; `rope_theta`: its global layers'): the local
    # layers' window (keys at most local_attention // 2 positions away) and RoPE theta, layer i
    # global where i % global_attn_every_n_layers == 0, the classifier's pooling.
    local_attention: int = 128
    local_rope_theta: float = 10000.0
    global_attn_every_n_layers: int = 3
    classifier_pooling: Literal["cls", "mean"] = "cls"

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
            "rope_original_max_position_embeddings",
        ):
            _positive_int(getattr(self, name), f"PaddleModel.{name}")
        _positive_int(self.head_dim, "PaddleModel.head_dim", allow_zero=True)
        if self.head_dim == 0:
            _require(
                self.hidden_size % self.num_heads == 0,
                "PaddleModel.hidden_size",
                f"{self.hidden_size} is not divisible by num_heads={self.num_heads} "
                "(or set head_dim)",
            )
            # Resolved once here, so every reader (and every worker) sees the real value.
            msgspec.structs.force_setattr(self, "head_dim", self.hidden_size // self.num_heads)
        _require(
            self.num_heads % self.num_kv_heads == 0,
            "PaddleModel.num_kv_heads",
            f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}",
        )
        if self.is_encoder:
            self._check_encoder()
        _require(
            (self.is_encoder and "ModernBert" not in self.architecture) or self.head_dim % 2 == 0,
            "PaddleModel.head_dim",
            f"must be even for RoPE, got {self.head_dim}",
        )
        _finite_nonneg(self.rope_theta, "PaddleModel.rope_theta")
        _require(self.rope_theta > 0, "PaddleModel.rope_theta", "must be > 0")
        _require(
            self.rope_type in ROPE_TYPES,
            "PaddleModel.rope_type",
            f"must be one of {', '.join(ROPE_TYPES)}; got {self.rope_type!r}",
        )
        for name in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
            _finite_nonneg(getattr(self, name), f"PaddleModel.{name}")
            _require(getattr(self, name) > 0, f"PaddleModel.{name}", "must be > 0")
        if self.rope_type == "llama3":
            _require(
                self.rope_high_freq_factor > self.rope_low_freq_factor,
                "PaddleModel.rope_high_freq_factor",
                f"must exceed rope_low_freq_factor ({self.rope_low_freq_factor}) for llama3 RoPE",
            )
        _finite_nonneg(self.rms_norm_eps, "PaddleModel.rms_norm_eps")
        for name, allowed in (
            ("dtype", ("float32", "float16", "bfloat16")),
            ("device", ("auto", "cpu", "gpu")),
        ):
            _require(
                getattr(self, name) in allowed,
                f"PaddleModel.{name}",
                f"must be one of {', '.join(allowed)}; got {getattr(self, name)!r}",
            )
        for name in ("attention_bias", "qk_norm", "tie_word_embeddings", "deterministic"):
            _require(
                isinstance(getattr(self, name), bool),
                f"PaddleModel.{name}",
                f"must be a bool, got {getattr(self, name)!r}",
            )
        if self.sliding_window is not None:
            _positive_int(self.sliding_window, "PaddleModel.sliding_window")
        _require(
            self.architecture in ARCHITECTURES,
            "PaddleModel.architecture",
            f"must be one of {', '.join(ARCHITECTURES)}; got {self.architecture!r}",
        )
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
    def is_encoder(self) -> bool:
        """A bidirectional encoder (BERT, XLM-R, ModernBERT): embeddings, scores, no next token."""
        return self.architecture in ENCODER_ARCHITECTURES

    def _check_encoder(self) -> None:
        _finite_nonneg(self.layer_norm_eps, "PaddleModel.layer_norm_eps")
        _positive_int(self.type_vocab_size, "PaddleModel.type_vocab_size")
        _require(self.type_vocab_size <= 256, "PaddleModel.type_vocab_size", "must be at most 256")
        _positive_int(self.position_offset, "PaddleModel.position_offset", allow_zero=True)
        _require(
            self.position_offset < self.max_position_embeddings,
            "PaddleModel.position_offset",
            f"must be below max_position_embeddings={self.max_position_embeddings}",
        )
        _positive_int(self.num_labels, "PaddleModel.num_labels", allow_zero=True)
        classifier = self.architecture.endswith("ForSequenceClassification")
        _require(
            (self.num_labels > 0) == classifier,
            "PaddleModel.num_labels",
            f"{self.architecture} {'needs' if classifier else 'has no'} classifier labels",
        )
        _require(
            self.pooling in POOLINGS,
            "PaddleModel.pooling",
            f"must be one of {', '.join(POOLINGS)} for an encoder; got {self.pooling!r}",
        )
        _require(isinstance(self.normalize, bool), "PaddleModel.normalize", "must be a bool")
        _positive_int(self.max_seq_length, "PaddleModel.max_seq_length", allow_zero=True)
        _require(
            self.num_kv_heads == self.num_heads,
            "PaddleModel.num_kv_heads",
            "an encoder's attention has as many key/value heads as query heads",
        )
        _require(self.num_experts == 0, "PaddleModel.num_experts", "encoders have dense MLPs")
        _require(self.dtype == "float32", "PaddleModel.dtype", "encoders run float32 only (yet)")
        if self.architecture.startswith("ModernBert"):  # RoPE, local windows, its head
            for name in ("local_attention", "global_attn_every_n_layers"):
                _positive_int(getattr(self, name), f"PaddleModel.{name}")
            _finite_nonneg(self.local_rope_theta, "PaddleModel.local_rope_theta")
            _require(self.local_rope_theta > 0, "PaddleModel.local_rope_theta", "must be > 0")
            pools = ("cls", "mean")
            _require(self.classifier_pooling in pools, "PaddleModel.classifier_pooling", "cls/mean")

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], **overrides: object) -> PaddleModel:
        """The spec of a Hugging Face checkpoint directory (`config.json` plus `model.safetensors`
        or `model.safetensors.index.json` and its shards), or of a Llama GGUF file (`*.gguf`:
        the config from its metadata, quantized tensors dequantized once in each worker at load,
        into `dtype`; Q4 grows about 8x in float32), with `weights=` set to it.

        `overrides` replace fields (`device="cpu"`, `dtype="bfloat16"`, `num_threads=4`, ...)
        and show on the returned spec. `dtype` defaults to `"auto"` here (`hf.dtype`): the
        checkpoint's `torch_dtype` where the device computes it well (a CPU: bfloat16 with
        avx512_bf16 or AMX), float32 otherwise and for quantized GGUF files; `"float32"` is the
        exact mode (`PaddleModel(...)` itself defaults to float32). An architecture, RoPE type,
        quantization or any other config key that would change the forward and is not
        implemented raises `InvalidConfig` naming the key; so do tensors that do not fit
        (checked from the file headers).
        """
        from aioprefill.hf import spec_from_pretrained

        return spec_from_pretrained(cls, path, overrides)

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt this model computes exactly: its positions, and its sliding window
        (longer prompts would need the window's mask, which the forward does not apply); for
        an encoder, its max_seq_length within its position table."""
        if self.is_encoder:
            positions = self.max_position_embeddings - self.position_offset
            return min(self.max_seq_length or positions, positions)
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)


ModelSpec = SimModel | PaddleModel
