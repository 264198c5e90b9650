"""EngineConfig(kv_transfer=...) and TransferOptions are checked at construction, naming the
field; a missing Mooncake names the extra and libibverbs1."""

from __future__ import annotations

import sys

import pytest

from aioprefill import EngineConfig, InvalidConfig
from aioprefill.transfer import TransferOptions
from tests.reliability.util import sim


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"kv_transfer": "nixl"}, "EngineConfig.kv_transfer"),
        ({"kv_transfer": True}, "EngineConfig.kv_transfer"),
        ({"kv_transfer_options": {"host": "x"}}, "EngineConfig.kv_transfer_options"),
    ],
)
def test_engine_config_refuses_bad_transfer_fields(fields, match):
    with pytest.raises(InvalidConfig, match=match):
        EngineConfig(model=sim(), **fields)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"host": ""}, "host"),
        ({"host": "127.0.0.1:1234"}, "host"),
        ({"protocol": "udp"}, "protocol"),
        ({"device": 3}, "device"),
        ({"export_ttl_s": 0}, "export_ttl_s"),
        ({"export_ttl_s": -1.0}, "export_ttl_s"),
        ({"export_ttl_s": float("nan")}, "export_ttl_s"),
        ({"export_ttl_s": True}, "export_ttl_s"),
    ],
)
def test_transfer_options_refuse_bad_values(fields, match):
    with pytest.raises(InvalidConfig, match=f"TransferOptions.{match}"):
        TransferOptions(**fields)


def test_defaults_are_loopback_tcp_with_a_ttl():
    options = TransferOptions()
    assert (options.host, options.protocol, options.export_ttl_s) == ("127.0.0.1", "tcp", 60.0)
    assert EngineConfig(model=sim()).kv_transfer is None
    assert TransferOptions(export_ttl_s=None).export_ttl_s is None


def test_missing_mooncake_names_the_extra_and_libibverbs(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # import fails as if absent
    with pytest.raises(InvalidConfig, match=r"aioprefill\[transfer\].*libibverbs1"):
        EngineConfig(model=sim(), kv_transfer="mooncake")
