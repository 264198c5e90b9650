"""Tenants on one node with a prefix cache: with `--cache-isolation per-key` two API keys never
share a cached block (`usage.prompt_tokens_details.cached_tokens` is 0 for the other key's
prompt, and each key still hits its own cache); a body `cache_salt` splits one key's cache
further; without isolation the same two keys share (the control that shows the measurement can
see a shared block). `--prefix-cache-bytes 0` turns the cache off."""

from __future__ import annotations

import httpx
import pytest

from tests.hf.smollm2 import gguf_path
from tests.serve.util import serve

PROMPT = list(range(1, 200))  # several 16-token blocks


CHAT = [{"role": "user", "content": "Tell me about the sea. " * 20}]


def cached(url: str, key: str, salt: str | None = None, chat: bool = False) -> int:
    path, body = ("/v1/chat/completions", {"messages": CHAT}) if chat else (
        "/v1/completions", {"prompt": PROMPT})  # fmt: skip
    body |= {"max_tokens": 1} | ({"cache_salt": salt} if salt else {})
    r = httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("isolation", ["per-key", "shared"])
def test_two_keys_share_no_block_with_per_key_isolation(isolation):
    flags = ["--model", "sim", "--workers", "1", "--api-key", "key-a", "--api-key", "key-b",
             "--cache-isolation", isolation, "--sim-vocab-size", "49152",
             "--tokenizer", str(gguf_path())]  # fmt: skip
    with serve(*flags) as server:
        url = server.url
        assert cached(url, "key-a") == 0
        hit = cached(url, "key-a")
        assert hit > 0  # the same key: its blocks are read, not computed
        if isolation == "per-key":
            assert cached(url, "key-b") == 0  # the other tenant computes it all
            assert cached(url, "key-b") == hit  # and then hits its own
            assert cached(url, "key-a", salt="s") == 0  # a body salt splits a key's cache
            assert cached(url, "key-a", salt="s") == hit
            assert cached(url, "key-b", salt="s") == 0  # the same body salt, another key
        else:
            assert cached(url, "key-b") == hit  # shared: the other key reads key-a's blocks
        # chat: the same, on the rendered conversation
        assert cached(url, "key-a", chat=True) == 0
        hit = cached(url, "key-a", chat=True)
        assert hit > 0
        assert cached(url, "key-b", chat=True) == (0 if isolation == "per-key" else hit)


def test_prefix_cache_bytes_zero_turns_the_cache_off():
    with serve("--model", "sim", "--workers", "1", "--prefix-cache-bytes", "0") as server:
        assert cached(server.url, "any") == cached(server.url, "any") == 0
    with serve("--model", "sim", "--workers", "1") as server:  # on by default
        assert cached(server.url, "any") == 0 and cached(server.url, "any") > 0
