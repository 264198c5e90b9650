"""A stand-in for a vLLM decode node's MooncakeConnector (kv_consumer), for the tests of
`--kv-transfer vllm-mooncake` without vLLM: its own Mooncake transfer engine and a registered
"KV cache" (one allocation, layer-major, as vLLM's), pyzmq's DEALER to the prefill's side
channel, vLLM's message built with aioprefill's msgspec mirror (whose wire form
tests/transfer/test_vllm_pages.py checks against a real decode's)."""

from __future__ import annotations

import httpx
import numpy as np
import zmq

from aioprefill.transfer.vllm import messages

SENTINEL = 0xAB


class FakeDecode:
    def __init__(self, num_layers: int, page: int, num_blocks: int = 8) -> None:
        from mooncake.engine import TransferEngine

        self.te = TransferEngine()
        assert self.te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        self.port = self.te.get_rpc_port()
        self.num_layers, self.page, self.num_blocks = num_layers, page, num_blocks
        self.region = page * num_blocks
        self.cache = np.full(num_layers * self.region, SENTINEL, np.uint8)
        self.addr = self.cache.ctypes.data
        assert self.te.register_memory(self.addr, self.cache.nbytes) == 0
        self.ctx = zmq.Context()

    def close(self) -> None:
        self.te.unregister_memory(self.addr)
        self.ctx.term()
        self.te = None

    def reset(self) -> None:
        self.cache[:] = SENTINEL

    def metadata(self, req_blocks: dict, *, tp_size: int = 1, tp_rank: int = 0, **changes):
        n = self.num_layers
        fields = dict(
            remote_hostname="127.0.0.1",
            remote_port=self.port,
            remote_tp_size=tp_size,
            remote_tp_rank=tp_rank,
            req_blocks=req_blocks,
            kv_caches_base_addr=[self.addr + i * self.region for i in range(n)],
            block_lens=[self.page] * n,
            kv_block_lens=[self.page] * n,
            registered_layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(n)],
            registered_layer_indices=list(range(n)),
            registered_group_indices=[0] * n,
            registered_shared_group_ids=[[0]] * n,
            registered_row_offsets=[-1] * n,
        )
        fields.update(changes)
        return messages.XferMetadata(**fields)

    def ask(self, side_channel: str, *frames: bytes, timeout_s: float = 60.0):
        """Send one message (frames as given) on a fresh DEALER, as vLLM does; the answer."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        sock.connect(side_channel)
        try:
            sock.send_multipart(list(frames))
            return messages.decode_response(sock.recv())
        finally:
            sock.close(0)

    def pages(self, layer: int, block: int, count: int = 1) -> bytes:
        at = layer * self.region + block * self.page
        return self.cache[at : at + count * self.page].tobytes()

    def untouched(self, skip: set[tuple[int, int]]) -> bool:
        """Every page but (layer, block) in `skip` still holds the sentinel."""
        view = self.cache.reshape(self.num_layers, self.num_blocks, self.page)
        return all(
            (view[layer, b] == SENTINEL).all()
            for layer in range(self.num_layers)
            for b in range(self.num_blocks)
            if (layer, b) not in skip
        )


def side_channel(bootstrap: str) -> tuple[str, str]:
    """(engine id, side channel address) from the prefill's bootstrap `GET /query`."""
    entry = httpx.get(bootstrap + "/query", timeout=10).json()["0"]
    return entry["engine_id"], entry["worker_addr"]["0"]["0"]
