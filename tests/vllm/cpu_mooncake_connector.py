"""vLLM's MooncakeConnector on a CPU-only torch (a test harness for CPU decode/prefill nodes; GPU
nodes need none). MooncakeConnectorWorker.__init__ starts with
torch.accelerator.current_device_index(), which raises "Cannot access accelerator device when
none is available" on torch+cpu. Use with
  --kv-transfer-config '{"kv_connector": "CpuMooncakeConnector",
                         "kv_connector_module_path": "cpu_mooncake_connector", ...}'
(this file's directory on PYTHONPATH).

A test knob, `AIOPREFILL_TEST_MOONCAKE_RECV_SLACK_S`: a decode waits for its prefill's answer
`VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT` + 60 s (vLLM 0.32, MooncakeConnectorWorker.
receive_kv_from_single_worker: the socket's RCVTIMEO, the 60 s written in the code, "let P wait
timeout first"), then fails the request. Where the variable is set, the slack is that many
seconds instead of 60, so a test of a killed prefill (tests/vllm/test_vllm_decode.py) waits
abort + slack instead of 70 s and more. On a kv_consumer, the abort timeout is used by nothing
else (it is the prefill side's: how long it keeps blocks no decode asked for). Unset, the
connector is vLLM's as shipped."""

import inspect
import os

import torch
import zmq

_current_device_index = torch.accelerator.current_device_index


def _current_device_index_or_0() -> int:
    try:
        return _current_device_index()
    except RuntimeError:
        return 0


torch.accelerator.current_device_index = _current_device_index_or_0

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake import (  # noqa: E402
    mooncake_connector as _mc,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (  # noqa: E402
    MooncakeConnector as CpuMooncakeConnector,
)

VLLM_SLACK_S = 60  # vLLM 0.32's, in receive_kv_from_single_worker


class _RecvSlack:
    """The DEALER socket a decode asks its prefill on, with RCVTIMEO's slack replaced."""

    def __init__(self, sock, slack_s: float) -> None:
        self._sock, self._slack_ms = sock, int(slack_s * 1000)

    def __enter__(self):
        self._sock.__enter__()
        return self

    def __exit__(self, *exc):
        return self._sock.__exit__(*exc)

    def setsockopt(self, option, value):
        if option == zmq.RCVTIMEO:
            value = value - VLLM_SLACK_S * 1000 + self._slack_ms
        return self._sock.setsockopt(option, value)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def _with_recv_slack(slack_s: float) -> None:
    source = inspect.getsource(_mc.MooncakeConnectorWorker.receive_kv_from_single_worker)
    # the code this replaces a constant of; a vLLM that changed it must fail here, not silently
    assert f"VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT + {VLLM_SLACK_S}) * 1000" in source, source
    assert inspect.getsource(_mc).count("make_zmq_socket(") == 1  # that method's socket only
    make = _mc.make_zmq_socket

    def make_zmq_socket(*args, **kwargs):
        return _RecvSlack(make(*args, **kwargs), slack_s)

    _mc.make_zmq_socket = make_zmq_socket


if os.environ.get("AIOPREFILL_TEST_MOONCAKE_RECV_SLACK_S"):
    _with_recv_slack(float(os.environ["AIOPREFILL_TEST_MOONCAKE_RECV_SLACK_S"]))

__all__ = ["CpuMooncakeConnector"]
