"""Long texts tokenized in pieces (`aioprefill.text.chunks`): the ids equal the whole
text's, and tokenizers whose splits could cross a cut are tokenized whole."""

from __future__ import annotations

import functools
import itertools
import random

import pytest

from aioprefill import Tokenizer
from aioprefill.text.chunks import PIECE_CHARS, cut, wrap_if_local
from aioprefill.text.gguf_vocab import KNOWN_SPLITS
from tests.test_tokenizer import TEXTS
from tests.tokenizer_files import SMOLLM2_DIR, smollm2_gguf

tk = pytest.importorskip("tokenizers")


@functools.cache
def smollm2() -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2_gguf())


def mixed_text(seed: int, size: int) -> str:
    rng = random.Random(seed)
    print("seed", seed)
    words = [*" ".join(TEXTS).split(" "), "", "\n", "  ", "x" * 40, "<|im_end|>", "日本"]
    out: list[str] = []
    n = 0
    while n < size:
        out.append(rng.choice(words) + rng.choice([" ", "  ", "\n", "", "\t", " "]))
        n += len(out[-1])
    return "".join(out)


def test_cut_only_at_a_space_between_letters():
    text = mixed_text(random.randrange(1 << 20), 5 * PIECE_CHARS)
    pieces = cut(text)
    assert "".join(pieces) == text and len(pieces) >= 3
    for before, after in itertools.pairwise(pieces):
        assert before[-1].isalpha() and after[0] == " " and after[1].isalpha()
    assert cut("日本語" * PIECE_CHARS) == ["日本語" * PIECE_CHARS]  # no space: whole
    assert cut("short text") == ["short text"]


@pytest.mark.parametrize("source", ["gguf", "dir"])
def test_pieces_give_the_whole_texts_ids(source):
    tok = smollm2() if source == "gguf" else Tokenizer.from_pretrained(SMOLLM2_DIR)
    assert tok._wrap == ([], [])  # SmolLM2 qualifies, and adds no special token
    text = mixed_text(random.randrange(1 << 20), 12 * PIECE_CHARS)
    assert len(cut(text)) > 5
    assert tok.encode_released(text) == tok.encode(text)
    assert tok.encode_released(text, add_special_tokens=False) == tok.encode(text)
    assert tok._offsets_released(text, True) == tok.encode_with_offsets(text)


def _backend(pre, normalizer=None, added=()):
    vocab = {c: i for i, c in enumerate(sorted(tk.pre_tokenizers.ByteLevel.alphabet()))}
    backend = tk.Tokenizer(tk.models.BPE(vocab, []))
    backend.pre_tokenizer = pre
    backend.normalizer = normalizer
    backend.add_tokens(list(added))
    return backend


def test_which_tokenizers_qualify():
    byte_level = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    no_regex = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    known = tk.pre_tokenizers.Split(tk.Regex(sorted(KNOWN_SPLITS)[0]), behavior="isolated")
    other = tk.pre_tokenizers.Split(tk.Regex(r"\w+ \w+"), behavior="isolated")
    seq = tk.pre_tokenizers.Sequence
    assert wrap_if_local(_backend(byte_level)) == ([], [])
    assert wrap_if_local(_backend(seq([known, no_regex]))) == ([], [])
    assert wrap_if_local(_backend(byte_level, tk.normalizers.NFC())) == ([], [])
    assert wrap_if_local(_backend(no_regex)) is None  # nothing splits: merges may span spaces
    assert wrap_if_local(_backend(seq([other, no_regex]))) is None
    assert wrap_if_local(_backend(byte_level, tk.normalizers.NFKC())) is None
    assert wrap_if_local(_backend(byte_level, added=[tk.AddedToken("a b")])) is None
    assert wrap_if_local(_backend(byte_level, added=[tk.AddedToken("ab", rstrip=True)])) is None
    assert wrap_if_local(_backend(byte_level, added=[tk.AddedToken("<ab>")])) == ([], [])
    words = tk.Tokenizer(tk.models.WordLevel({"a": 0, "[UNK]": 1}, "[UNK]"))
    words.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    assert wrap_if_local(words) is None


def test_special_tokens_wrap_the_whole_text_once():
    backend = _backend(tk.pre_tokenizers.ByteLevel(add_prefix_space=False))
    backend.add_special_tokens(["<s>", "</s>"])
    s, e = backend.token_to_id("<s>"), backend.token_to_id("</s>")
    backend.post_processor = tk.processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", s), ("</s>", e)]
    )
    tok = Tokenizer(backend, name_or_path="test")
    assert tok._wrap == ([s], [e])
    text = mixed_text(random.randrange(1 << 20), 4 * PIECE_CHARS)
    ids = tok.encode_released(text)
    assert ids == tok.encode(text) and ids[0] == s and ids[-1] == e
    assert ids.count(s) == 1 and ids.count(e) == 1 + text.count("</s>")
    assert tok._offsets_released(text, True) == tok.encode_with_offsets(text)
    assert tok._offsets_released(text, False) == tok.encode_with_offsets(text, False)


@pytest.mark.asyncio
async def test_encode_with_offsets_async():
    tok = smollm2()
    text = mixed_text(random.randrange(1 << 20), 3 * PIECE_CHARS)
    assert await tok.encode_with_offsets_async(text) == tok.encode_with_offsets(text)
    assert await tok.encode_with_offsets_async("hi there") == tok.encode_with_offsets("hi there")
