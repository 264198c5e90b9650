"""PaddleModel's architecture fields: head_dim, RoPE scaling, sliding window, validated at
construction with the field named."""

from __future__ import annotations

import pytest

from aioprefill.config import EngineConfig, PaddleModel
from aioprefill.errors import InvalidConfig


def test_head_dim_defaults_to_hidden_over_heads_and_can_differ() -> None:
    assert PaddleModel().head_dim == 32
    assert PaddleModel(hidden_size=64, num_heads=4, head_dim=32).head_dim == 32
    # An explicit head_dim frees hidden_size from being a multiple of num_heads.
    assert PaddleModel(hidden_size=100, num_heads=8, num_kv_heads=4, head_dim=16).head_dim == 16
    assert PaddleModel().max_prompt_tokens == 32768


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"hidden_size": 100}, r"hidden_size: 100 is not divisible by num_heads=8 \(or set"),
        ({"head_dim": 7}, "head_dim: must be even"),
        ({"head_dim": -2}, "head_dim: must be >= 0"),
        ({"rope_type": "yarn"}, "rope_type: must be one of default, linear, llama3"),
        ({"rope_factor": 0.0}, "rope_factor: must be > 0"),
        ({"rope_theta": 0.0}, "rope_theta: must be > 0"),
        (
            {"rope_type": "llama3", "rope_low_freq_factor": 4.0, "rope_high_freq_factor": 4.0},
            "rope_high_freq_factor: must exceed",
        ),
        ({"rope_original_max_position_embeddings": 0}, "rope_original_max_position_embeddings"),
        ({"sliding_window": 0}, "sliding_window: must be >= 1"),
        ({"architecture": "GPT2LMHeadModel"}, "architecture: must be one of LlamaForCausalLM"),
        ({"dtype": "float64"}, "dtype: must be one of"),
        ({"device": "tpu"}, "device: must be one of"),
    ],
)
def test_bad_fields_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        PaddleModel(**kwargs)


def test_sliding_window_bounds_prompts() -> None:
    model = PaddleModel(sliding_window=100)
    assert model.max_prompt_tokens == 100
    assert EngineConfig(model=model).max_prompt_tokens == 100
    assert EngineConfig(model=model, max_prompt_tokens=50).max_prompt_tokens == 50
    with pytest.raises(InvalidConfig, match=r"max_prompt_tokens: 101 exceeds .*sliding_window"):
        EngineConfig(model=model, max_prompt_tokens=101)
    assert PaddleModel(sliding_window=1 << 20).max_prompt_tokens == 32768
