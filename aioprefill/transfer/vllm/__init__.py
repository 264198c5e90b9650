"""vLLM's MooncakeConnector, the prefill side's protocol pieces (no engine, no sockets): what
`aioprefill.serve --kv-transfer vllm-mooncake` speaks so that a stock vLLM decode node
(`kv_role: kv_consumer`) continues aioprefill's prompts (docs/serving.md, "vLLM decode nodes").

| module | what it holds |
| --- | --- |
| `messages.py` | msgspec mirrors of vLLM 0.32's `MooncakeXferMetadata` / `MooncakeXferResponse` |
| `pages.py` | the decode's page layouts (`cpu`, `gpu`), bf16 rounding, packing an export's KV |
| `geometry.py` | the checks before any byte is written, and the write plan (descriptors) |
| `staging.py` | registered staging buffers for the packed pages, reused |

Imports only the wire layer and below (numpy, msgspec): the runtime glue (bootstrap server,
ZMQ side channel, the transfer-id table) lives in `aioprefill/serve/vllm_pd.py`.
"""
