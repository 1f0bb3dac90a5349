"""Who may call what (pure: paths, headers, keys)."""

from __future__ import annotations

import pytest

from fleet_gateway.auth import (
    ADMIN,
    OPEN,
    USER,
    KeyRing,
    check_access,
    identity,
    presented_key,
    required_access,
)
from fleet_gateway.errors import ApiError

pytestmark = pytest.mark.unit

KEYS = KeyRing.from_settings("user-1, user-2", "admin-1")


@pytest.mark.parametrize(
    ("method", "path", "needed"),
    [
        ("GET", "/health", OPEN),
        ("GET", "/", OPEN),
        ("GET", "/ui/app.js", OPEN),
        ("GET", "/openapi.json", OPEN),
        ("GET", "/api/version", OPEN),
        ("POST", "/v1/chat/completions", USER),
        ("POST", "/v1/messages", USER),
        ("POST", "/api/chat", USER),
        ("GET", "/v1/models", USER),
        ("GET", "/state", USER),
        ("GET", "/events", USER),
        ("GET", "/instances", USER),
        ("GET", "/no/such/path", USER),  # no route enumeration without a key
        ("POST", "/health", USER),
        ("POST", "/models", ADMIN),
        ("POST", "/downloads", ADMIN),
        ("POST", "/instances", ADMIN),
        ("DELETE", "/instances/i-1", ADMIN),
        ("DELETE", "/downloads/org/model", ADMIN),
        ("PUT", "/scaling/org/model", ADMIN),
        ("GET", "/scaling/org/model", USER),
    ],
)
def test_each_path_needs_its_level(method: str, path: str, needed: str):
    assert required_access(method, path) == needed


def test_keys_come_from_bearer_then_x_api_key_then_the_cookie_on_reads_only():
    cookie = {"fleet_api_key": "from-cookie"}
    assert presented_key("POST", {"Authorization": "Bearer  k1 "}, cookie) == "k1"
    assert presented_key("POST", {"Authorization": "bearer k1"}, {}) == "k1"
    assert presented_key("POST", {"x-api-key": "k2"}, cookie) == "k2"
    assert presented_key("GET", {}, cookie) == "from-cookie"
    assert presented_key("POST", {}, cookie) == ""  # a cross-site form cannot use the cookie
    assert presented_key("POST", {"Authorization": "Basic dXNlcjpwdw=="}, {}) == ""


def test_key_levels():
    assert KEYS.level("user-2") == USER
    assert KEYS.level("admin-1") == ADMIN
    assert KEYS.level("user-3") == ""
    assert KEYS.level("") == ""
    assert not KeyRing.from_settings("", " , ").enabled


def _refusal(needed: str, key: str) -> tuple[int, str | None]:
    with pytest.raises(ApiError) as refused:
        check_access(KEYS, needed, key)
    return refused.value.status, refused.value.code


def test_missing_wrong_and_too_weak_keys_are_refused_without_echoing_them():
    assert _refusal(USER, "") == (401, "missing_api_key")
    assert _refusal(USER, "guess") == (401, "invalid_api_key")
    assert _refusal(ADMIN, "user-1") == (403, "admin_key_required")
    with pytest.raises(ApiError) as refused:
        check_access(KEYS, USER, "secret-guess")
    assert "secret-guess" not in refused.value.message
    assert refused.value.headers["WWW-Authenticate"].startswith("Bearer")


def test_allowed_requests_pass():
    check_access(KEYS, USER, "user-1")
    check_access(KEYS, USER, "admin-1")  # an admin key calls the model APIs too
    check_access(KEYS, ADMIN, "admin-1")
    check_access(KEYS, OPEN, "")
    check_access(KeyRing(), ADMIN, "")  # no keys configured: open


def test_identity_names_a_key_without_revealing_it():
    assert identity("user-1") == identity("user-1") != identity("user-2")
    assert "user-1" not in identity("user-1") and len(identity("user-1")) == len("key-") + 12
