"""The output options' plumbing without processes: option parsing, the batch's option columns
and their validation, and reading a result's columns back chunk by chunk (lying columns are a
ProtocolError, never a wrong answer)."""

from __future__ import annotations

import numpy as np
import pytest

from aioprefill.config import SimModel
from aioprefill.errors import ProtocolError
from aioprefill.sched.batching import make_prefill_batch
from aioprefill.wire import protocol
from aioprefill.wire.kv import KVExports
from aioprefill.wire.outputs import ResultColumns, option_columns, parse_outputs
from aioprefill.wire.protocol import BatchResult


def parse(**kw):
    base = {
        "prompt_logprobs": False,
        "top_k": 0,
        "embed": None,
        "normalize": False,
        "return_kv": False,
        "vocab_size": 100,
    }
    return parse_outputs(**{**base, **kw})


def test_no_options_cost_nothing_on_the_wire():
    assert parse() is None
    batch = make_prefill_batch(1, [1, 2], [b"\0" * 4, b"\0" * 8], None, None, [], 0, None)
    assert batch.options == b"" and batch.top_k == b"" and batch.kv_names == []
    assert batch.option_arrays() == (None, None, ())


def test_option_columns_round_trip():
    ledger = KVExports(SimModel(), 1 << 20)
    a = parse(prompt_logprobs=True, top_k=3)
    b = parse(embed="mean", normalize=True, return_kv=True, label_token_ids=[9, 4, 9])
    b.kv = ledger.reserve(2)
    cols = option_columns(3, [(0, a), (2, b)])
    batch = make_prefill_batch(7, [1, 2, 3], [b"\0" * 4] * 3, None, None, [], 0, cols)
    decoded = protocol.decode_to_worker(protocol.encode(batch))
    options, top_k, names = decoded.option_arrays()
    assert options.tolist() == [
        protocol.OPT_PROMPT_LOGPROBS,
        0,
        protocol.OPT_EMBED_MEAN | protocol.OPT_NORMALIZE | protocol.OPT_RETURN_KV,
    ]
    assert top_k.tolist() == [3, 0, 0] and names == (b.kv.name,)
    assert np.frombuffer(decoded.labels, "<i4").tolist() == [0, 0, 0, 3, 9, 4, 9]
    assert option_columns(1, [(0, a)])[3] == b""  # no labels: an empty column
    ledger.release(b.kv)


@pytest.mark.parametrize(
    "change",
    [
        {"options": b"\x01"},  # one entry for two requests
        {"top_k": b"\x01\0\0\0"},
        {"top_k": b"\xff\xff\xff\xff\0\0\0\0"},  # negative
        {"options": bytes([protocol.OPT_RETURN_KV, 0])},  # wants KV, no name
        {"options": b"\0\0", "kv_names": ["x"]},  # a name nobody asked for
    ],
)
def test_lying_option_columns_are_protocol_errors(change):
    batch = make_prefill_batch(1, [1, 2], [b"\0" * 4] * 2, None, None, [], 0, None)
    forged = protocol.PrefillBatch(
        **{**{f: getattr(batch, f) for f in batch.__struct_fields__}, **change}
    )
    with pytest.raises(ProtocolError):
        forged.option_arrays()


def result(**columns) -> BatchResult:
    return BatchResult(1, 0, 0, b"", b"", b"", **columns)


def f32(*v) -> bytes:
    return np.asarray(v, dtype="<f4").tobytes()


def test_chunks_assemble_prompt_logprobs_and_take_their_own_values():
    a = parse(prompt_logprobs=True, top_k=2)
    b = parse(embed="last")
    # a: chunk [0, 3) then [3, 5): 2 values then 2; b (whole, 4 tokens): an embedding of 2.
    first = ResultColumns(result(prompt_logprobs=f32(-1, -2)), None)
    assert first.chunk(a, 0, 3, last=False, alive=True) == {}
    assert first.check_consumed()
    second = ResultColumns(
        result(
            prompt_logprobs=f32(-3, -4),
            top_k_ids=np.asarray([5, 6], "<i4").tobytes(),
            top_k_logprobs=f32(-0.1, -0.2),
            embeddings=f32(0.5, 0.25),
            embed_dim=2,
        ),
        None,
    )
    got_a = second.chunk(a, 3, 5, last=True, alive=True)
    got_b = second.chunk(b, 0, 4, last=True, alive=True)
    assert second.check_consumed()
    assert got_a["prompt_logprobs"].tolist() == [-1, -2, -3, -4]
    assert got_a["top_k_ids"].tolist() == [5, 6]
    assert got_a["top_k_logprobs"].dtype == np.float32
    assert got_b == {"embedding": got_b["embedding"]} and got_b["embedding"].tolist() == [0.5, 0.25]


def test_short_or_extra_result_columns_are_caught():
    a = parse(prompt_logprobs=True)
    with pytest.raises(ProtocolError):
        ResultColumns(result(prompt_logprobs=f32(-1)), None).chunk(a, 0, 3, last=True, alive=True)
    extra = ResultColumns(result(prompt_logprobs=f32(-1, -2, -3)), None)
    extra.chunk(a, 0, 3, last=True, alive=True)
    assert not extra.check_consumed()
    with pytest.raises(ProtocolError):
        ResultColumns(result(top_k_ids=b"\0" * 4), None)  # ids without logprobs


def test_contract_names_of_the_second_round():
    """The names ../shared/DESIGN.md fixes for outside checks."""
    import inspect

    import aioprefill

    fields = set(aioprefill.PrefillResult.__struct_fields__)
    assert {"prompt_logprobs", "top_k_ids", "top_k_logprobs", "embedding", "kv"} <= fields
    params = inspect.signature(aioprefill.Engine.prefill).parameters
    for name in ("prompt_logprobs", "top_k", "embed", "normalize", "return_kv"):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
    assert issubclass(aioprefill.errors.KVBudgetExceeded, aioprefill.EngineOverloaded)


def test_label_logprobs_come_with_the_last_chunk_and_lying_label_columns_are_caught():
    from aioprefill.workers.main import _labels

    a = parse(label_token_ids=[3, 1])
    b = parse(top_k=1)
    cols = ResultColumns(
        result(
            label_logprobs=f32(-0.5, -2.0),
            top_k_ids=np.asarray([7], "<i4").tobytes(),
            top_k_logprobs=f32(-0.1),
        ),
        None,
    )
    assert cols.chunk(a, 0, 2, last=False, alive=True) == {}  # not the last chunk: nothing
    assert cols.chunk(a, 2, 4, last=True, alive=True)["label_logprobs"].tolist() == [-0.5, -2.0]
    assert "label_logprobs" not in cols.chunk(b, 0, 4, last=True, alive=True)
    assert cols.check_consumed()
    extra = ResultColumns(result(label_logprobs=f32(-1, -2, -3)), None)
    extra.chunk(a, 0, 3, last=True, alive=True)
    assert not extra.check_consumed()
    batch = make_prefill_batch(1, [1, 2], [b"\0" * 4] * 2, None, None, [], 0, None)
    fields = {f: getattr(batch, f) for f in batch.__struct_fields__}
    good = protocol.PrefillBatch(**{**fields, "labels": np.asarray([0, 0, 1, 5], "<i4").tobytes()})
    assert {k: v.tolist() for k, v in _labels(good).items()} == {
        "label_offsets": [0, 0, 1],
        "label_ids": [5],
    }
    for lie in ([0, 0], [0, 2, 1, 5], [1, 1, 1, 5], [0, 0, 1, -5]):
        forged = protocol.PrefillBatch(**{**fields, "labels": np.asarray(lie, "<i4").tobytes()})
        with pytest.raises(ProtocolError):
            _labels(forged)
    with pytest.raises(ProtocolError):
        _labels(protocol.PrefillBatch(**{**fields, "labels": b"\0" * 13}))
