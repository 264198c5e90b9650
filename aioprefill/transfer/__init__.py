"""KV transfer: a prefill engine's KV exports pulled by decode nodes through Mooncake's
transfer engine (extra `aioprefill[transfer]`).

Prefill side: `EngineConfig(kv_transfer="mooncake", kv_transfer_options=TransferOptions(...))`,
then `r.kv.transfer_params()` (a plain JSON dict). Decode side, no Engine:

    from aioprefill.transfer import pull_kv, release_kv
    kv = pull_kv(params)          # kv.keys, kv.values: [layers, kv_heads, tokens, head_dim]
    release_kv(params)            # the prefill engine may reuse the export's memory now

docs/kv-export.md ("Pulling from another host") says how it works and what it guarantees.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aioprefill.transfer.options import TransferOptions

if TYPE_CHECKING:
    from aioprefill.transfer.pull import PulledKV, pull_kv, release_kv

__all__ = ["PulledKV", "TransferOptions", "pull_kv", "release_kv"]


def __getattr__(name: str) -> Any:
    # The decode side is imported on first use: aioprefill.config imports this package for
    # TransferOptions, and the decode side imports aioprefill.wire.kv, which imports the config.
    if name in ("PulledKV", "pull_kv", "release_kv"):
        from aioprefill.transfer import pull

        return getattr(pull, name)
    raise AttributeError(f"module 'aioprefill.transfer' has no attribute {name!r}")
