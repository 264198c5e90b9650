"""A zero-cost prefill behind mosec (Rust HTTP front, Python worker process), for
benchmarks/bench_serve.py: POST /inference {"prompt": [ids...]} -> {"token": crc32 % vocab}, the
SimModel's answer, computed in mosec's worker with no forward cost.

    python benchmarks/tools/mosec_server.py --port 8000
"""

from __future__ import annotations

import zlib

import numpy as np
from mosec import Server, Worker


class Prefill(Worker):
    def forward(self, data: dict) -> dict:
        ids = np.asarray(data["prompt"], dtype="<i4")
        return {"token": zlib.crc32(ids.tobytes()) % 32000}


if __name__ == "__main__":
    server = Server()  # reads --port from the command line
    server.append_worker(Prefill, num=1)
    server.run()
