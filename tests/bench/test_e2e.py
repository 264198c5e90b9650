"""`python -m aioprefill.bench` end to end on the real engine with `--model sim`: the JSON has
every field with sane values, Ctrl-C still writes what was measured, and traces replay."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
FORWARD_MS = 12.0  # 10 ms + 20 us x 100 tokens
SIM = ["--model", "sim", "--sim-fixed-ms", "10", "--sim-per-token-us", "20", "--sim-attn-ns", "0"]
POINT_KEYS = {
    "policy", "kind", "label", "offered_rps", "concurrency", "duration_s", "partial",
    "host_load_1m", "n_submitted", "n_completed", "n_failed", "errors", "ttft_ms", "queue_ms",
    "forward_ms", "return_ms", "generator_lag_ms", "throughput", "batches", "batch_size",
    "batch_tokens", "bubble_us", "utilization", "goodput", "ideal", "engine_stats", "index",
    "cache", "prefix",
}  # fmt: skip
DIST_KEYS = {"mean", "p50", "p90", "p99", "max"}


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aioprefill.bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = bench(
        *SIM, "--prompt-len", "fixed:100", "--rate", "0.2x,0.9x", "--duration", "1.5",
        "--saturation-s", "1", "--batch-timeout-ms", "5", "--seed", "11", "--no-progress",
        "--json", str(out / "run.json"), "--plot", str(out / "run.png"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads((out / "run.json").read_text()), out / "run.png"


def test_table_and_files(sweep):
    proc, _, png = sweep
    assert "seed 11" in proc.stdout.splitlines()[0]
    assert "TTFT mean" in proc.stdout and "eager capacity" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "matplotlib" not in proc.stderr


def test_json_has_every_field(sweep):
    _, doc, _ = sweep
    assert doc["schema"] == "aioprefill.bench/1"
    assert doc["run"]["seed"] == 11 and doc["run"]["error"] is None
    assert doc["run"]["interrupted"] is False
    assert doc["config"]["model"]["kind"] == "sim" and doc["config"]["policies"] == [
        "forward", "eager", "timeout",
    ]  # fmt: skip
    assert doc["model_best"]["source"] == "sim model"
    # eager first (its capacity anchors 0.2x and 0.9x), then policies side by side per rate
    assert [(p["policy"], p["label"]) for p in doc["points"]] == [
        (pol, label) for label in ("sat", "0.2x", "0.9x") for pol in ("eager", "forward", "timeout")
    ]
    for p in doc["points"]:
        assert set(p) == POINT_KEYS
        for key in ("ttft_ms", "queue_ms", "forward_ms", "return_ms", "generator_lag_ms"):
            assert set(p[key]) == DIST_KEYS
        assert p["n_failed"] == 0 and not p["partial"]
        assert p["n_completed"] == p["n_submitted"] > 0
        assert p["engine_stats"]["completed"] >= p["n_completed"]
        assert p["ttft_ms"]["p50"] <= p["ttft_ms"]["p99"] <= p["ttft_ms"]["max"]
        # forwards sleep 10 ms + 20 us/token (forward_ms is per request, batch_tokens per batch)
        fwd = 10.0 + 0.02 * p["batch_tokens"]["p50"]
        assert p["forward_ms"]["p50"] == pytest.approx(fwd, rel=0.5)
        if p["kind"] == "saturation":
            assert p["ideal"] is None  # a closed loop has no arrival schedule to replay
        else:  # nothing beats a zero-overhead engine (beyond the timer noise of a real sleep)
            ideal = p["ideal"]
            assert 0 < ideal["ttft_ms"]["mean"] <= ideal["single_ttft_ms"]["mean"]
            assert 0 < ideal["efficiency"]["mean"] < 1.05 and 0 < ideal["efficiency"]["p99"] < 1.05


def test_sane_values(sweep):
    _, doc, _ = sweep
    pts = {(p["policy"], p["label"]): p for p in doc["points"]}
    capacity = doc["capacity"]["requests_per_s"]
    assert 0.5 * 1000 / FORWARD_MS < capacity <= 1.05 * 1000 / FORWARD_MS
    for pol in ("forward", "eager", "timeout"):
        low = pts[pol, "0.2x"]
        assert low["offered_rps"] == pytest.approx(0.2 * capacity)
        # at a low rate a request mostly waits for nothing: TTFT is about one forward
        slack = 5.0 + (5.0 if pol == "timeout" else 0.0)
        assert low["ttft_ms"]["p50"] < low["forward_ms"]["p50"] + slack
        assert low["ttft_ms"]["p50"] >= low["forward_ms"]["p50"]
        assert low["goodput"]["fraction"] > 0.9
        assert pts[pol, "sat"]["goodput"] is None
    assert all(pts["eager", lab]["batch_size"]["max"] == 1 for lab in ("sat", "0.2x", "0.9x"))
    assert pts["forward", "sat"]["batch_size"]["mean"] > 2
    assert pts["forward", "sat"]["throughput"]["requests_per_s"] > 1.5 * capacity
    sat_target = [t for t in doc["targets"] if t["name"].startswith("saturation")]
    assert len(sat_target) == 1 and sat_target[0]["value"] > 0.5


def test_trace_replay(tmp_path):
    out = tmp_path / "trace.json"
    proc = bench(
        *SIM, "--trace", str(DATA / "mooncake_sample.jsonl"), "--rate", "40", "--duration", "1",
        "--max-prompt-len", "256", "--policy", "forward", "--saturation-s", "0", "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["config"]["trace"]["requests"] == 100
    # its hash ids make it share prefixes: the engine's default cache, then cache off
    assert [p["cache"] for p in doc["points"]] == ["default", "off"]
    for point in doc["points"]:
        assert point["n_completed"] == point["n_submitted"]
        assert 30 <= point["n_submitted"] <= 50  # the trace sped up to 40/s, cut at 1 s
        assert point["batch_tokens"]["max"] <= 256 * point["batch_size"]["max"]


def test_trace_replay_with_the_cache_on_and_off(tmp_path):
    """Each hash id its own tokens: the engine finds what the trace shares, never more than the
    offline no-eviction replay of the same requests, and cache off finds nothing."""
    out = tmp_path / "cache.json"
    proc = bench(
        *SIM, "--trace", str(DATA / "mooncake_sample.jsonl"), "--trace-block-tokens", "32",
        "--trace-speedup", "20", "--prefix-cache", "all,off", "--policy", "forward",
        "--saturation-s", "0", "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Prefix cache: hit = cached / prompt tokens" in proc.stdout
    doc = json.loads(out.read_text())
    on, off = doc["points"]
    assert (on["cache"], off["cache"]) == ("all", "off")
    assert on["n_completed"] == off["n_completed"] == 100
    assert on["prefix"]["prompt_tokens"] == off["prefix"]["prompt_tokens"]
    assert off["prefix"]["cached_tokens"] == 0 and off["prefix"]["ceilings"] is None
    ceil = on["prefix"]["ceilings"]
    assert ceil["capacity_blocks"] >= ceil["distinct_blocks"] > 0
    assert 0 < on["prefix"]["hit_ratio"] <= ceil["no_eviction"] + 1e-9
    assert on["prefix"]["computed_tokens"] < off["prefix"]["computed_tokens"]
    stats = on["engine_stats"]["prefix_cache"]
    assert stats["hit_tokens"] >= on["prefix"]["cached_tokens"]  # (warm-up included)
    names = [t["name"] for t in doc["targets"]]
    assert "trace forward/all: hit ratio >= 0.98 x the no-eviction ceiling" in names
    assert "trace forward/all vs off: TTFT mean lower" in names


def test_ctrl_c_stops_cleanly_and_writes_what_was_measured(tmp_path):
    out = tmp_path / "int.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "aioprefill.bench", *SIM, "--rate", "20", "--duration", "60",
         "--saturation-s", "1", "--policy", "forward,eager", "--progress", "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        seen, deadline = b"", time.monotonic() + 60
        while b"forward 20/s" not in seen and time.monotonic() < deadline:  # the bar, no newline
            chunk = os.read(proc.stderr.fileno(), 4096)
            if not chunk:
                break
            seen += chunk
        assert b"forward 20/s" in seen, seen
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the whole process group
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    doc = json.loads(out.read_text())
    assert doc["run"]["interrupted"] is True
    labels = [(p["policy"], p["label"], p["partial"]) for p in doc["points"]]
    assert labels == [("forward", "sat", False), ("eager", "sat", False), ("forward", "20/s", True)]
    assert doc["points"][2]["n_completed"] > 0
    assert b"TTFT mean" in stdout
