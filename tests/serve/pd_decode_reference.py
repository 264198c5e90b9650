"""A decode node for tests/serve/test_pd.py on the float64 NumPy reference model
(tests/model/reference.py), in the project's own venv: no torch, no transformers.

    python -m tests.serve.pd_decode_reference --model MODEL.gguf --port 8200

The same HTTP face as examples/pd_decode_transformers.py (the user-facing decode node, which
needs torch): `/health`, `/v1/models`, and `/v1/completions` / `/v1/chat/completions` answered
with vLLM's `prompt_token_ids` and each choice's `token_ids`. A request that carries the prefill
node's `kv_transfer_params` is decoded from the KV it pulls with `aioprefill.transfer.pull_kv`
(Mooncake, from the prefill node's shared memory): every prompt token but the last goes into the
reference's KV cache as pulled (float32 widened to float64), the last prompt token is read again
for the first logits, and each greedy step after reads only that cache and the new token
(`reference_hidden(..., past=...)`). Without the params, the whole prompt is run through the
reference first. The request's token ids come from aioprefill's tokenizer and chat-template code
(the prefill node's own): the test checks them against transformers' ids in the goldens.

The weights are the GGUF file's, dequantized and un-permuted by the worker's reader
(`aioprefill.hf.gguf_weights.read_tensor`, `aioprefill.hf.gguf.unpermute`: the code that
gives the prefill node its weights, which transformers' goldens check bit for bit elsewhere).
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

from aioprefill import PaddleModel, Tokenizer
from aioprefill.hf.gguf import hf_name, read_header, unpermute
from aioprefill.hf.gguf_weights import read_tensor
from aioprefill.serve.chat import chat_prompt
from aioprefill.transfer import pull_kv, release_kv
from tests.model.reference import Weights, lm_head, reference_hidden


def gguf_weights64(path: Path, spec: PaddleModel) -> Weights:
    """Every tensor of a GGUF file under its Hugging Face name, as float64."""
    header = read_header(path)
    heads = {
        "self_attn.q_proj.weight": spec.num_heads,
        "self_attn.k_proj.weight": spec.num_kv_heads,
    }
    out: Weights = {}
    with open(header.path, "rb") as f:
        for t in header.tensors.values():
            name = hf_name(t.name)
            if name is None:
                continue
            w = read_tensor(f, header.path, t)
            part = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
            if part in heads:
                w = unpermute(w, heads[part])
            out[name] = w.astype(np.float64)
    return out


class Decoder:
    """The reference model, aioprefill's tokenizer, and greedy generation from a pulled KV
    (or from the whole prompt without one)."""

    def __init__(self, path: str, name: str) -> None:
        self.spec = PaddleModel.from_pretrained(path, device="cpu")
        self.w64 = gguf_weights64(Path(path), self.spec)
        self.tok = Tokenizer.from_pretrained(path)
        self.name = name
        self.lock = threading.Lock()  # one generation at a time

    def prompt_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        if path == "/v1/chat/completions":
            text = chat_prompt(self.tok, body["messages"], chat_template=None,
                               template_kwargs=None, add_generation_prompt=True,
                               continue_final_message=False)  # fmt: skip
            return self.tok.encode(text, add_special_tokens=False)
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]  # one prompt in a list
        if isinstance(prompt, str):
            return self.tok.encode(prompt)
        return [int(t) for t in prompt]

    def generate(self, ids: list[int], max_tokens: int, params: dict[str, Any] | None) -> list[int]:
        if params is not None:  # the prefill node's KV for every prompt token but the last
            kv = pull_kv(params)
            try:
                keys, values = np.asarray(kv.keys), np.asarray(kv.values)
                if keys.shape[2] != len(ids):
                    raise ValueError(
                        f"the pulled KV holds {keys.shape[2]} tokens, the prompt {len(ids)}: "
                        "the two nodes tokenized the request differently"
                    )
                past = (keys[:, :, :-1].astype(np.float64), values[:, :, :-1].astype(np.float64))
            finally:
                release_kv(params)
            feed = ids[-1:]
        else:  # the whole prompt, here
            past, feed = None, ids
        new: list[int] = []
        with self.lock:
            while len(new) < max_tokens:
                h = reference_hidden(self.spec, self.w64, np.asarray(feed), past=past)
                past = (h.keys, h.values)
                token = int(np.argmax(lm_head(self.spec, self.w64, h.states[-1:])[1][0]))
                new.append(token)
                if token == self.tok.eos_token_id:
                    break
                feed = [token]
        return new

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
                data = [{"id": decoder.name, "object": "model"}]
                self._send(200, {"object": "list", "data": data})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}", "code": 404}})

        def do_POST(self) -> None:
            # read the body whatever the route, or it is taken for the next request on this
            # keep-alive connection (vllm-router asks for the render routes and /tokenize too)
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
    p.add_argument("--model", required=True, help="a .gguf file")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8200)
    args = p.parse_args()
    name = args.served_model_name or Path(args.model).name.removesuffix(".gguf")
    server = ThreadingHTTPServer((args.host, args.port), handler(Decoder(args.model, name)))
    print(f"decode node on http://{args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
