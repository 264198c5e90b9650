"""Store keys are deterministic and name the model's identity; the weights digest follows
the weights' bytes, not their path; the cost rule loads exactly when reading is expected to be
cheaper, on estimates that one slow call cannot derail."""

from __future__ import annotations

import subprocess
import sys

import pytest

from aioprefill.kvstore.cost import ForwardClock, HitRate, ReadClock, load_pays, min_blocks
from aioprefill.kvstore.identity import StoreIdentity, weights_digest


def test_keys_are_the_same_in_another_process():
    code = (
        "from aioprefill.kvstore.identity import StoreIdentity as S;"
        "print(S('m', 'float32', 'L', 16, 1, 2).key(2**63 + 5))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == StoreIdentity("m", "float32", "L", 16, 1, 2).key(2**63 + 5)
    assert StoreIdentity("m", "float32", "L", 16).key(1) != StoreIdentity(
        "m", "float32", "L", 32
    ).key(1)


def test_weights_digest_follows_bytes_not_paths(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    data = bytes(range(256)) * (40 << 10)  # 10 MiB: sampled, not read whole
    (a / "model.safetensors").write_bytes(data)
    (b / "model.safetensors").write_bytes(data)
    assert weights_digest(b"spec", a) == weights_digest(b"spec", b)
    assert weights_digest(b"spec", a) != weights_digest(b"other spec", a)
    changed = bytearray(data)
    changed[len(data) - 10] ^= 1  # in the last MiB, which is always read
    (b / "model.safetensors").write_bytes(bytes(changed))
    assert weights_digest(b"spec", a) != weights_digest(b"spec", b)
    assert weights_digest(b"spec", None) == weights_digest(b"spec", None)


@pytest.mark.parametrize(
    ("blocks", "value_bytes", "spt", "bw", "lat", "pays"),
    [
        (1, 80_000, 134e-6, 1e9, 1e-3, True),  # tiny Llama on CPU: 2.1 ms compute vs 1.08 ms
        (1, 80_000, 1e-6, 1e9, 1e-3, False),  # a fast accelerator: 16 us compute
        (100, 80_000, 6e-6, 1e9, 1e-3, True),  # 9.6 ms vs 9 ms: long chains amortize latency
        (100, 80_000, 5e-6, 1e9, 1e-3, False),  # 80 us/block < 80 us read per block: never
        (0, 80_000, 1.0, 1e9, 0.0, False),
    ],
)
def test_load_pays_compares_read_time_with_compute_time(blocks, value_bytes, spt, bw, lat, pays):
    assert load_pays(blocks, value_bytes, 16, spt, bw, lat) is pays


def test_min_blocks_is_the_threshold_of_load_pays():
    for spt in (5.5e-6, 6e-6, 1e-5, 1e-4):
        k = min_blocks(80_000, 16, spt, 1e9, 1e-3)
        assert k is not None
        assert load_pays(k, 80_000, 16, spt, 1e9, 1e-3)
        assert k == 1 or not load_pays(k - 1, 80_000, 16, spt, 1e9, 1e-3)
    assert min_blocks(80_000, 16, 5e-6, 1e9, 1e-3) is None


def test_forward_clock_fits_the_cost_of_one_more_token():
    clock = ForwardClock(1e-3)
    assert clock.seconds_per_token == 1e-3  # before any forward
    clock.record(0.010 + 500 * 20e-6, 500)
    assert clock.seconds_per_token == pytest.approx(40e-6)  # one size: the average
    clock.record(1.0, 0)  # no computed tokens: ignored
    for n in [100, 900, 300, 2000, 50, 700, 1200, 400, 60, 1500] * 3:
        clock.record(0.010 + n * 20e-6, n)  # 10 ms fixed + 20 us per token
    assert clock.seconds_per_token == pytest.approx(20e-6, rel=1e-6)
    same = ForwardClock(1e-3)
    for _ in range(20):
        same.record(0.010 + 64 * 20e-6, 64)
    assert same.seconds_per_token == pytest.approx((0.010 + 64 * 20e-6) / 64)


def test_read_clock_starts_from_the_options_then_follows_the_loads():
    reads = ReadClock(1e-3, 80e-6)
    assert reads.latency() == pytest.approx(1e-3) and reads.per_block() == pytest.approx(80e-6)
    reads.record(0.2, 0)  # a first call that paid for connecting: capped at 4x the estimate
    assert reads.latency() < 1.4e-3
    reads.record(0.2, 10)  # a slow hit (20 ms a block): capped too
    assert reads.per_block() < 120e-6
    for blocks in [0, 4, 1, 8, 0, 2, 16, 3] * 40:  # misses cost the call alone
        reads.record(0.3e-3 + blocks * 50e-6, blocks)
    assert reads.latency() == pytest.approx(0.3e-3, rel=0.05)
    assert reads.per_block() == pytest.approx(50e-6, rel=0.05)
    for _ in range(40):  # a real slowdown gets in, a few calls later
        reads.record(5e-3, 0)
    assert reads.latency() == pytest.approx(5e-3, rel=0.05)


def test_hit_rate_follows_what_the_calls_found():
    hits = HitRate()
    assert hits.fraction == 0.5
    hits.record(0, 0)  # asked nothing: no news
    assert hits.fraction == 0.5
    for _ in range(120):
        hits.record(10, 40)
    assert hits.fraction == pytest.approx(0.25, rel=0.01)


def test_the_batch_rule_weighs_the_latency_against_the_expected_gain():
    """One call per batch: worth it when the blocks it is expected to find save more compute
    than the call's latency; never when a block reads slower than it computes."""
    from aioprefill.kvstore.tier import StoreTier
    from tests.kvstore.util import IDENT, PAYLOAD, options

    t = StoreTier(options("127.0.0.1:1", read_latency_s=1e-3), IDENT, PAYLOAD, 25e-6)
    t.reads = ReadClock(1e-3, 100e-6)  # compute: 16 x 25 us = 400 us a block
    t.hits.fraction = 0.25  # expected gain: 0.25 * 300 us = 75 us a block asked
    assert not t.load_pays([4, 5])  # 9 blocks: 675 us < 1 ms
    assert t.load_pays([4, 5, 6])  # 15 blocks: 1.125 ms > 1 ms
    assert not t.load_pays([0, 0]) and not t.load_pays([])
    # blocks this worker put or loaded itself count whole: 5 known of 9, 1.5 ms + 0.3 ms
    assert t.load_pays([4, 5], known=5)
    t.reads = ReadClock(0.0, 450e-6)  # a block reads slower than it computes
    assert not t.load_pays([1000])
