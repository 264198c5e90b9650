"""KV events: a node's prefix-cache blocks published as vLLM KV events (ZMQ), so that
vllm-router's `--policy kv_aware` sends each request to the node holding most of its prompt.
See docs/kv-events.md."""

from aioprefill.kv_events.node import NodeBlocks
from aioprefill.kv_events.publisher import (
    KVEventPublisher,
    NoKVEvents,
    default_replay_endpoint,
    kv_events_for,
)

__all__ = [
    "KVEventPublisher",
    "NoKVEvents",
    "NodeBlocks",
    "default_replay_endpoint",
    "kv_events_for",
]
