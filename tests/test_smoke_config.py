import pytest

from aioprefill.config import EngineConfig, PaddleModel, SimModel
from aioprefill.errors import InvalidConfig


def test_defaults_validate():
    cfg = EngineConfig()
    assert cfg.policy == "forward"
    assert cfg.max_prompt_tokens == SimModel().max_position_embeddings
    assert EngineConfig(model=PaddleModel(seed=0)).max_prompt_tokens == 32768


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num_workers": 0}, "num_workers"),
        ({"policy": "fifo"}, "policy"),
        ({"max_batch_tokens": -1}, "max_batch_tokens"),
        ({"batch_timeout_ms": float("nan")}, "batch_timeout_ms"),
        ({"model": "sim"}, "model"),
        ({"max_prompt_tokens": 1 << 30}, "max_prompt_tokens"),
    ],
)
def test_bad_fields_name_themselves(kwargs, field):
    with pytest.raises(InvalidConfig, match=field):
        EngineConfig(**kwargs)


def test_model_spec_validation():
    with pytest.raises(InvalidConfig, match="num_kv_heads"):
        PaddleModel(num_heads=8, num_kv_heads=3)
    with pytest.raises(ValueError, match="fixed_ms"):
        SimModel(fixed_ms=-1)
    for bad in (-2, True, 1.0):
        with pytest.raises(InvalidConfig, match=r"SimModel\.fail_rank"):
            SimModel(fail_rank=bad)
