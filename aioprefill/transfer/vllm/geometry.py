"""The checks a decode node's `XferMetadata` passes before any byte is written, and the write
plan: which of its registered bytes each of our pages goes to.

vLLM's connector has no compatibility hash, so a layout the decode does not expect is silent
garbage: every check that its message allows is made here, each failure a `GeometryError`
naming the field (the side channel answers ERROR with it). What is checked: pipeline stages
(1), tensor-parallel pairing (the decode's TP size divides our KV heads: one prefill rank
serves every decode rank its heads), one region per layer (count, names and indices agree),
one KV group, the page size (`kv_heads/tp x block_size x 2 x head_dim x itemsize`, which gives
the dtype or block size where only one is configured), strides, the block count against the
prompt, and each block id inside its region where the regions tell their extent (one
allocation, layer-major, as vLLM allocates: the distance between two regions' bases).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass

from aioprefill.errors import InvalidRequest
from aioprefill.transfer.vllm.messages import XferMetadata
from aioprefill.transfer.vllm.pages import DEFAULT_BLOCK_SIZE, DTYPES, LAYOUTS, PageGeometry

__all__ = ["GeometryError", "KVShape", "Plan", "Regions", "Settings", "check_metadata", "plan"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_MAX_ADDRESS = 1 << 64


class GeometryError(InvalidRequest):
    """A decode node's geometry does not fit this prefill node's export: `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(slots=True, frozen=True)
class KVShape:
    """This prefill node's KV export, per token."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(slots=True, frozen=True)
class Settings:
    """What the decode's message does not say: its page layout, and its dtype and block size
    where configured (None: learned from the page size, the other one given)."""

    layout: str = "cpu"
    dtype: str | None = None  # "float32" | "bfloat16" | None
    block_size: int | None = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise InvalidRequest(f"vLLM KV layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InvalidRequest(f"vLLM KV dtype must be one of {tuple(DTYPES)}: {self.dtype!r}")
        if self.block_size is not None and self.block_size <= 0:
            raise InvalidRequest(f"vLLM block size must be > 0, got {self.block_size}")


@dataclass(slots=True, frozen=True)
class Regions:
    """A checked message's regions, in its order: each one's layer, base, stride, extent."""

    geometry: PageGeometry
    first_head: int
    layers: tuple[int, ...]
    bases: tuple[int, ...]
    strides: tuple[int, ...]
    extent: int | None  # bytes of each region when they tell it, else None
    session: str  # the decode's transfer engine, "host:port"


@dataclass(slots=True, frozen=True)
class Plan:
    """One request's write: pages `[region][block]` in staging, and the descriptors."""

    first_block: int
    num_blocks: int
    nbytes: int  # staging bytes
    src_offsets: list[int]  # into staging
    dst: list[int]
    lengths: list[int]


def _fail(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise GeometryError(field, message)


def _layers(meta: XferMetadata, n: int, num_layers: int) -> list[int]:
    names, indices = meta.registered_layer_names, meta.registered_layer_indices
    _fail(not names or len(names) == n, "registered_layer_names", f"{len(names)} for {n} regions")
    _fail(not indices or len(indices) == n, "registered_layer_indices", f"{len(indices)} for {n}")
    from_names = []
    for name in names:
        m = _LAYER.search(name)
        _fail(m is not None, "registered_layer_names", f"{name!r} names no layer index")
        assert m is not None
        from_names.append(int(m.group(1)))
    if indices and from_names:
        _fail(list(indices) == from_names, "registered_layer_indices", "disagree with the names")
    layers = list(indices or from_names or range(n))
    _fail(
        sorted(layers) == list(range(num_layers)),
        "registered_layer_names",
        f"the decode registered {n} regions for layers {sorted(set(layers))[:4]}..., "
        f"this model has {num_layers} layers (one region each)",
    )
    return layers


def _page(meta: XferMetadata, shape: KVShape, settings: Settings, heads: int) -> PageGeometry:
    pages = set(meta.kv_block_lens)
    _fail(len(pages) == 1, "kv_block_lens", f"pages differ between regions: {sorted(pages)}")
    page = pages.pop()
    unit = heads * 2 * shape.head_dim  # elements per token slot
    want = f"kv_heads/tp ({heads}) x block_size x 2 x head_dim ({shape.head_dim}) x itemsize"
    dtype, bs = settings.dtype, settings.block_size
    if dtype is None and bs is None:
        bs = DEFAULT_BLOCK_SIZE[settings.layout]
    if dtype is None:
        assert bs is not None
        fits = [d for d, size in DTYPES.items() if page == unit * bs * size]
        _fail(bool(fits), "kv_block_lens", f"page of {page} bytes is not {want} at block_size {bs}")
        dtype = fits[0]
    itemsize = DTYPES[dtype]
    if bs is None:
        _fail(page % (unit * itemsize) == 0, "kv_block_lens", f"page of {page} bytes is not {want}")
        bs = page // (unit * itemsize)
    _fail(
        page == unit * bs * itemsize,
        "kv_block_lens",
        f"page of {page} bytes, expected {want} = {unit * bs * itemsize} ({dtype}, block {bs})",
    )
    return PageGeometry(settings.layout, dtype, heads, bs, shape.head_dim)


def check_metadata(meta: XferMetadata, shape: KVShape, settings: Settings) -> Regions:
    """The message-level checks; the regions to write to."""
    _fail(meta.remote_pp_size == 1, "remote_pp_size", f"{meta.remote_pp_size}, only 1 is served")
    tp, rank = meta.remote_tp_size, meta.remote_tp_rank
    _fail(
        tp >= 1 and shape.num_kv_heads % tp == 0,
        "remote_tp_size",
        f"{tp} does not divide this model's {shape.num_kv_heads} KV heads",
    )
    _fail(0 <= rank < tp, "remote_tp_rank", f"{rank} is not below remote_tp_size {tp}")
    n = len(meta.kv_caches_base_addr)
    _fail(len(meta.block_lens) == n, "block_lens", f"{len(meta.block_lens)} for {n} regions")
    _fail(len(meta.kv_block_lens) == n, "kv_block_lens", f"{len(meta.kv_block_lens)} for {n}")
    groups = set(meta.registered_group_indices)
    _fail(groups <= {0}, "registered_group_indices", f"{sorted(groups)}: one KV group only")
    rows = set(meta.registered_row_offsets)
    _fail(rows <= {-1}, "registered_row_offsets", "packed-row regions are not supported")
    layers = _layers(meta, n, shape.num_layers)
    heads = shape.num_kv_heads // tp
    geometry = _page(meta, shape, settings, heads)
    for i, (base, stride) in enumerate(zip(meta.kv_caches_base_addr, meta.block_lens, strict=True)):
        _fail(0 < base < _MAX_ADDRESS, "kv_caches_base_addr", f"region {i}: {base}")
        _fail(stride >= geometry.page_bytes, "block_lens", f"region {i}: {stride} < the page")
    bases = list(meta.kv_caches_base_addr)
    steps = {b - a for a, b in itertools.pairwise(bases)}
    extent = steps.pop() if len(steps) == 1 and n > 1 and min(bases[1:]) > bases[0] else None
    host, port = meta.remote_hostname, meta.remote_port
    _fail(bool(host) and ":" not in host, "remote_hostname", f"{host!r}")
    _fail(0 < port < 65536, "remote_port", f"{port}")
    return Regions(
        geometry,
        rank * heads,
        tuple(layers),
        tuple(bases),
        tuple(meta.block_lens),
        extent,
        f"{host}:{port}",
    )


def plan(regions: Regions, blocks: Sequence[int], num_tokens: int) -> Plan:
    """One request's checks (its block ids against the prompt and the regions) and writes.
    Consecutive block ids of a region with stride == page become one descriptor."""
    g = regions.geometry
    total = -(-num_tokens // g.block_size)
    nb = len(blocks)
    _fail(nb > 0, "req_blocks", "no blocks asked")
    _fail(
        nb <= total,
        "req_blocks",
        f"the decode asks for {nb} blocks; the prompt's {num_tokens} tokens fill {total} "
        f"of block_size {g.block_size} (the prompts differ?)",
    )
    _fail(len(set(blocks)) == nb, "req_blocks", "a block id appears twice")
    page = g.page_bytes
    for b in blocks:
        _fail(b >= 0, "req_blocks", f"block id {b}")
        for base, stride in zip(regions.bases, regions.strides, strict=True):
            end = base + b * stride + page
            inside = regions.extent is None or b * stride + page <= regions.extent
            _fail(inside and end < _MAX_ADDRESS, "req_blocks", f"block {b} is outside a region")
    src: list[int] = []
    dst: list[int] = []
    lengths: list[int] = []
    for r, (base, stride) in enumerate(zip(regions.bases, regions.strides, strict=True)):
        for j, b in enumerate(blocks):
            s, d = (r * nb + j) * page, base + b * stride
            if lengths and stride == page and j and blocks[j - 1] + 1 == b:
                lengths[-1] += page
            else:
                src.append(s)
                dst.append(d)
                lengths.append(page)
    return Plan(total - nb, nb, len(regions.bases) * nb * page, src, dst, lengths)
