"""`Tokenizer`: from SmolLM2's GGUF file and from a checkpoint directory; the API a server uses
(offsets, per-token strings, batches, off-loop encoding); what is refused and how."""

from __future__ import annotations

import itertools
import json
import sys

import pytest

from aioprefill import InvalidConfig, InvalidRequestType, Tokenizer
from aioprefill.text.tokenizer import OFF_LOOP_CHARS
from tests.tokenizer_files import smollm2_gguf, write_gguf

TEXTS = [
    "The capital of France is",
    "Hello, world! Ünïcödé — naïve café, 日本語のテキスト, Ελληνικά, русский",
    "  leading spaces,   runs   of spaces\n\n\ttabs\r\nand CRLF   ",
    "def f(x):\n    return x ** 2  # 12345 + 0.5e-3\n",
    "emoji 🤗🚀👩‍👩‍👧 and flags 🇫🇷",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def gguf_tok() -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2_gguf())


def test_gguf_metadata(gguf_tok):
    assert gguf_tok.vocab_size == 49152
    assert (gguf_tok.bos_token_id, gguf_tok.eos_token_id) == (1, 2)  # <|im_start|>, <|im_end|>
    assert gguf_tok.name_or_path == str(smollm2_gguf().resolve())
    # the file says add_bos_token = False: nothing is added
    assert gguf_tok.encode("The capital of France is") == gguf_tok.encode(
        "The capital of France is", add_special_tokens=False
    )


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_offsets_and_token_strings(gguf_tok, text):
    ids = gguf_tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < gguf_tok.vocab_size for i in ids)
    assert gguf_tok.decode(ids) == text
    same, offsets = gguf_tok.encode_with_offsets(text)
    assert same == ids and len(offsets) == len(ids)
    assert offsets[0][0] == 0 and offsets[-1][1] == len(text)
    pieces = gguf_tok.token_strings(ids)
    if "\ufffd" not in "".join(pieces):  # every token whole characters: back to back
        assert pieces == [text[a:b] for a, b in offsets]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(offsets))
    else:  # tokens holding part of one character share that character's offsets
        assert all(a <= b for a, b in itertools.pairwise(offsets))


def test_special_token_text_is_one_token(gguf_tok):
    ids = gguf_tok.encode("<|im_start|>user")
    assert ids[0] == 1 and gguf_tok.token_strings(ids)[0] == "<|im_start|>"
    assert gguf_tok.decode(ids, skip_special_tokens=True) == "user"


def test_digits_are_split_one_by_one(gguf_tok):
    # the file's pre-tokenizer is "smollm": every digit its own token, as SmolLM2 was trained
    assert gguf_tok.token_strings(gguf_tok.encode("year 2024")) == ["year", " ", "2", "0", "2", "4"]


def test_empty_text_and_batch(gguf_tok):
    assert gguf_tok.encode("") == []
    assert gguf_tok.encode_batch([*TEXTS, ""]) == [gguf_tok.encode(t) for t in TEXTS] + [[]]
    with pytest.raises(InvalidRequestType, match="text must be a str, got bytes"):
        gguf_tok.encode(b"bytes")
    with pytest.raises(InvalidRequestType, match="got int"):
        gguf_tok.encode_batch(["ok", 5])


@pytest.mark.asyncio
async def test_encode_async_long_and_short(gguf_tok):
    long_text = (" ".join(TEXTS) + "\n") * (2 * OFF_LOOP_CHARS // 200 + 1)
    assert len(long_text) > OFF_LOOP_CHARS  # takes the thread path
    assert await gguf_tok.encode_async(long_text) == gguf_tok.encode(long_text)
    assert await gguf_tok.encode_async(TEXTS[0]) == gguf_tok.encode(TEXTS[0])
    with pytest.raises(InvalidRequestType):
        await gguf_tok.encode_async(["a list"])


def _save_dir(tmp_path, gguf_tok, config, post_processor=None):
    """A checkpoint directory holding the GGUF tokenizer's tokenizer.json with
    `post_processor`, and `config` as tokenizer_config.json."""
    data = json.loads(gguf_tok._backend.to_str())
    data["post_processor"] = post_processor
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


BOS_TEMPLATE = {
    "type": "TemplateProcessing",
    "single": [
        {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
        {"Sequence": {"id": "A", "type_id": 0}},
    ],
    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {
        "<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}
    },
}


def test_dir_post_processor_adds_bos(tmp_path, gguf_tok):
    config = {"bos_token": "<|endoftext|>", "eos_token": {"content": "<|im_end|>"}}
    d = _save_dir(tmp_path, gguf_tok, config, BOS_TEMPLATE)
    tok = Tokenizer.from_pretrained(d)
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 2)
    plain = gguf_tok.encode(TEXTS[0])
    assert tok.encode(TEXTS[0]) == [0, *plain]
    assert tok.encode(TEXTS[0], add_special_tokens=False) == plain
    ids, offsets = tok.encode_with_offsets(TEXTS[0])
    assert ids[0] == 0 and offsets[0] == (0, 0)
    assert tok.decode(tok.encode(TEXTS[1]), skip_special_tokens=True) == TEXTS[1]
    assert tok.name_or_path == str(d.resolve())
    # the file itself works too
    assert Tokenizer.from_pretrained(d / "tokenizer.json").encode(TEXTS[0]) == [0, *plain]


def test_dir_flags_do_not_override_tokenizer_json(tmp_path, gguf_tok):
    # transformers 5: add_bos_token / add_eos_token are dropped when a tokenizer.json exists
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "add_bos_token": True,
        "add_eos_token": True,
    }
    tok = Tokenizer.from_pretrained(_save_dir(tmp_path, gguf_tok, config))
    assert tok.encode(TEXTS[0]) == gguf_tok.encode(TEXTS[0])
    # no bos_token in tokenizer_config.json: special_tokens_map.json's
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|im_start|>"}))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert Tokenizer.from_pretrained(tmp_path).bos_token_id == 1


def test_dir_clean_up_only_for_non_bpe(tmp_path, gguf_tok):
    config = {"clean_up_tokenization_spaces": True}
    bpe = Tokenizer.from_pretrained(_save_dir(tmp_path, gguf_tok, config))
    assert bpe.decode(bpe.encode("a , b")) == "a , b"  # as transformers 5: BPE is not cleaned
    tk = pytest.importorskip("tokenizers")
    words = tk.Tokenizer(tk.models.WordLevel({"a": 0, ",": 1, "b": 2, "[UNK]": 3}, "[UNK]"))
    words.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    words.decoder = tk.decoders.WordPiece()
    d = tmp_path / "words"
    d.mkdir()
    (d / "tokenizer.json").write_text(words.to_str())
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(d)
    assert tok.encode("a , b") == [0, 1, 2] and tok.decode([0, 1, 2]) == "a, b"


def test_refusals(tmp_path, gguf_tok):
    with pytest.raises(InvalidConfig, match=r"neither a directory nor a \.gguf file"):
        Tokenizer.from_pretrained(tmp_path / "missing")
    with pytest.raises(InvalidConfig, match=r"has no tokenizer\.json$"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"spm")
    with pytest.raises(InvalidConfig, match=r"only a sentencepiece tokenizer\.model"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(InvalidConfig, match=r"not a readable GGUF file \(no GGUF magic\)"):
        Tokenizer.from_pretrained(tmp_path / "bad.gguf")
    t5 = write_gguf(
        tmp_path / "t5.gguf", {"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]}
    )
    with pytest.raises(InvalidConfig, match="GGUF tokenizer model 't5' is not supported"):
        Tokenizer.from_pretrained(t5)
    none = write_gguf(tmp_path / "none.gguf", {"general.architecture": "llama"})
    with pytest.raises(InvalidConfig, match="holds no tokenizer"):
        Tokenizer.from_pretrained(none)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2_gguf().read_bytes()[:100_000])  # ends inside the vocabulary
    runs_past = r"not a readable GGUF file \(the header runs past the end of the file\)"
    with pytest.raises(InvalidConfig, match=runs_past):
        Tokenizer.from_pretrained(cut)


def test_tiny_gguf_flags_and_spelling(tmp_path):
    tokens = ["<s>", "</s>", "a", "b", "ab", "Ġ", "Ġab", "<tool>", " x", "<ctl é>"]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 1, 1, 1, 1, 1, 4, 1, 3],
        "tokenizer.ggml.merges": ["a b", "Ġ ab"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": True,
    }
    tok = Tokenizer.from_pretrained(write_gguf(tmp_path / "tiny.gguf", meta))
    assert tok.encode("ab ab<tool>b") == [0, 4, 6, 7, 3, 1]
    assert tok.token_strings([0, 4, 6, 7, 8]) == ["<s>", "ab", " ab", "<tool>", " x"]
    assert tok.decode([0, 4, 6, 1], skip_special_tokens=True) == "ab ab"
    # a control token spelled outside the byte alphabet is not added whole (transformers 5)
    assert 9 not in tok.encode("<ctl é>")
    del meta["tokenizer.ggml.add_bos_token"], meta["tokenizer.ggml.add_eos_token"]
    plain = Tokenizer.from_pretrained(write_gguf(tmp_path / "plain.gguf", meta))
    assert plain.encode("ab") == [4]  # no flags: nothing added
    meta["tokenizer.ggml.pre"] = "llama-bpe"  # a named split: digits in threes
    digits = Tokenizer.from_pretrained(write_gguf(tmp_path / "digits.gguf", meta))
    assert digits._backend.pre_tokenizer.pre_tokenize_str("12345")[0][0] == "123"
    assert plain._backend.pre_tokenizer.pre_tokenize_str("12345")[0][0] == "12345"


def test_missing_tokenizers_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(InvalidConfig, match=r"pip install 'aioprefill\[tokenizer\]'"):
        Tokenizer.from_pretrained(smollm2_gguf())
