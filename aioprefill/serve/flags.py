"""The command line of `python -m aioprefill.serve`: every flag, grouped as `--help` shows
them (`parse_args`). What the flags become (an `EngineConfig`, the server's settings) is
`__main__`'s."""

from __future__ import annotations

import argparse

from aioprefill.config import POLICIES

__all__ = ["parse_args"]

DESCRIPTION = (
    "`python -m aioprefill.serve` (or `aioprefill-serve`): an OpenAI-compatible prefill server."
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="aioprefill-serve", description=DESCRIPTION)
    a = p.add_argument
    a("--model", default=None, help="checkpoint dir, .gguf file, or 'sim' (default: SmolLM2)")
    a("--tokenizer", default=None, help="tokenizer dir or .gguf (default: the model's)")
    a("--served-model-name", default=None, help="the model name clients send (default: PATH's)")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8000)
    a(
        "--server",
        choices=["uvicorn", "granian", "granian-rsgi"],
        default="uvicorn",
        help="HTTP front: uvicorn (ASGI), granian (ASGI) or granian-rsgi",
    )
    g = p.add_argument_group("engine")
    g.add_argument(
        "--workers",
        type=int,
        default=None,
        help="data-parallel replicas (default: on a CPU, one per core: see --threads)",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads per worker process (default: the cores left to each worker)",
    )
    g.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    g.add_argument(
        "--dtype",
        choices=["auto", "float32", "float16", "bfloat16"],
        default="auto",
        help="auto: the checkpoint's where the device computes it well (a CPU: bfloat16 with "
        "avx512_bf16 or AMX), else float32 (logged); float32 is the exact mode",
    )
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per replica")
    g.add_argument("--ep", action="store_true", help="expert parallelism across the replicas")
    g.add_argument("--policy", choices=POLICIES, default="forward")
    g.add_argument("--max-batch-tokens", type=int, default=8192)
    g.add_argument("--max-batch-size", type=int, default=256)
    g.add_argument("--max-pending", type=int, default=65536)
    g.add_argument("--max-prompt-tokens", type=int, default=None)
    g.add_argument(
        "--prefix-cache-bytes",
        type=int,
        default=None,
        help="prefix cache per worker, in bytes; 0 turns it off (default: the engine's, 1 GiB)",
    )
    g.add_argument(
        "--kv-transfer",
        choices=["mooncake", "vllm-mooncake"],
        default=None,
        help="serve KV exports to decode nodes (vllm-router's PD mode); vllm-mooncake: "
        "write them into stock vLLM decode nodes (their MooncakeConnector, docs/serving.md)",
    )
    g.add_argument("--vllm-bootstrap-port", type=int, default=8998, help="vllm-mooncake")
    g.add_argument(
        "--vllm-host", default=None, help="vllm-mooncake: the address decode nodes reach"
    )
    g.add_argument("--vllm-kv-layout", choices=["cpu", "gpu"], default="cpu")
    g.add_argument(
        "--vllm-kv-dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="the decode's cache dtype (auto: from its page size)",
    )
    g.add_argument("--vllm-block-size", type=int, default=None, help="the decode's")
    g.add_argument(
        "--vllm-transfer-timeout", type=float, default=120.0, help="seconds a transfer waits"
    )
    g.add_argument(
        "--kv-transfer-host",
        default="127.0.0.1",
        help="the address decode nodes reach this server at",
    )
    g.add_argument("--prefix-block-tokens", type=int, default=16, help="tokens per cached block")
    g.add_argument(
        "--kv-store-master",
        default=None,
        metavar="HOST:PORT",
        help="share cached blocks through this mooncake_master (the Mooncake Store tier)",
    )
    g.add_argument(
        "--kv-store-host", default="127.0.0.1", help="the address other nodes reach this one at"
    )
    g.add_argument(
        "--kv-store-segment-mb", type=int, default=256, help="what each worker lends the store"
    )
    g.add_argument(
        "--kv-store-peer-events",
        default="",
        metavar="tcp://HOST:PORT,...",
        help="every node's --kv-events-endpoint (this one's too): load only announced chains",
    )
    g.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="tcp://HOST:PORT",
        help="publish prefix-cache blocks as vLLM KV events (vllm-router --policy kv_aware)",
    )
    g.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        metavar="tcp://HOST:PORT",
        help="serve replays of recent KV events here (default: the events port + 1)",
    )
    g = p.add_argument_group("authentication")
    g.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="a key clients send as 'Authorization: Bearer KEY' (repeatable)",
    )
    g.add_argument("--api-key-file", default=None, help="keys, one a line; re-read on SIGHUP")
    g.add_argument(
        "--cache-isolation",
        choices=["shared", "per-key"],
        default="shared",
        help="per-key: each API key its own prefix-cache namespace",
    )
    g = p.add_argument_group("embeddings")
    g.add_argument(
        "--pooling",
        choices=["mean", "last", "cls"],
        default=None,
        help="default: the model directory's (sentence-transformers modules), else mean",
    )
    g.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="L2-normalise embeddings (default: as the model directory says, else not)",
    )
    prompt = g.add_mutually_exclusive_group()
    prompt.add_argument(
        "--default-prompt-name",
        default=None,
        help="one of the model directory's named prompts (config_sentence_transformers.json), "
        "put before every text a request sends without its own prompt_name (default: the "
        "directory's default_prompt_name, else none)",
    )
    prompt.add_argument(
        "--default-prompt", default=None, help="a literal text put before every embedded text"
    )
    g = p.add_argument_group("rerank and score (docs/embedding.md)")
    g.add_argument(
        "--rerank-template",
        default=None,
        help="a decoder LM's prompt: a format string with {query} and {document}, or a file "
        "(default: Qwen3-Reranker's for Qwen3 checkpoints, else none)",
    )
    g.add_argument(
        "--label-tokens",
        default="yes,no",
        help="the template's label tokens, the relevant one first (default: yes,no)",
    )
    g.add_argument("--max-documents", type=int, default=1000, help="documents per request")
    g = p.add_argument_group("limits")
    g.add_argument("--max-prompts-per-request", type=int, default=1024)
    g.add_argument("--max-body-bytes", type=int, default=16 << 20)
    g = p.add_argument_group("--model sim")
    g.add_argument("--sim-fixed-ms", type=float, default=0.5)
    g.add_argument("--sim-per-token-us", type=float, default=0.0)
    g.add_argument("--sim-vocab-size", type=int, default=32000)
    return p.parse_args(argv)
