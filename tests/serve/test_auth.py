"""API keys on a real server (`--model sim`): a request without a valid `Authorization: Bearer`
key is a 401 in OpenAI's error shape and never reaches the engine; /health and /metrics stay open;
failures are counted in /metrics and no key ever appears in the log; the key file is re-read on
SIGHUP (a key added works at once, a key removed stops working); the official client sends its
key as routers and SDKs do."""

from __future__ import annotations

import signal
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aioprefill.serve.auth import APIKeys, cache_salt
from aioprefill.serve.errors import HTTPError
from tests.serve.util import serve

KEY, FILE_KEY, NEW_KEY = "sk-static-0123", "sk-file-4567", "sk-added-89ab"


def metric(url: str, name: str) -> float:
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    return sum(s.value for s in families[name].samples if s.name.endswith("_total"))


def forwards(url: str) -> float:
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    return next(s.value for s in families["aioprefill_ttft_seconds"].samples
                if s.name.endswith("_count"))  # fmt: skip


@pytest.mark.parametrize("front", ["uvicorn", "granian-rsgi"])
def test_keys_guard_every_route_but_health_and_metrics(tmp_path, front):
    keyfile = tmp_path / "keys"
    keyfile.write_text(f"# tenants\n{FILE_KEY}\n\n")
    flags = ["--model", "sim", "--api-key", KEY, "--api-key-file", str(keyfile), "--server", front]
    with serve(*flags) as server:
        url = server.url
        body = {"prompt": [1, 2, 3], "max_tokens": 1}
        before = forwards(url)
        bad = ["Bearer nope", KEY, f"Basic {KEY}", "Bearer x y"]
        for headers in [{}, *({"Authorization": h} for h in bad)]:
            for path in ("/v1/completions", "/v1/embeddings", "/v1/chat/completions",
                         "/v1/completions/render", "/tokenize", "/detokenize"):  # fmt: skip
                r = httpx.post(url + path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers, r.text)
                error = r.json()["error"]
                assert error["type"] == "authentication_error" and "Bearer" in error["message"]
            assert httpx.get(url + "/v1/models", headers=headers).status_code == 401
        assert forwards(url) == before  # nothing refused reached the engine
        assert metric(url, "aioprefill_http_auth_failures") == 5 * 7
        assert httpx.get(url + "/health").status_code == 200  # routers poll it without a key
        for key in (KEY, FILE_KEY):
            with openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0) as client:
                out = client.completions.create(model="sim", prompt=[1, 2, 3], max_tokens=1)
                assert len(out.choices) == 1
        assert forwards(url) == before + 2
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with wrong, pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model="sim", prompt=[1, 2], max_tokens=1)

        # SIGHUP: the file is read again (one key replaced by another)
        keyfile.write_text(f"{NEW_KEY}\n")
        server.proc.send_signal(signal.SIGHUP)
        auth = {"Authorization": f"Bearer {NEW_KEY}"}
        deadline = time.monotonic() + 10
        while httpx.post(url + "/v1/completions", json=body, headers=auth).status_code != 200:
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.05)
        old = httpx.post(url + "/v1/completions", json=body,
                         headers={"Authorization": f"Bearer {FILE_KEY}"})  # fmt: skip
        assert old.status_code == 401
        static = httpx.post(url + "/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
        assert static.status_code == 200  # --api-key keys stay
        server.stop()  # graceful (uvicorn re-raises the SIGTERM it caught: no exit code to check)
        log = server.output()
        assert "API keys reloaded" in log
        for key in (KEY, FILE_KEY, NEW_KEY):
            assert key not in log


def test_tenant_salts_are_digests_combined_with_the_body_salt():
    keys = APIKeys(["a-key", "b-key"], per_key=True)
    a, b = keys.check(b"Bearer a-key"), keys.check("bearer b-key")
    assert a and b and a != b and "a-key" not in a
    assert a == APIKeys(["b-key", "a-key"], per_key=True).check(b"Bearer a-key")  # stable
    assert cache_salt(a, None) == a and cache_salt(None, "s") == "s"
    assert cache_salt(a, "s") not in (a, "s", cache_salt(b, "s"))
    assert cache_salt(None, None) is None
    assert APIKeys(["a-key"]).check(b"Bearer a-key") is None  # shared cache
    with pytest.raises(HTTPError) as info:
        keys.check(b"Bearer a-ke")
    assert info.value.status == 401 and keys.failures == 1
