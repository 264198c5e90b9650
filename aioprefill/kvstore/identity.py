"""Store keys: which model, layout and rank a block belongs to, so two models, two dtypes or
two tensor-parallel layouts never read each other's blocks.

A key is `aiop1/<identity>/<block hash>`: the identity a 32-hex-digit BLAKE2b digest of
everything that changes a block's bytes (the model's identity, dtype, the slot layout, the
block size, the TP rank and size), the block hash the engine's 64-bit chained hash (the
request's `cache_salt` is inside it, on the first block). The same digest is written in every
value's header (`kvstore.value`), so a value copied under another key is refused too.

The model's identity is `KVStoreOptions.model_id` when given, else `weights_digest`: a digest
of the model spec and of sampled bytes of its weight files (sizes, the first and last MiB and
64 pieces between), the same on every node holding a copy of the same files, different for
two fine-tunes of one architecture (every weight differs), and cheap to compute at start.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["StoreIdentity", "weights_digest"]

_EDGE = 1 << 20
_PIECES = 64
_PIECE = 64 << 10


def _sample_file(h: hashlib.blake2b, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with path.open("rb") as f:
        if size <= 2 * _EDGE + _PIECES * _PIECE:
            h.update(f.read())
            return
        h.update(f.read(_EDGE))
        step = (size - 2 * _EDGE) // _PIECES
        for i in range(_PIECES):
            f.seek(_EDGE + i * step)
            h.update(f.read(_PIECE))
        f.seek(size - _EDGE)
        h.update(f.read(_EDGE))


def weights_digest(spec: bytes, weights: str | os.PathLike[str] | None) -> str:
    """A hex digest of the model spec's encoding and of sampled bytes of its weight files
    (`weights`: a checkpoint directory's *.safetensors / *.bin / *.gguf files, or one file;
    None: the spec alone, e.g. seeded random weights)."""
    h = hashlib.blake2b(spec, digest_size=16)
    if weights is not None:
        path = Path(weights)
        files = (
            [path]
            if path.is_file()
            else sorted(
                p
                for p in path.iterdir()
                if p.suffix in (".safetensors", ".bin", ".gguf", ".pdparams")
            )
        )
        for p in files:
            _sample_file(h, p)
    return h.hexdigest()


@dataclass(slots=True, frozen=True)
class StoreIdentity:
    """One worker's (one rank's) place in the store's key space. `layout` names the slot's
    byte layout (the block store's own description: layers, KV heads of this rank, head size,
    dtype, what per-position outputs a slot holds)."""

    model: str
    dtype: str
    layout: str
    block_tokens: int
    tp_rank: int = 0
    tp_size: int = 1
    # 16 bytes naming every field above: in every key and every value header.
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parts = (self.model, self.dtype, self.layout, str(self.block_tokens))
        text = "\x1f".join((*parts, f"{self.tp_rank}/{self.tp_size}"))
        object.__setattr__(self, "digest", hashlib.blake2b(text.encode(), digest_size=16).digest())

    def key(self, block_hash: int) -> str:
        """The store key of one block (`block_hash`: the engine's 64-bit hash, any sign)."""
        return f"aiop1/{self.digest.hex()}/{block_hash & 0xFFFFFFFFFFFFFFFF:016x}"
