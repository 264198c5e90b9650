"""API keys (`--api-key KEY`, repeatable, and `--api-key-file PATH`, one key a line, re-read on
SIGHUP) and the tenants they make (`--cache-isolation per-key`).

Every `/v1/*`, `/tokenize` and `/detokenize` request must carry `Authorization: Bearer KEY` with
a key of the set; anything else is a 401 (OpenAI's error object) before the body is read, so it
costs no forward. `/health`, `/metrics` and `/server_info` stay open: routers and scrapers poll
them without credentials (vllm-router's health checks, Prometheus). The check compares SHA-256
digests with `hmac.compare_digest` against every key, so its time does not depend on which key
matched or how much of one did. Keys are never logged; failed checks are counted (`/metrics`:
`aioprefill_http_auth_failures_total`).

With per-key isolation each key is its own prefix-cache namespace: the key's digest (never the
key) salts the cache, combined with any `cache_salt` the body carries, so tenants sharing a node
never share a cached block and cannot learn each other's prompts from time-to-first-token (the side
channel vLLM closed with `cache_salt`, CVE-2025-46570).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from pathlib import Path

from aioprefill.errors import InvalidConfig
from aioprefill.serve.errors import HTTPError

__all__ = ["PROTECTED_PREFIXES", "APIKeys", "cache_salt", "is_protected"]

log = logging.getLogger("aioprefill.serve")

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/rerank", "/score", "/embed")
_TENANT = b"aioprefill-tenant\x00"  # the salt is a digest of this and the key, never the key


def is_protected(path: str) -> bool:
    return path.startswith(PROTECTED_PREFIXES)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class APIKeys:
    """The keys a server accepts: `check(header)` for each request, `reload()` on SIGHUP."""

    def __init__(self, keys: list[str], file: str | None = None, *, per_key: bool = False) -> None:
        self._static = [k for k in keys if k]
        if len(self._static) != len(keys):
            raise InvalidConfig("--api-key must not be empty")
        self.file = Path(file) if file is not None else None
        self.per_key = per_key
        self.failures = 0  # failed checks, for /metrics
        self._digests: list[bytes] = []
        self._salts: dict[bytes, str] = {}
        self._load(first=True)

    @property
    def count(self) -> int:
        return len(self._digests)

    def reload(self) -> None:
        """Re-read the key file (SIGHUP); a file that cannot be read keeps the old keys."""
        try:
            self._load(first=False)
        except InvalidConfig as exc:
            log.error("aioprefill-serve: API keys not reloaded, keeping %d: %s", self.count, exc)
        else:
            log.warning("aioprefill-serve: API keys reloaded: %d keys", self.count)

    def _load(self, *, first: bool) -> None:
        keys = list(self._static)
        if self.file is not None:
            try:
                text = self.file.read_text(encoding="utf-8")
            except OSError as exc:
                raise InvalidConfig(f"--api-key-file {self.file}: {exc.strerror}") from None
            keys += [line.strip() for line in text.splitlines()]
            keys = [k for k in keys if k and not k.startswith("#")]
            if not keys and first:
                log.warning(
                    "aioprefill-serve: %s holds no key: every request is refused", self.file
                )
        raw = [k.encode() for k in keys]
        self._digests = [_digest(k) for k in raw]
        self._salts = {
            d: hashlib.sha256(_TENANT + k).hexdigest()[:32]
            for d, k in zip(self._digests, raw, strict=True)
        }

    def check(self, authorization: bytes | str | None) -> str | None:
        """The tenant's cache salt (per-key isolation) or None; `HTTPError(401)` when the header
        carries no key of the set."""
        token = b""
        if authorization:
            value = authorization.encode() if isinstance(authorization, str) else authorization
            scheme, _, rest = value.partition(b" ")
            if scheme.lower() == b"bearer":
                token = rest.strip()
        given = _digest(token)
        match = None
        for d in self._digests:  # every key compared, whichever matches
            if hmac.compare_digest(given, d) and token:
                match = d
        if match is None:
            self.failures += 1
            why = "a valid API key" if token else "an API key"
            raise HTTPError(401, f"this server needs {why}: send 'Authorization: Bearer KEY'")
        return self._salts[match] if self.per_key else None


def cache_salt(tenant: str | None, body: str | None) -> str | None:
    """The prefix-cache salt of a request: the tenant's (per-key isolation) combined with the
    body's `cache_salt`, either alone, or None (shared cache)."""
    if tenant is None:
        return body
    return tenant if body is None else f"{tenant}/{body}"
