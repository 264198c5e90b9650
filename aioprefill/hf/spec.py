"""`ModelShape`: what the checkpoint readers read of a model spec, as a protocol; `SHAPE_KEYS`,
the config.json keys every reader copies into it.

`aioprefill.models.PaddleModel` satisfies it; `hf` sits below the specs and never imports them
(the spec class itself is passed in where one is built: `spec_from_pretrained(cls, ...)`).
"""

from __future__ import annotations

from typing import ClassVar, Protocol

# PaddleModel field <- the config.json key it copies, in every family (decoders, BERT/XLM-R,
# ModernBERT); each reader adds its own.
SHAPE_KEYS = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "num_heads": "num_attention_heads",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
}


class ModelShape(Protocol):
    """The fields of a model spec that decide which tensors a checkpoint holds and their shapes."""

    __struct_fields__: ClassVar[tuple[str, ...]]  # a msgspec Struct's field names

    @property
    def weights(self) -> str | None: ...  # a checkpoint directory or .gguf file; None: random
    @property
    def seed(self) -> int: ...  # random weights' seed when `weights` is None
    @property
    def dtype(self) -> str: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def attention_bias(self) -> bool: ...
    @property
    def qk_norm(self) -> bool: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def architecture(self) -> str: ...  # an encoder's (hf.encoder.ENCODERS) names its tensors
    @property
    def type_vocab_size(self) -> int: ...
    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def num_labels(self) -> int: ...
