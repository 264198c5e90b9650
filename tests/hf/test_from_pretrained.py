"""PaddleModel.from_pretrained: what config.json sets, overrides, both RoPE spellings, and every
refusal (each names the key), all at from_pretrained, before any engine starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest

from aioprefill import EngineConfig, PaddleModel
from aioprefill.config import ARCHITECTURES
from aioprefill.errors import InvalidConfig
from aioprefill.hf.config import spec_fields
from aioprefill.hf.tensors import WeightsError
from tests.hf.goldens import DATA, copy_with_config


def test_config_fields_reach_the_spec() -> None:
    spec = PaddleModel.from_pretrained(DATA / "llama3_rope")
    assert spec.architecture == "LlamaForCausalLM"
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (2, 64, 4, 2)
    assert (spec.head_dim, spec.vocab_size, spec.max_position_embeddings) == (16, 1000, 256)
    assert (spec.rope_type, spec.rope_theta, spec.rope_factor) == ("llama3", 500000.0, 8.0)
    assert spec.rope_original_max_position_embeddings == 32
    assert spec.weights == str((DATA / "llama3_rope").resolve())
    assert PaddleModel.from_pretrained(DATA / "llama_theta_eps").rms_norm_eps == 1e-5
    tied = PaddleModel.from_pretrained(DATA / "llama_head_dim_tied")
    assert tied.head_dim == 32 and tied.tie_word_embeddings
    qwen2 = PaddleModel.from_pretrained(DATA / "qwen2_bias")
    assert qwen2.attention_bias and not qwen2.qk_norm and qwen2.sliding_window is None
    assert qwen2.rope_theta == 1e6
    qwen3 = PaddleModel.from_pretrained(DATA / "qwen3_qk_norm")
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.architecture == ARCHITECTURES[3]
    mixtral = PaddleModel.from_pretrained(DATA / "mixtral_moe")
    assert mixtral.architecture == "MixtralForCausalLM"
    assert (mixtral.num_experts, mixtral.num_experts_per_tok) == (4, 2)
    assert (mixtral.rope_theta, mixtral.rms_norm_eps, mixtral.sliding_window) == (1e6, 1e-5, None)


def test_mixtral_defaults_are_transformers_defaults() -> None:
    """Keys a Mixtral config.json leaves out take MixtralConfig's defaults, not Llama's: 8
    experts, 2 per token, eps 1e-5, theta 1e6, no sliding window."""
    config = json.loads((DATA / "mixtral_moe" / "config.json").read_text())
    for key in (
        "num_local_experts",
        "num_experts_per_tok",
        "rms_norm_eps",
        "rope_theta",
        "sliding_window",
        "max_position_embeddings",
    ):
        del config[key]
    fields = spec_fields(config)
    assert (fields["num_experts"], fields["num_experts_per_tok"]) == (8, 2)
    assert (fields["rms_norm_eps"], fields["rope_theta"]) == (1e-5, 1e6)
    assert "sliding_window" not in fields and fields["max_position_embeddings"] == 4096 * 32


def test_mixtral_keys_that_load(tmp_path: Path) -> None:
    """The router's training-only keys (jitter noise, aux loss, returning router logits) load
    with any value, and transformers' alias num_experts stands for num_local_experts."""
    golden = PaddleModel.from_pretrained(DATA / "mixtral_moe")
    training = copy_with_config(
        tmp_path / "a",
        "mixtral_moe",
        router_jitter_noise=0.5,
        router_aux_loss_coef=1.0,
        output_router_logits=True,
    )
    assert msgspec.structs.replace(PaddleModel.from_pretrained(training), weights=None) == (
        msgspec.structs.replace(golden, weights=None)
    )
    alias = copy_with_config(tmp_path / "b", "mixtral_moe", num_local_experts=None, num_experts=4)
    assert PaddleModel.from_pretrained(alias).num_experts == 4
    both = copy_with_config(tmp_path / "c", "mixtral_moe", num_experts=4)
    assert PaddleModel.from_pretrained(both).num_experts == 4
    window = copy_with_config(tmp_path / "d", "mixtral_moe", sliding_window=64)
    assert PaddleModel.from_pretrained(window).max_prompt_tokens == 64  # as Mistral's
    # Bitwise batch invariance is not implemented for expert layers: refused, not ignored.
    with pytest.raises(InvalidConfig, match=r"PaddleModel\.deterministic: .*mixture-of-experts"):
        PaddleModel.from_pretrained(DATA / "mixtral_moe", deterministic=True)


def test_overrides_show_on_the_spec_and_it_travels() -> None:
    spec = PaddleModel.from_pretrained(
        DATA / "qwen2_bias", device="cpu", dtype="bfloat16", num_threads=2, deterministic=True
    )
    assert (spec.device, spec.dtype, spec.num_threads, spec.deterministic) == (
        "cpu",
        "bfloat16",
        2,
        True,
    )
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(spec), type=PaddleModel)
    assert wire == spec
    with pytest.raises(InvalidConfig, match="unknown field 'threads'"):
        PaddleModel.from_pretrained(DATA / "qwen2_bias", threads=2)
    with pytest.raises(InvalidConfig, match=r"PaddleModel\.device"):
        PaddleModel.from_pretrained(DATA / "qwen2_bias", device="tpu")


def test_both_rope_spellings_give_the_same_spec(tmp_path: Path) -> None:
    old = PaddleModel.from_pretrained(DATA / "llama3_rope")
    config = json.loads((DATA / "llama3_rope" / "config.json").read_text())
    params = {"rope_theta": config["rope_theta"], **config["rope_scaling"]}
    new = copy_with_config(
        tmp_path, "llama3_rope", rope_scaling=None, rope_theta=None, rope_parameters=params
    )
    assert msgspec.structs.replace(PaddleModel.from_pretrained(new), weights=old.weights) == old
    # Old files spell the type "type".
    legacy = {**config["rope_scaling"], "type": "llama3"}
    del legacy["rope_type"]
    older = copy_with_config(tmp_path / "x", "llama3_rope", rope_scaling=legacy)
    assert PaddleModel.from_pretrained(older).rope_type == "llama3"


def test_sliding_window_keys() -> None:
    mistral = PaddleModel.from_pretrained(DATA / "mistral_window")
    assert mistral.sliding_window == 128 and mistral.max_prompt_tokens == 128
    assert EngineConfig(model=mistral).max_prompt_tokens == 128
    with pytest.raises(InvalidConfig, match=r"max_prompt_tokens: 200 exceeds .*sliding_window"):
        EngineConfig(model=mistral, max_prompt_tokens=200)


def test_sliding_window_variants_that_load(tmp_path: Path) -> None:
    # Mistral v0.2+ files: "sliding_window": null. Qwen2 with use_sliding_window: the window
    # bounds prompts like Mistral's. A window past max_position_embeddings bounds nothing.
    none = copy_with_config(tmp_path / "a", "mistral_window", sliding_window=None)
    assert PaddleModel.from_pretrained(none).sliding_window == 4096  # transformers' default
    null = tmp_path / "b" / "mistral_window"
    shutil.copytree(DATA / "mistral_window", null)
    config = json.loads((null / "config.json").read_text())
    (null / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    assert PaddleModel.from_pretrained(null).sliding_window is None
    used = copy_with_config(
        tmp_path / "c", "qwen2_bias", use_sliding_window=True, sliding_window=64
    )
    assert PaddleModel.from_pretrained(used).max_prompt_tokens == 64
    long = copy_with_config(tmp_path / "d", "mistral_window", sliding_window=100000)
    assert PaddleModel.from_pretrained(long).max_prompt_tokens == 256


@pytest.mark.parametrize(
    "golden, changes, message",
    [
        ("llama_theta_eps", {"architectures": ["GPT2LMHeadModel"]}, r"architectures: .*GPT2"),
        (
            "llama_theta_eps",
            {"architectures": None, "model_type": "gpt2"},
            "architectures: None is not supported",
        ),
        ("llama_theta_eps", {"pruned_heads": {"0": [1]}}, "pruned_heads: .* is not supported"),
        ("llama_theta_eps", {"per_layer_config": {"0": {}}}, "per_layer_config: not implemented"),
        ("llama_theta_eps", {"model_type": "gemma"}, "model_type: 'gemma'"),
        (
            "llama_theta_eps",
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
            r"rope_parameters\.rope_type: 'yarn' is not supported",
        ),
        (
            "llama3_rope",
            {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
            r"rope_scaling\.rope_type: 'dynamic' is not supported",
        ),
        (
            "llama3_rope",
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            r"rope_scaling\.\w+: missing for rope_type 'llama3'",
        ),
        (
            "llama_linear_sharded",
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "beta_fast": 32}},
            r"rope_parameters\.beta_fast: not implemented",
        ),
        (
            "llama_theta_eps",
            {"rope_parameters": {"full_attention": {"rope_type": "default"}}},
            "rope_parameters: per-layer-type",
        ),
        (
            "llama_theta_eps",
            {"rope_parameters": {"rope_theta": 1e4, "attention_factor": 0.5}},
            r"rope_parameters\.attention_factor",
        ),
        ("llama_theta_eps", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        (
            "llama_theta_eps",
            {"quantization_config": {"quant_method": "gptq", "bits": 4}},
            "quantization_config: quantized checkpoints are not supported",
        ),
        ("llama_theta_eps", {"hidden_act": "gelu"}, "hidden_act: 'gelu' is not supported"),
        ("llama_theta_eps", {"mlp_bias": True}, "mlp_bias: True is not supported"),
        ("llama_theta_eps", {"attention_bias": True}, "attention_bias: true is not supported"),
        ("qwen3_qk_norm", {"attention_bias": True}, "attention_bias: true is not supported"),
        ("llama_theta_eps", {"logit_softcapping": 30.0}, "logit_softcapping: not implemented"),
        ("llama_theta_eps", {"num_experts": 8}, "num_experts: not implemented"),
        ("llama_theta_eps", {"hidden_size": None}, "hidden_size: missing"),
        (
            "qwen2_bias",
            {"layer_types": ["full_attention", "chunked_attention"]},
            "layer_types: .*chunked_attention",
        ),
        ("mistral_window", {"sliding_window": -3}, "sliding_window: must be a positive int"),
        (
            "llama_theta_eps",
            {"rope_parameters": {"rope_type": "default", "rope_theta": -1}},
            r"rope_parameters\.rope_theta: must be a positive number",
        ),
        ("llama_theta_eps", {"head_dim": 15}, "head_dim: must be even"),
        ("mixtral_moe", {"num_local_experts": 0}, "num_local_experts: must be a positive int"),
        ("mixtral_moe", {"num_experts_per_tok": 2.0}, "num_experts_per_tok: must be a positive"),
        ("mixtral_moe", {"num_experts_per_tok": 5}, "num_experts_per_tok: 5 exceeds .* 4"),
        ("mixtral_moe", {"num_experts": 8}, "num_experts: 8 disagrees with num_local_experts 4"),
        # Other MoE families' routing and expert keys: each would change the forward.
        ("mixtral_moe", {"norm_topk_prob": False}, "norm_topk_prob: not implemented"),
        ("mixtral_moe", {"moe_intermediate_size": 16}, "moe_intermediate_size: not implemented"),
        ("mixtral_moe", {"shared_expert_intermediate_size": 64}, "shared_expert_inter"),
        ("mixtral_moe", {"hidden_act": "gelu"}, "hidden_act: 'gelu' is not supported"),
        ("mixtral_moe", {"model_type": "mistral"}, "model_type: 'mistral' does not match"),
        ("mixtral_moe", {"sliding_window": 0}, "sliding_window: must be a positive int"),
        ("llama_theta_eps", {"num_local_experts": 8}, "num_local_experts: not implemented"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_key(
    tmp_path: Path, golden: str, changes: dict, message: str
) -> None:
    path = copy_with_config(tmp_path, golden, **changes)
    with pytest.raises(InvalidConfig, match=message):
        PaddleModel.from_pretrained(path)


def test_missing_or_broken_files(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfig, match="not a checkpoint directory"):
        PaddleModel.from_pretrained(tmp_path / "absent")
    with pytest.raises(InvalidConfig, match=r"no config\.json"):
        PaddleModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(InvalidConfig, match="not readable JSON"):
        PaddleModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(["LlamaForCausalLM"]))
    with pytest.raises(InvalidConfig, match="not a JSON object"):
        PaddleModel.from_pretrained(tmp_path)
    config = (DATA / "llama_theta_eps" / "config.json").read_text()
    (tmp_path / "config.json").write_text(config)
    needs = r"needs model\.safetensors or model\.safetensors\.index"
    with pytest.raises(WeightsError, match=needs):
        PaddleModel.from_pretrained(tmp_path)


def test_tensors_are_checked_at_from_pretrained(tmp_path: Path) -> None:
    one_layer = copy_with_config(tmp_path / "one", "llama_theta_eps", num_hidden_layers=1)
    with pytest.raises(WeightsError, match=r"unexpected tensor 'model\.layers\.1\."):
        PaddleModel.from_pretrained(one_layer)
    sharded = tmp_path / "s"
    shutil.copytree(DATA / "llama_linear_sharded", sharded)
    shards = sorted(sharded.glob("model-*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(WeightsError, match=rf"shard '{shards[-1].name}' is not a file"):
        PaddleModel.from_pretrained(sharded)
    index = sharded / "model.safetensors.index.json"
    index.write_text('{"weight_map": 3}')
    with pytest.raises(WeightsError, match="not a readable shard index"):
        PaddleModel.from_pretrained(sharded)
    # The index names a tensor its shard does not hold.
    fresh = tmp_path / "f"
    shutil.copytree(DATA / "llama_linear_sharded", fresh)
    index = fresh / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    name = "model.norm.weight"
    others = sorted({s for s in data["weight_map"].values() if s != data["weight_map"][name]})
    data["weight_map"][name] = others[0]
    index.write_text(json.dumps(data))
    with pytest.raises(WeightsError, match=r"puts 'model\.norm\.weight' here; it is not"):
        PaddleModel.from_pretrained(fresh)


def test_weights_accepts_a_directory() -> None:
    spec = PaddleModel.from_pretrained(DATA / "llama_linear_sharded")
    by_hand = PaddleModel(
        **{**msgspec.structs.asdict(spec), "weights": str(DATA / "llama_linear_sharded")}
    )
    from aioprefill.hf.weights import load_weights

    a, b = load_weights(spec.weights, spec), load_weights(by_hand.weights, by_hand)
    assert a.keys() == b.keys() and len(a) == 1 + 2 * 9 + 2


@pytest.mark.parametrize(
    "field, value",
    [
        ("rope_theta", 1e4),
        ("num_layers", 1),
        ("weights", "/x"),
        ("qk_norm", True),
        ("num_experts", 4),
        ("num_experts_per_tok", 1),
    ],
)
def test_overriding_what_the_checkpoint_decides_is_refused(field: str, value: object) -> None:
    with pytest.raises(InvalidConfig, match=f"{field} comes from the checkpoint"):
        PaddleModel.from_pretrained(DATA / "llama_theta_eps", **{field: value})
    # A limit is not the function: a shorter max_position_embeddings is fine.
    assert PaddleModel.from_pretrained(DATA / "llama_theta_eps", max_position_embeddings=64)


def test_a_hand_written_spec_must_agree_with_config_json() -> None:
    """weights= a directory with a config.json: EngineConfig refuses a spec that would run the
    checkpoint as another function (the silent-wrong-answer case of a forgotten rope_theta)."""
    read = PaddleModel.from_pretrained(DATA / "llama_theta_eps")
    fields = msgspec.structs.asdict(read)
    assert EngineConfig(model=PaddleModel(**fields)).model == read
    for name, wrong in (("rope_theta", 10000.0), ("rms_norm_eps", 1e-6)):
        with pytest.raises(InvalidConfig, match=rf"PaddleModel\.{name} is {wrong!r} but .*gives"):
            EngineConfig(model=PaddleModel(**{**fields, name: wrong}))
    mistral = msgspec.structs.asdict(PaddleModel.from_pretrained(DATA / "mistral_window"))
    assert EngineConfig(model=PaddleModel(**{**mistral, "sliding_window": 64}))  # narrower: fine
    with pytest.raises(InvalidConfig, match=r"PaddleModel\.sliding_window is None but"):
        EngineConfig(model=PaddleModel(**{**mistral, "sliding_window": None}))
    mixtral = msgspec.structs.asdict(PaddleModel.from_pretrained(DATA / "mixtral_moe"))
    with pytest.raises(InvalidConfig, match=r"PaddleModel\.num_experts_per_tok is 1 but"):
        EngineConfig(model=PaddleModel(**{**mixtral, "num_experts_per_tok": 1}))


def test_mixtral_checkpoint_must_hold_every_expert(tmp_path: Path) -> None:
    more = copy_with_config(tmp_path, "mixtral_moe", num_local_experts=8)
    with pytest.raises(WeightsError, match=r"missing tensor 'model\.layers\.0\.block_sparse_moe\."):
        PaddleModel.from_pretrained(more)
