"""What runs inside a worker process: no asyncio here, and the only place that imports paddle.

`main` is the process entry point (rings in, forward, rings out); `runner` the model-agnostic
runner interface; `sim` and `sim_cache` the `SimModel` worker (sleeps a cost model's time);
`group`, `barrier` and `collectives` tensor/expert-parallel ranks; `kv_writer`, `prefix_blocks`
and `store_hook` the KV export, prefix-cache blocks and KV-store hook; `rope` the rotary
tables; `paddle/` the PaddlePaddle model itself.

May import: `wire`, `shm`, `hf` (checkpoint readers), `kvstore`, `config` and the specs.
"""
