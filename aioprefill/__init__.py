"""aioprefill: forward-aware prefill batching for asyncio servers."""
