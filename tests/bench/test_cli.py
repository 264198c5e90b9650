"""Command-line parsing: defaults, and one-line errors naming the flag with exit code 2."""

from pathlib import Path

import pytest

from aioprefill import PaddleModel, SimModel
from aioprefill.bench.cli import DEFAULT_DURATION_S, POLICIES, parse_options
from aioprefill.bench.presets import SIM_PRESETS

DATA = Path(__file__).parent / "data"
HF = Path(__file__).parent.parent / "data" / "hf"


def test_defaults_are_the_two_minute_paddle_sweep():
    o = parse_options([])
    assert o.model == PaddleModel(seed=0)
    assert o.policies == list(POLICIES)
    assert o.rates and all(r.relative for r in o.rates)
    assert o.duration_s == DEFAULT_DURATION_S
    assert o.trace is None and o.lengths is not None
    assert o.json_path is None and o.plot_path is None
    assert o.seed == 0 and o.loop == "uvloop"


def test_model_path_is_a_checkpoint():
    """--model PATH: the checkpoint's own spec; prompts are drawn from its vocabulary and
    clipped to what it computes exactly (mistral_window: a 128-token sliding window)."""
    golden = HF / "mistral_window"
    o = parse_options(["--model", str(golden)])
    assert o.model == PaddleModel.from_pretrained(golden)
    assert o.model.vocab_size == 1000 and o.max_prompt_len == 128
    assert "mistral_window: MistralForCausalLM, 2 layers" in o.model_label


def test_sim_presets_and_overrides():
    o = parse_options(["--model", "sim", "--sim-preset", "gpu-class"])
    assert o.model == SIM_PRESETS["gpu-class"]
    o = parse_options(["--model", "sim", "--sim-fixed-ms", "1.5", "--sim-attn-ns", "0"])
    assert isinstance(o.model, SimModel)
    assert (o.model.fixed_ms, o.model.attn_ns) == (1.5, 0.0)
    assert o.model.per_token_us == SIM_PRESETS["cpu-tiny"].per_token_us


def test_workload_flags(tmp_path):
    o = parse_options(
        [
            "--model=sim",
            "--policy=eager,forward",
            "--rate=2,0.5x",
            "--burstiness=0.5",
            "--duration=1.5",
            "--prompt-len=uniform:10:20",
            "--max-prompt-len=16",
            "--seed=7",
            f"--json={tmp_path / 'out.json'}",
            f"--plot={tmp_path / 'out.png'}",
            "--no-progress",
        ]
    )
    assert o.policies == ["eager", "forward"]
    assert o.rates is not None and [r.label for r in o.rates] == ["2/s", "0.5x"]
    assert (o.burstiness, o.duration_s, o.max_prompt_len, o.seed) == (0.5, 1.5, 16, 7)
    assert str(o.lengths) == "uniform:10:20"
    assert o.progress is False and o.needs_capacity


def test_parallel_flags():
    o = parse_options(["--model=sim", "--workers=2", "--tp=2"])
    assert (o.num_workers, o.tp_size, o.expert_parallel) == (2, 2, False)
    assert o.policies == list(POLICIES)
    o = parse_options(["--model=sim", "--workers=2", "--ep", "--rate=20,40"])
    assert (o.tp_size, o.expert_parallel, o.policies) == (1, True, ["forward", "ep-timer"])


def test_trace_replaces_lengths_and_rates():
    o = parse_options(["--model", "sim", "--trace", str(DATA / "azure_sample.csv")])
    assert o.trace is not None and len(o.trace) == 120
    assert o.rates is None and o.duration_s is None and o.lengths is None
    assert not o.needs_capacity
    o = parse_options(["--trace", str(DATA / "mooncake_sample.jsonl"), "--max-prompt-len", "512"])
    assert o.trace is not None and o.trace.lengths.max() == 512


def test_trace_flags_and_cache_budgets():
    mooncake = str(DATA / "mooncake_sample.jsonl")
    o = parse_options(["--model", "sim", "--trace", mooncake])
    # a trace that shares prefixes: cache on vs off, prompts whole, a fresh engine per point
    assert [c.label for c in o.prefix_cache] == ["default", "off"] and o.fresh_engines
    assert o.trace is not None and o.trace.block_tokens == 512 and o.trace.lengths.max() == 6000
    assert o.max_prompt_len == o.model.max_prompt_tokens and o.distinct_blocks is not None
    o = parse_options(
        ["--model", "sim", "--trace", mooncake, "--trace-requests", "10", "--trace-speedup", "2",
         "--trace-block-tokens", "32", "--prefix-cache", "all,10%,64MiB,off",
         "--prefix-block-tokens", "8"]
    )  # fmt: skip
    assert o.trace is not None and len(o.trace) == 10 and o.trace.block_tokens == 32
    assert [c.label for c in o.prefix_cache] == ["all", "10%", "64mib", "off"]
    assert o.prefix_block_tokens == 8 and o.block_bytes == 8 * o.model.kv_bytes_per_token
    assert o.distinct_blocks is not None and o.distinct_blocks > 10
    all_, ten, mib, off = (o.cache_bytes(c) for c in o.prefix_cache)
    assert all_ == o.distinct_blocks * o.block_bytes and off == 0 and mib == 64 * 2**20
    assert ten == -(-o.distinct_blocks // 10) * o.block_bytes
    o = parse_options(["--model", "sim"])  # no trace: the engine's default budget only
    assert [c.label for c in o.prefix_cache] == ["default"] and not o.fresh_engines
    assert o.cache_bytes(o.prefix_cache[0]) is None


BAD = [
    (["--rate", "0.8y"], "--rate"),
    (["--rate", "0"], "--rate"),
    (["--rate", "4,,8"], "--rate"),
    (["--rate", "inf"], "--rate"),
    (["--policy", "forward,fast"], "--policy"),
    (["--policy", "eager,eager"], "--policy"),
    (["--model", "gpu"], "--model"),
    (["--model", str(DATA)], "--model"),  # a directory without config.json
    (["--sim-preset", "gpu-class"], "--sim-preset"),
    (["--model", "sim", "--sim-preset", "h100"], "--sim-preset"),
    (["--model", "sim", "--sim-fixed-ms", "-1"], "--sim-fixed-ms"),
    (["--duration", "0"], "--duration"),
    (["--duration", "abc"], "--duration"),
    (["--burstiness", "-2"], "--burstiness"),
    (["--prompt-len", "lognormal:0:1"], "--prompt-len"),
    (["--prompt-len", "uniform:20:10"], "--prompt-len"),
    (["--prompt-len", "zipf:3"], "--prompt-len"),
    (["--prompt-len", "fixed:1.5"], "--prompt-len"),
    (["--workers", "0"], "--workers"),
    (["--max-batch-tokens", "1.5"], "--max-batch-tokens"),
    (["--seed", "-1"], "--seed"),
    (["--trace", "/nonexistent/trace.csv"], "--trace"),
    (["--trace-format", "mooncake"], "--trace-format"),
    (["--trace", str(DATA / "azure_sample.csv"), "--prompt-len", "5"], "--prompt-len"),
    (["--rate", "0.5x", "--saturation-s", "0"], "--rate"),
    (["--plot", "out.jpg"], "--plot"),
    (["--plot", "/nonexistent/dir/out.png"], "--plot"),
    (["--json", "/nonexistent/dir/out.json"], "--json"),
    (["--loop", "trio"], "--loop"),
    (["--bogus"], "--bogus"),
    (["--tp", "0"], "--tp"),
    (["--ep"], "--ep"),  # one worker
    (["--ep", "--workers", "2", "--tp", "2"], "--ep"),
    (["--ep", "--workers", "2", "--rate", "5", "--policy", "eager"], "--policy"),
    (["--policy", "ep-timer"], "--policy"),
    (["--ep", "--workers", "2"], "--rate"),  # the default rates are fractions of eager's
    (["--trace-block-tokens", "32"], "--trace-block-tokens"),
    (["--trace-speedup", "2"], "--trace-speedup"),
    (["--trace-requests", "0"], "--trace-requests"),
    (
        ["--trace", str(DATA / "azure_sample.csv"), "--trace-block-tokens", "32"],
        "--trace-block-tokens",
    ),  # lengths only: no hash ids to scale
    (
        ["--trace", str(DATA / "mooncake_sample.jsonl"), "--trace-speedup", "2", "--rate", "5"],
        "--trace-speedup",
    ),
    (["--prefix-cache", "lots"], "--prefix-cache"),
    (["--prefix-cache", "off,0"], "--prefix-cache"),
    (["--model", "sim", "--prefix-cache", "10%"], "--prefix-cache"),  # no trace to share
    (["--prefix-block-tokens", "0"], "--prefix-block-tokens"),
]


@pytest.mark.parametrize(("argv", "flag"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments_exit_2_with_one_line_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as info:
        parse_options(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("python -m aioprefill.bench: error: ")
    assert flag in err


def test_bad_trace_contents_name_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5}\n{"timestamp": 10}\n')
    with pytest.raises(SystemExit):
        parse_options(["--trace", str(bad)])
    err = capsys.readouterr().err
    assert "--trace" in err and "bad.jsonl:2" in err
