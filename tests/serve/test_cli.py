"""The command line refuses what cannot start, plainly, before any engine starts."""

from __future__ import annotations

import subprocess
import sys

from tests.serve.util import ROOT
from tests.transfer.util import needs_mooncake


def run(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aioprefill.serve", *flags],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip


def test_help_lists_the_flags():
    out = run("--help").stdout
    for flag in ("--model", "--workers", "--tp", "--ep", "--policy", "--max-batch-tokens",
                 "--max-batch-size", "--max-pending", "--max-prompt-tokens", "--host", "--port",
                 "--served-model-name", "--pooling", "--normalize", "--server"):  # fmt: skip
        assert flag in out, flag


def test_a_missing_model_or_a_bad_setting_is_one_line_not_a_traceback(tmp_path):
    done = run("--model", str(tmp_path / "nope.gguf"))
    assert done.returncode != 0 and done.stderr.startswith("aioprefill-serve: ")
    assert "Traceback" not in done.stderr
    done = run("--model", "sim", "--workers", "0")
    assert done.returncode != 0 and "EngineConfig.num_workers" in done.stderr
    assert "Traceback" not in done.stderr


def test_new_flags_are_listed():
    out = run("--help").stdout
    for flag in ("--threads", "--device", "--dtype", "--api-key", "--api-key-file",
                 "--cache-isolation"):  # fmt: skip
        assert flag in out, flag


def test_spread_fills_the_cores():
    from aioprefill.serve.__main__ import spread

    assert spread(8, 1, None, None) == (8, 1)  # one 1-thread worker per core
    assert spread(8, 2, None, None) == (4, 1)  # TP ranks count as processes
    assert spread(8, 1, 2, None) == (2, 4)  # the cores split between the workers
    assert spread(8, 1, None, 4) == (2, 4)
    assert spread(8, 1, 3, 5) == (3, 5)  # both given: as given
    assert spread(1, 4, None, None) == (1, 1)  # never zero


def test_a_cpu_server_spreads_the_cores_and_says_so(caplog):
    import logging
    import os

    from aioprefill.serve.__main__ import build, parse_args
    from tests.serve.util import HF

    cores = len(os.sched_getaffinity(0))
    model = ["--model", str(HF / "llama_bf16"), "--device", "cpu"]
    with caplog.at_level(logging.WARNING, logger="aioprefill.serve"):
        config, _ = build(parse_args(model))
    assert (config.num_workers, config.model.num_threads) == (cores, 1)
    assert f"{cores} CPU cores: {cores} worker" in caplog.text
    config, _ = build(parse_args([*model, "--workers", "1", "--dtype", "bfloat16"]))
    assert (config.num_workers, config.model.num_threads) == (1, cores)
    assert config.model.dtype == "bfloat16" and config.model.device == "cpu"
    config, _ = build(parse_args([*model, "--threads", "1", "--workers", "1"]))
    assert (config.num_workers, config.model.num_threads) == (1, 1)
    # --dtype auto (the default): the checkpoint's bfloat16 where this CPU has bf16 units
    from aioprefill.hf.dtype import cpu_bf16_units

    assert config.model.dtype == ("bfloat16" if cpu_bf16_units() else "float32")
    config, _ = build(parse_args([*model, "--dtype", "float32"]))
    assert config.model.dtype == "float32"
    done = run("--model", "sim", "--cache-isolation", "per-key")
    assert done.returncode != 0 and "needs --api-key" in done.stderr


@needs_mooncake
def test_the_kv_store_flags_make_the_store_tier():
    from aioprefill.serve.__main__ import build, parse_args

    config, _ = build(parse_args(["--model", "sim"]))
    assert config.kv_store is None
    flags = ["--model", "sim", "--kv-store-master", "10.0.0.5:50051", "--kv-store-host",
             "10.0.0.7", "--kv-store-segment-mb", "64"]  # fmt: skip
    config, _ = build(parse_args(flags))
    assert config.kv_store == "mooncake"
    opts = config.kv_store_options
    assert (opts.master, opts.host, opts.segment_bytes) == ("10.0.0.5:50051", "10.0.0.7", 64 << 20)
    assert opts.peer_events == ()
    peers = "tcp://10.0.0.5:5557,tcp://10.0.0.7:5557"
    config, _ = build(parse_args([*flags, "--kv-store-peer-events", peers]))
    assert config.kv_store_options.peer_events == ("tcp://10.0.0.5:5557", "tcp://10.0.0.7:5557")
    done = run("--model", "sim", "--kv-store-master", "no-port")
    assert done.returncode != 0 and "KVStoreOptions.master" in done.stderr
    assert "Traceback" not in done.stderr


def test_default_prompts_come_from_the_directory_or_the_flags(tmp_path):
    import json

    import pytest

    from aioprefill.errors import InvalidConfig
    from aioprefill.serve.__main__ import embedding_prompts
    from aioprefill.serve.flags import parse_args

    prompts = {"query": "query: ", "passage": ""}
    config = {"prompts": prompts, "default_prompt_name": "query"}
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(config))
    model = ["--model", str(tmp_path)]
    assert embedding_prompts(parse_args(model)) == (prompts, "query: ")
    flags = ["--default-prompt-name", "passage"]
    assert embedding_prompts(parse_args([*model, *flags])) == (prompts, "")
    assert embedding_prompts(parse_args([*model, "--default-prompt", "q: "])) == (prompts, "q: ")
    with pytest.raises(InvalidConfig, match="'passage', 'query'"):
        embedding_prompts(parse_args([*model, "--default-prompt-name", "doc"]))
    config["default_prompt_name"] = "doc"
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(config))
    with pytest.raises(InvalidConfig, match="default_prompt_name 'doc'"):
        embedding_prompts(parse_args(model))
