"""A decode node on transformers for an aioprefill prefill node: the other half of a
prefill/decode (PD) deployment behind vllm-router, small enough to run on a CPU.

    python -m aioprefill.serve --kv-transfer mooncake --port 8100            # prefill node
    python examples/pd_decode_transformers.py --model MODEL.gguf --port 8200  # decode node
    vllm-router --vllm-pd-disaggregation --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --host 127.0.0.1 --port 8000         # the router

The router sends a client's `/v1/completions` or `/v1/chat/completions` request to the prefill
node with `max_tokens` 1 and `kv_transfer_params`; the prefill node answers with its KV export's
transfer params, which the router hands to this node with the original request. This node turns
the request into the same token ids the prefill node computed (the model's tokenizer and chat
template, in transformers), pulls the prompt's KV with `aioprefill.transfer.pull_kv(params)`
(Mooncake, straight from the prefill node's shared memory), builds transformers' `DynamicCache`
from it (keys after RoPE, `[layers, kv_heads, tokens, head_dim]`: each layer's slice is a cache
layer as it is) and generates greedily from there: the cache holds every prompt token but the last,
which the model reads again to produce the first logits, as vLLM's decode side recomputes a
prompt's last partial block. A request without `kv_transfer_params` is generated from the whole
prompt, transformers alone: the reference the PD path must equal
(benchmarks/tools/make_pd_goldens.py records it; tests/serve/test_pd.py checks this node's PD
answers against it where the reference venv is made).

Needs torch, transformers (and `gguf` for a .gguf file) beside aioprefill's `transfer` extra: a
venv of its own (tests/refvenv.py makes one), never aioprefill's. One request at a time; the
answer carries vLLM's `prompt_token_ids` and each choice's `token_ids`.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from aioprefill.transfer import pull_kv, release_kv


class Decoder:
    """The model, its tokenizer, and greedy generation with or without a pulled KV."""

    def __init__(self, path: str, name: str) -> None:
        p = Path(path)
        kw: dict[str, Any] = {"gguf_file": p.name} if p.suffix == ".gguf" else {}
        where = p.parent if p.suffix == ".gguf" else p
        self.tok = AutoTokenizer.from_pretrained(where, **kw)
        self.model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw).eval()
        self.name = name
        self.lock = threading.Lock()  # one generation at a time

    def prompt_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        if path == "/v1/chat/completions":
            return [int(t) for t in self.tok.apply_chat_template(
                body["messages"], add_generation_prompt=True, tokenize=True, return_dict=False,
            )]  # fmt: skip
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]  # one prompt in a list
        if isinstance(prompt, str):
            return [int(t) for t in self.tok(prompt).input_ids]
        return [int(t) for t in prompt]

    def generate(self, ids: list[int], max_tokens: int, params: dict[str, Any] | None) -> list[int]:
        input_ids = torch.tensor([ids])
        kwargs: dict[str, Any] = {}
        if params is not None:  # the prefill node's KV for every prompt token but the last
            kv = pull_kv(params)
            try:
                keys, values = np.asarray(kv.keys), np.asarray(kv.values)
                if keys.shape[2] != len(ids):
                    raise ValueError(
                        f"the pulled KV holds {keys.shape[2]} tokens, the prompt {len(ids)}: "
                        "the two nodes tokenized the request differently"
                    )
                cut = slice(0, len(ids) - 1)  # each layer [1, kv_heads, tokens - 1, head_dim]
                layers = [
                    (torch.tensor(k[None, :, cut]), torch.tensor(v[None, :, cut]))
                    for k, v in zip(keys, values, strict=True)
                ]
            finally:
                release_kv(params)
            kwargs["cache"] = DynamicCache(ddp_cache_data=layers)
        with self.lock, torch.no_grad():
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=self.tok.eos_token_id,
                **kwargs,
            )
        return [int(t) for t in out[0, len(ids) :]]

    def answer(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        ids = self.prompt_ids(path, body)
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        params = body.get("kv_transfer_params")
        if not (isinstance(params, dict) and "export_id" in params):
            params = None  # no KV to pull: generate from the whole prompt
        new = self.generate(ids, int(limit), params)
        text = self.tok.decode(new, skip_special_tokens=True)
        finish = "stop" if new and new[-1] == self.tok.eos_token_id else "length"
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(new),
                 "total_tokens": len(ids) + len(new)}  # fmt: skip
        common = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()),
                  "model": self.name, "usage": usage, "prompt_token_ids": ids,
                  "kv_pulled": params is not None}  # fmt: skip
        if path == "/v1/chat/completions":
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "finish_reason": finish, "token_ids": new}
            return {**common, "object": "chat.completion", "choices": [choice]}
        choice = {"index": 0, "text": text, "finish_reason": finish, "token_ids": new,
                  "logprobs": None}  # fmt: skip
        return {**common, "object": "text_completion", "choices": [choice]}


def handler(decoder: Decoder) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._send(
                    200, {"object": "list", "data": [{"id": decoder.name, "object": "model"}]}
                )
            else:
                self._send(404, {"error": {"message": f"no route {self.path}", "code": 404}})

        def do_POST(self) -> None:
            # the body is read whatever the route: left unread, it would be taken for the next
            # request's first line on this keep-alive connection (vllm-router calls the render
            # routes and /tokenize here too, and takes a 404 as "not offered")
            raw = self.rfile.read(int(self.headers.get("content-length", 0)))
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                self._send(404, {"error": {"message": f"no route {self.path}", "code": 404}})
                return
            try:
                self._send(200, decoder.answer(self.path, json.loads(raw)))
            except (ValueError, KeyError) as exc:
                self._send(400, {"error": {"message": str(exc), "code": 400}})

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

    return Handler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a .gguf file or a checkpoint directory")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8200)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.served_model_name or Path(args.model).name.removesuffix(".gguf")
    server = ThreadingHTTPServer((args.host, args.port), handler(Decoder(args.model, name)))
    print(f"decode node on http://{args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
