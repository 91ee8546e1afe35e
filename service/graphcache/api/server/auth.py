"""The API key of the inference API: GRAPHCACHE_API_KEY, as vLLM's --api-key.

With keys set (settings.http.api_key: one or several), `require_api_key` (a dependency of the /v1 routers
and of /tokenize, /detokenize) wants `Authorization: Bearer <key>` with any one of them; without it,
or with a wrong key, the answer is a 401 in OpenAI's shape (`code: invalid_api_key`,
`WWW-Authenticate: Bearer`), so the official clients raise their AuthenticationError. Probes, /metrics,
/ping and /version stay open; /admin/* keeps its own token (admin.py). No keys: the API is open.

The key is compared as the header's bytes (Starlette decodes header values as Latin-1, so encoding
back gives the wire bytes; keys are ASCII, settings/http.py refuses others) against every configured key,
without stopping at the first match, and through SHA-256 digests, so neither which key matched nor
any key's length shows in the time taken. As a router dependency, the check runs before the body is
validated, so a caller without a key learns nothing from validation errors; only a body that is not
JSON at all is a 400 first (FastAPI parses JSON before it runs dependencies).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from fastapi import Request

from graphcache.api.server.errors import APIError

__all__ = ["bearer_token", "key_matches", "require_api_key"]

_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def key_matches(given: bytes, keys: Iterable[str]) -> bool:
    """Is `given` one of `keys`? Every key is compared (no early exit), each in constant time."""
    given_digest = _digest(given)
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given_digest, _digest(key.encode("ascii")))
    return matched


def bearer_token(request: Request) -> bytes | None:
    """The credential of an 'Authorization: Bearer <credential>' header, as bytes received; None without
    one. Starlette decodes header values as Latin-1, so encoding back gives the wire bytes exactly: a
    configured credential is ASCII (Settings refuses others), so a client's UTF-8 and Latin-1 spellings of
    a non-ASCII one are both simply wrong, never one accepted and one not."""
    scheme, _, given = request.headers.get("authorization", "").encode("latin-1").partition(b" ")
    given = given.strip()
    return given if scheme.lower() == b"bearer" and given else None


def require_api_key(request: Request) -> None:
    keys = request.app.state.settings.http.api_key
    if not keys:
        return
    given = bearer_token(request)
    if given is None:
        raise APIError(
            401,
            "You did not provide an API key: send 'Authorization: Bearer <key>' with a key of "
            "this server (GRAPHCACHE_API_KEY).",
            type="invalid_request_error",
            code="invalid_api_key",
            headers=_CHALLENGE,
        )
    if not key_matches(given, keys):
        raise APIError(
            401,
            "Incorrect API key provided: send one of this server's keys (GRAPHCACHE_API_KEY) "
            "as 'Authorization: Bearer <key>'.",
            type="invalid_request_error",
            code="invalid_api_key",
            headers=_CHALLENGE,
        )
