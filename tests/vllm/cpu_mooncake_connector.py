"""vLLM's MooncakeConnector on a CPU-only torch (a test harness for CPU decode/prefill nodes; GPU
nodes need none). MooncakeConnectorWorker.__init__ starts with
torch.accelerator.current_device_index(), which raises "Cannot access accelerator device when
none is available" on torch+cpu. Use with
  --kv-transfer-config '{"kv_connector": "CpuMooncakeConnector",
                         "kv_connector_module_path": "cpu_mooncake_connector", ...}'
(this file's directory on PYTHONPATH)."""

import torch

_current_device_index = torch.accelerator.current_device_index


def _current_device_index_or_0() -> int:
    try:
        return _current_device_index()
    except RuntimeError:
        return 0


torch.accelerator.current_device_index = _current_device_index_or_0

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (  # noqa: E402
    MooncakeConnector as CpuMooncakeConnector,
)

__all__ = ["CpuMooncakeConnector"]
