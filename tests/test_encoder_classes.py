"""The other classes encoder checkpoints are published under (docs/embedding.md, "Encoder
models"): `*ForMaskedLM` (bert-base-uncased, xlm-roberta-base, answerdotai/ModernBERT-base: the
`architectures` of many embedding models' directories) loads as its base model, its masked-LM
head not read; `RobertaModel` / `RobertaForSequenceClassification` (all-distilroberta-v1,
stsb-roberta cross-encoders) is XLM-R's forward under model_type "roberta".

Each checkpoint here is one of the committed synthetic ones (tests/data/encoder, saved by
transformers) re-saved under the other class's tensor names, with a masked-LM head of random
tensors beside it: every class must give the same model the same bits, and the base model's
states equal transformers' (the committed goldens). In-process runners: no engine to start."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from aioprefill import PaddleModel
from aioprefill.errors import InvalidConfig
from aioprefill.workers.runner import ForwardBatch
from tests.encoder_models import DATA, classifier_dir, classifier_goldens, runner_embeddings


def _resave(src: Path, dst: Path, arch: str, rename, extra: dict[str, np.ndarray], **config):
    """`src`'s checkpoint as class `arch`: tensors renamed (None: dropped), `extra` added."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.npy"))
    tensors = {}
    for name, t in load_file(src / "model.safetensors").items():
        new = rename(name)
        if new is not None:
            tensors[new] = t
    save_file({**tensors, **extra}, str(dst / "model.safetensors"))
    c = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**c, "architectures": [arch], **config}))
    return dst


def _noise(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.normal(size=shape).astype(np.float32)


def _base_of(prefix: str):
    """A classifier's tensor name -> its base model's (None: the classifier head)."""
    return lambda n: n[len(prefix) :] if n.startswith(prefix) else None


@pytest.mark.parametrize("name", ["bert_cls", "xlmr_cls"])
def test_masked_lm_and_roberta_classes_load_the_same_model(name: str, tmp_path: Path) -> None:
    from aioprefill.workers.paddle.encoder import EncoderRunner

    rng = np.random.default_rng(0)
    src = classifier_dir(name)
    prompts = [p["input_ids"] for p in classifier_goldens(name)]
    want = runner_embeddings(EncoderRunner(PaddleModel.from_pretrained(src)), prompts)
    spec = PaddleModel.from_pretrained(src)
    h, vocab = spec.hidden_size, spec.vocab_size
    if name == "bert_cls":
        prefix, base_arch, mlm_arch = "bert.", "BertModel", "BertForMaskedLM"
        head = {  # BertForMaskedLM's head (its decoder weight tied to the embeddings)
            "cls.predictions.bias": _noise(rng, vocab),
            "cls.predictions.transform.dense.weight": _noise(rng, h, h),
            "cls.predictions.transform.dense.bias": _noise(rng, h),
            "cls.predictions.transform.LayerNorm.weight": _noise(rng, h),
            "cls.predictions.transform.LayerNorm.bias": _noise(rng, h),
        }
        others: list[tuple[str, dict]] = []
    else:
        prefix, base_arch, mlm_arch = "roberta.", "XLMRobertaModel", "XLMRobertaForMaskedLM"
        head = {
            "lm_head.dense.weight": _noise(rng, h, h),
            "lm_head.dense.bias": _noise(rng, h),
            "lm_head.layer_norm.weight": _noise(rng, h),
            "lm_head.layer_norm.bias": _noise(rng, h),
            "lm_head.bias": _noise(rng, vocab),
        }
        roberta = {"model_type": "roberta"}
        others = [("RobertaModel", roberta), ("RobertaForMaskedLM", roberta)]
    base = _base_of(prefix)
    # a base model's directory: names without the prefix, the classifier's pooler dropped
    keep = lambda n: None if base(n) is None or "pooler." in n else base(n)  # noqa: E731
    dirs = {base_arch: _resave(src, tmp_path / "base", base_arch, keep, {})}
    mlm = lambda n: None if base(n) is None or "pooler." in n else n  # noqa: E731
    dirs[mlm_arch] = _resave(src, tmp_path / "mlm", mlm_arch, mlm, head)
    for arch, config in others:
        rename = keep if arch.endswith("Model") else mlm
        dirs[arch] = _resave(src, tmp_path / arch, arch, rename,
                             {} if arch.endswith("Model") else head, **config)  # fmt: skip
    if name == "xlmr_cls":  # RoBERTa's classifier is XLM-R's
        dirs["RobertaForSequenceClassification"] = _resave(
            src, tmp_path / "rcls", "RobertaForSequenceClassification", lambda n: n, {},
            model_type="roberta",
        )  # fmt: skip
    for arch, d in dirs.items():
        got = PaddleModel.from_pretrained(d)
        assert got.architecture == arch and got.is_encoder
        assert got.position_offset == spec.position_offset, arch  # RoBERTa's pad + 1 too
        runner = EncoderRunner(got)
        np.testing.assert_array_equal(runner_embeddings(runner, prompts), want, err_msg=arch)
        if arch.endswith("ForSequenceClassification"):
            ids = prompts[0]
            out = runner.forward(
                ForwardBatch(np.zeros(1, np.int64), np.array([0, len(ids)], np.int32),
                             np.array(ids, np.int32), np.zeros(1, np.int32), np.ones(1, bool))
            )  # fmt: skip
            logit = classifier_goldens(name)[0]["logit"]
            np.testing.assert_allclose(out.scores[0, 0], logit, atol=1e-5, rtol=0)


def test_modernbert_masked_lm_is_its_base_model(tmp_path: Path) -> None:
    from aioprefill.workers.paddle.modernbert import ModernBertRunner

    src = DATA / "modernbert"
    expected = json.loads((src / "expected.json").read_text())
    prompts = expected["input_ids"]
    spec = PaddleModel.from_pretrained(src)  # mean pooling + Normalize
    rng = np.random.default_rng(1)
    h, vocab = spec.hidden_size, spec.vocab_size
    head = {
        "head.dense.weight": _noise(rng, h, h),
        "head.norm.weight": _noise(rng, h),
        "decoder.bias": _noise(rng, vocab),
    }
    d = _resave(src, tmp_path / "mlm", "ModernBertForMaskedLM", lambda n: f"model.{n}", head)
    got = PaddleModel.from_pretrained(d)
    assert got.architecture == "ModernBertForMaskedLM" and got.num_labels == 0
    assert (got.pooling, got.normalize) == (spec.pooling, spec.normalize)
    want = np.load(src / "embeddings.npy")  # sentence-transformers' encode
    out = runner_embeddings(ModernBertRunner(got), prompts)
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(out, runner_embeddings(ModernBertRunner(spec), prompts))


def test_a_masked_lm_checkpoint_without_its_base_prefix_is_refused(tmp_path: Path) -> None:
    """The head is skipped by name only: base-model tensors under the wrong names still fail
    the load, naming a tensor (the loader's check that every expected tensor is present)."""
    from aioprefill.workers.paddle.encoder import EncoderRunner

    src = classifier_dir("bert_cls")
    d = _resave(src, tmp_path / "bad", "BertForMaskedLM", _base_of("bert."), {})
    with pytest.raises(InvalidConfig, match="bert\\."):
        EncoderRunner(PaddleModel.from_pretrained(d))


def test_the_spec_and_the_config_reader_know_the_same_classes() -> None:
    from aioprefill.hf.encoder import ENCODERS
    from aioprefill.models import ENCODER_ARCHITECTURES

    assert sorted(ENCODER_ARCHITECTURES) == sorted(ENCODERS)
