"""EngineConfig(kv_store=...) and KVStoreOptions are checked at construction, naming the
field; a missing Mooncake names the extra and libibverbs1."""

from __future__ import annotations

import sys

import pytest

from aioprefill import EngineConfig, InvalidConfig, KVStoreOptions
from tests.reliability.util import sim
from tests.transfer.util import needs_mooncake


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"kv_store": "redis"}, "EngineConfig.kv_store"),
        ({"kv_store": True}, "EngineConfig.kv_store"),
        ({"kv_store_options": {"master": "x:1"}}, "EngineConfig.kv_store_options"),
        pytest.param(
            {"kv_store": "mooncake", "prefix_cache_bytes": 0},
            "prefix_cache_bytes > 0",
            marks=needs_mooncake,  # checked after the store client imports
        ),
    ],
)
def test_engine_config_refuses_bad_store_fields(fields, match):
    with pytest.raises(InvalidConfig, match=match):
        EngineConfig(model=sim(), **fields)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"master": "127.0.0.1"}, "master"),
        ({"master": "127.0.0.1:0"}, "master"),
        ({"master": ":50051"}, "master"),
        ({"master": "a b:1"}, "master"),
        ({"host": "127.0.0.1:5"}, "host"),
        ({"host": ""}, "host"),
        ({"protocol": "udp"}, "protocol"),
        ({"device": None}, "device"),
        ({"segment_bytes": (16 << 20) - 1}, "segment_bytes"),  # Mooncake refuses it (-600)
        ({"segment_bytes": True}, "segment_bytes"),
        ({"put_buffer_bytes": -1}, "put_buffer_bytes"),
        ({"load_buffer_bytes": 1.5}, "load_buffer_bytes"),
        ({"load_timeout_s": 0}, "load_timeout_s"),
        ({"retry_min_s": float("inf")}, "retry_min_s"),
        ({"retry_min_s": 5.0, "retry_max_s": 1.0}, "retry_max_s"),
        ({"read_bytes_per_s": -1}, "read_bytes_per_s"),
        ({"read_latency_s": float("nan")}, "read_latency_s"),
        ({"model_id": ""}, "model_id"),
        ({"secret": b"short"}, "secret"),
        ({"secret": "a string of more than 16"}, "secret"),
        ({"peer_events": "tcp://127.0.0.1:5557"}, "peer_events"),  # a str, not a tuple
        ({"peer_events": ("127.0.0.1:5557",)}, "peer_events"),
        ({"peer_events": ("tcp://host",)}, "peer_events"),
        ({"peer_events": (5557,)}, "peer_events"),
    ],
)
def test_store_options_refuse_bad_values(fields, match):
    with pytest.raises(InvalidConfig, match=f"KVStoreOptions.{match}"):
        KVStoreOptions(**fields)


def test_peer_events_given_as_a_list_are_kept_as_a_tuple():
    opts = KVStoreOptions(peer_events=["tcp://127.0.0.1:5557", "tcp://10.0.0.2:5557"])
    assert opts.peer_events == ("tcp://127.0.0.1:5557", "tcp://10.0.0.2:5557")


def test_a_refused_secret_is_not_echoed():
    with pytest.raises(InvalidConfig) as info:
        KVStoreOptions(secret=b"hunter2")
    assert "hunter2" not in str(info.value)


@needs_mooncake
def test_defaults_are_off_and_loopback():
    options = KVStoreOptions()
    assert (options.master, options.host, options.protocol) == (
        "127.0.0.1:50051",
        "127.0.0.1",
        "tcp",
    )
    config = EngineConfig(model=sim())
    assert config.kv_store is None and config.kv_store_options == options
    on = EngineConfig(model=sim(), kv_store="mooncake", kv_store_options=options)
    assert on.kv_store == "mooncake"


def test_missing_mooncake_names_the_extra_and_libibverbs(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import fails as if absent
    with pytest.raises(InvalidConfig, match=r"aioprefill\[transfer\].*libibverbs1"):
        EngineConfig(model=sim(), kv_store="mooncake")


@needs_mooncake
def test_missing_xxhash_names_the_extra_unless_a_secret_is_set(monkeypatch):
    monkeypatch.setitem(sys.modules, "xxhash", None)  # import fails as if absent
    with pytest.raises(InvalidConfig, match=r"xxhash.*aioprefill\[kvstore\]"):
        EngineConfig(model=sim(), kv_store="mooncake")
    keyed = KVStoreOptions(secret=b"s" * 16)  # values carry a BLAKE2b MAC: no XXH3 needed
    assert EngineConfig(model=sim(), kv_store="mooncake", kv_store_options=keyed).kv_store
