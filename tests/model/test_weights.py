"""Weights: HF names and shapes, seeded random weights, safetensors round trip and its errors."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest

from aioprefill.config import PaddleModel
from aioprefill.errors import InvalidConfig
from aioprefill.hf.weights import (
    WeightsError,
    expected_shapes,
    load_weights,
    random_weights,
    save_weights,
)
from aioprefill.workers.paddle.runner import PaddleRunner
from tests.model.batches import SMALL, make_batch, prompts, runner, small


def test_default_model_is_the_tiny_llama() -> None:
    shapes = expected_shapes(PaddleModel())
    assert len(shapes) == 1 + 4 * 9 + 2
    assert shapes["model.layers.3.self_attn.k_proj.weight"] == (128, 256)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (256, 768)
    assert shapes["lm_head.weight"] == (32000, 256)
    params = sum(int(np.prod(s)) for s in shapes.values())
    assert 19.5e6 < params < 19.7e6
    assert "lm_head.weight" not in expected_shapes(small(tie_word_embeddings=True))


def test_random_weights_are_seeded() -> None:
    a, b, c = random_weights(SMALL, 1), random_weights(SMALL, 1), random_weights(SMALL, 2)
    assert a.keys() == expected_shapes(SMALL).keys()
    for name, w in a.items():
        assert w.dtype == np.float32 and w.shape == expected_shapes(SMALL)[name]
        assert np.array_equal(w, b[name])
        assert not np.array_equal(w, c[name])
    norm = a["model.layers.0.input_layernorm.weight"]
    assert 0.5 < norm.mean() < 1.5 and norm.std() > 0.01  # near 1, but not all ones


def test_safetensors_round_trip_gives_identical_outputs(tmp_path) -> None:
    path = tmp_path / "small.safetensors"
    save_weights(path, random_weights(SMALL, SMALL.seed))
    loaded = load_weights(path, SMALL)
    for name, w in random_weights(SMALL, SMALL.seed).items():
        assert np.array_equal(loaded[name], w), name
    batch = make_batch(prompts(np.random.default_rng(0), [5, 19], SMALL.vocab_size))
    from_file = PaddleRunner(small(weights=str(path), seed=999)).forward(batch)
    from_seed = runner(SMALL).forward(batch)
    assert np.array_equal(from_file.tokens, from_seed.tokens)
    assert np.array_equal(from_file.logprobs, from_seed.logprobs)


def test_half_precision_checkpoints_load_as_float32(tmp_path) -> None:
    weights = random_weights(SMALL, 0)
    name = "model.layers.1.mlp.up_proj.weight"
    path = tmp_path / "f16.safetensors"
    save_weights(path, {**weights, name: weights[name].astype(np.float16)})
    loaded = load_weights(path, SMALL)
    assert loaded[name].dtype == np.float32
    assert np.array_equal(loaded[name], weights[name].astype(np.float16).astype(np.float32))


def test_bfloat16_checkpoints_load_as_float32(tmp_path) -> None:
    # NumPy has no bfloat16, so write the file by hand: the top 16 bits of each float32.
    weights = random_weights(small(tie_word_embeddings=True), 0)
    blobs, header, offset = [], {}, 0
    for name, w in weights.items():
        raw = (w.view(np.uint32) >> 16).astype("<u2").tobytes()
        span = [offset, offset + len(raw)]
        header[name] = {"dtype": "BF16", "shape": list(w.shape), "data_offsets": span}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = tmp_path / "bf16.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    loaded = load_weights(path, small(tie_word_embeddings=True))
    for name, w in weights.items():
        truncated = (w.view(np.uint32) & 0xFFFF0000).view(np.float32)
        assert np.array_equal(loaded[name], truncated), name


def _save(tmp_path, weights: dict[str, np.ndarray]) -> str:
    path = tmp_path / "w.safetensors"
    save_weights(path, weights)
    return str(path)


def test_missing_tensor_is_named(tmp_path) -> None:
    weights = random_weights(SMALL, 0)
    del weights["model.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(WeightsError, match=r"missing tensor 'model\.layers\.1\.self_attn\.v_proj"):
        load_weights(_save(tmp_path, weights), SMALL)


def test_unexpected_tensor_is_named(tmp_path) -> None:
    weights = random_weights(SMALL, 0)
    weights["model.layers.2.input_layernorm.weight"] = np.ones(64, np.float32)
    with pytest.raises(WeightsError, match=r"unexpected tensor 'model\.layers\.2\.input_layernorm"):
        load_weights(_save(tmp_path, weights), SMALL)


def test_tied_checkpoint_with_a_stored_lm_head_ignores_it(tmp_path) -> None:
    # transformers ties lm_head to the embedding on load, whatever the file stores.
    weights = random_weights(SMALL, 0)
    tied = small(tie_word_embeddings=True)
    loaded = load_weights(_save(tmp_path, weights), tied)
    assert "lm_head.weight" not in loaded
    batch = make_batch(prompts(np.random.default_rng(1), [7, 3], SMALL.vocab_size))
    with_head = PaddleRunner(small(tie_word_embeddings=True, weights=_save(tmp_path, weights)))
    del weights["lm_head.weight"]
    without = PaddleRunner(small(tie_word_embeddings=True, weights=_save(tmp_path, weights)))
    a, b = with_head.forward(batch), without.forward(batch)
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.logprobs, b.logprobs)


def test_misshaped_tensor_is_named(tmp_path) -> None:
    weights = random_weights(SMALL, 0)
    weights["model.layers.0.mlp.gate_proj.weight"] = np.zeros((64, 128), np.float32)  # transposed
    with pytest.raises(WeightsError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape"):
        load_weights(_save(tmp_path, weights), SMALL)


def test_integer_tensor_is_refused(tmp_path) -> None:
    weights = random_weights(SMALL, 0)
    weights["model.norm.weight"] = np.ones(64, np.int32)
    with pytest.raises(WeightsError, match=r"'model\.norm\.weight' has dtype I32"):
        load_weights(_save(tmp_path, weights), SMALL)


def test_old_rotary_buffers_are_ignored(tmp_path) -> None:
    weights = random_weights(SMALL, 0)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in load_weights(
        _save(tmp_path, weights), SMALL
    )


def test_missing_and_corrupt_files(tmp_path) -> None:
    with pytest.raises(WeightsError, match="no such weights file"):
        load_weights(tmp_path / "nope.safetensors", SMALL)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(WeightsError, match="not a readable safetensors file"):
        load_weights(bad, SMALL)
    good = _save(tmp_path, random_weights(SMALL, 0))
    with open(good, "r+b") as f:  # cut the last tensor short: its byte range leaves the file
        f.truncate(f.seek(0, 2) - 4)
    with pytest.raises(WeightsError, match="lies outside the file"):
        load_weights(good, SMALL)


def test_weights_error_is_an_invalid_config(tmp_path) -> None:
    assert issubclass(WeightsError, InvalidConfig) and issubclass(WeightsError, ValueError)
    with pytest.raises(InvalidConfig):
        PaddleRunner(small(weights=str(tmp_path / "absent.safetensors")))


def test_weights_and_env_modules_do_not_import_paddle() -> None:
    # Only worker processes may import paddle; weights.py is plain NumPy.
    code = (
        "import sys, aioprefill, aioprefill.config, aioprefill.hf.weights, "
        "aioprefill.workers.paddle.env; assert 'paddle' not in sys.modules, 'paddle imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
