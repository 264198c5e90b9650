"""`EngineConfig.kv_events_endpoint` / `--kv-events-endpoint`: checked once, at construction."""

from __future__ import annotations

import pytest

from aioprefill.config import EngineConfig
from aioprefill.errors import InvalidConfig
from tests.serve.test_cli import run


@pytest.mark.parametrize(
    "endpoint", ["127.0.0.1:5557", "tcp://:5557", "tcp://h:0", "tcp://h:x", "ipc:///tmp/k", 5557]
)
def test_a_bad_endpoint_names_the_field(endpoint):
    with pytest.raises(InvalidConfig, match=r"EngineConfig\.kv_events_endpoint: must be 'tcp://"):
        EngineConfig(kv_events_endpoint=endpoint)


def test_replay_needs_the_stream_and_a_good_address():
    with pytest.raises(InvalidConfig, match="kv_events_replay_endpoint: needs kv_events_endpoint"):
        EngineConfig(kv_events_replay_endpoint="tcp://127.0.0.1:5558")
    with pytest.raises(InvalidConfig, match="kv_events_replay_endpoint: must be"):
        EngineConfig(kv_events_endpoint="tcp://*:5557", kv_events_replay_endpoint="tcp://h")


def test_good_endpoints_pass():
    c = EngineConfig(kv_events_endpoint="tcp://*:5557", kv_events_replay_endpoint="tcp://[::1]:9")
    assert c.kv_events_endpoint == "tcp://*:5557"


def test_the_serve_flag_reaches_the_config_check():
    assert "--kv-events-endpoint" in run("--help").stdout
    done = run("--model", "sim", "--kv-events-endpoint", "localhost:5557")
    assert done.returncode != 0 and "EngineConfig.kv_events_endpoint" in done.stderr
    assert "Traceback" not in done.stderr
