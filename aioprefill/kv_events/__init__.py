"""KV events: a node's prefix-cache blocks published as vLLM KV events (ZMQ), so that
vllm-router's `--policy kv_aware` sends each request to the node holding most of its prompt.
See docs/kv-events.md."""

from aioprefill.kv_events.node import NodeBlocks
from aioprefill.kv_events.publisher import KVEventPublisher, default_replay_endpoint

__all__ = ["KVEventPublisher", "NodeBlocks", "default_replay_endpoint"]
