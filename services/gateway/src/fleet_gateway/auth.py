"""API keys: who may call what on the gateway.

Three levels: open (health, the API document, the dashboard's static files), user (the model APIs
and every read of cluster state) and admin (staging and deleting models, creating and deleting
instances). Keys come as `Authorization: Bearer <key>` (OpenAI, Ollama clients), `x-api-key` (Anthropic
clients), or, for GET requests only, the dashboard's `fleet_api_key` cookie (EventSource cannot set
headers; the cookie is SameSite=Strict, and no GET changes anything).

Keys are compared as SHA-256 digests with `hmac.compare_digest`, against every configured key with
no early exit, so timing tells nothing about a key; a key is never logged, and limits and logs name
a caller by `identity` (a short digest), never by the key.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from aiohttp import web

from fleet_gateway.errors import ApiError, Handler

OPEN, USER, ADMIN = "open", "user", "admin"
OPEN_PATHS = frozenset({"/", "/health", "/openapi.json", "/api/version", "/ollama/api/version"})
ADMIN_POSTS = frozenset({"/models", "/downloads", "/instances", "/admission/priorities"})
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
KEY_COOKIE = "fleet_api_key"
IDENTITY = "fleet_identity"  # request key: who is calling, for limits
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="fleet"'}  # RFC 6750: a 401 names the scheme


def required_access(method: str, path: str) -> str:
    """The level a request needs (pure: method and path only)."""
    if method in READ_METHODS and (path in OPEN_PATHS or path.startswith("/ui/")):
        return OPEN
    if method in ("DELETE", "PUT") or (method == "POST" and path in ADMIN_POSTS):
        return ADMIN
    return USER


def presented_key(method: str, headers: Mapping[str, str], cookies: Mapping[str, str]) -> str:
    """The key a request carries, "" when none."""
    authorization = headers.get("Authorization", "")
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    if headers.get("x-api-key", "").strip():
        return headers["x-api-key"].strip()
    if method in READ_METHODS:
        return cookies.get(KEY_COOKIE, "")
    return ""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def identity(key: str) -> str:
    """A caller's name in limits and logs: 12 hex digits of its key's digest."""
    return "key-" + _digest(key).hex()[:12]


def _split(keys: str) -> tuple[bytes, ...]:
    return tuple(_digest(k.strip()) for k in keys.split(",") if k.strip())


@dataclass(frozen=True)
class KeyRing:
    """The configured keys, as digests. Empty: auth is off (every level is granted)."""

    user: tuple[bytes, ...] = ()
    admin: tuple[bytes, ...] = ()

    @classmethod
    def from_settings(cls, api_keys: str, admin_keys: str) -> KeyRing:
        return cls(_split(api_keys), _split(admin_keys))

    @property
    def enabled(self) -> bool:
        return bool(self.user or self.admin)

    def level(self, key: str) -> str:
        """ADMIN, USER, or "" for a key that is not configured (constant time in the key)."""
        digest = _digest(key)
        is_admin = is_user = False
        for known in self.admin:
            is_admin |= hmac.compare_digest(digest, known)
        for known in self.user:
            is_user |= hmac.compare_digest(digest, known)
        return ADMIN if is_admin else (USER if is_user else "")


def check_access(keys: KeyRing, needed: str, key: str) -> None:
    """ApiError 401 (no or unknown key) / 403 (an API key on an admin endpoint); None when allowed."""
    if needed == OPEN or not keys.enabled:
        return
    if not key:
        raise ApiError(
            401,
            "Missing API key: send it as 'Authorization: Bearer <key>' (or 'x-api-key: <key>').",
            code="missing_api_key",
            headers=CHALLENGE,
        )
    level = keys.level(key)
    if not level:
        raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key", headers=CHALLENGE)
    if needed == ADMIN and level != ADMIN:
        raise ApiError(403, "This endpoint needs an admin key.", code="admin_key_required")


def auth_middleware(keys: KeyRing):
    """Refuses requests without the key their path needs; records the caller's identity."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        key = presented_key(request.method, request.headers, request.cookies)
        check_access(keys, required_access(request.method, request.path), key)
        request[IDENTITY] = identity(key) if key and keys.enabled else f"addr-{request.remote or 'unknown'}"
        return await handler(request)

    return middleware
