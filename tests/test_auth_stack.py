"""Auth and limits on the real embedded stack, started as users start it (auth on by default).

Every server refuses clients without the generated credentials; the gateway refuses requests
without a key in each client family's error shape, takes the keys each SDK sends, keeps admin
endpoints for the admin key, enforces the operator's limits with clear 4xx errors, and no secret
ever reaches a log.
"""

from __future__ import annotations

import asyncio
import os
import stat
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import anthropic
import nats
import openai
import pytest
import redis

from fleet_local import secrets, stack
from tests.support import MESSAGES, MODEL, embedded_stack, make_chat_model

# Extra API keys (FLEET_API_KEYS adds them to the generated one), one per test, so the per-key
# rate limit of one test never throttles another.
KEYS = {name: f"fleet-test-{name}" for name in ("clients", "input", "limits", "streams", "rate", "cookie")}
LIMITS = {
    "FLEET_MAX_PROMPT_TOKENS": "300",
    "FLEET_MAX_COMPLETION_TOKENS": "450",
    "FLEET_MAX_BODY_BYTES": str(64 * 1024),
    "FLEET_MAX_STREAMS_PER_KEY": "2",
    "FLEET_RATE_LIMIT_PER_S": "0.5",
    "FLEET_RATE_LIMIT_BURST": "10",
}


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[stack.StackManifest]:
    model_dir = make_chat_model(tmp_path_factory.mktemp("model"))
    env = {**os.environ, "FLEET_API_KEYS": ",".join(KEYS.values()), **LIMITS}
    with embedded_stack(
        tmp_path_factory.mktemp("fleet-auth"), MODEL, model_dir, env=env, auth=True
    ) as manifest:
        yield manifest


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(max_tokens: int = 4, **extra) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, **extra}


async def post(url: str, body=None, headers=None, data: bytes | None = None) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as session:
        kwargs = {"data": data, "headers": {"Content-Type": "application/json", **(headers or {})}}
        async with session.post(url, json=body if data is None else None, **kwargs) as response:
            return response.status, await response.json(content_type=None), dict(response.headers)


def test_the_credentials_are_files_only_their_owner_reads(secured):
    state = Path(secured.state_dir)
    for name in (secrets.SECRETS_FILE, stack.MANIFEST):
        assert stat.S_IMODE((state / name).stat().st_mode) == 0o600, name
    assert secured.api_key and secured.admin_key and secured.api_key != secured.admin_key


async def test_servers_refuse_clients_without_the_credentials(secured):
    servers = {p.name: p.url for p in secured.processes}
    with pytest.raises(nats.errors.Error):  # authorization violation; nothing reaches the bus
        await nats.connect(
            servers["nats"], allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0
        )
    connected = await nats.connect(secured.nats_url, allow_reconnect=False, connect_timeout=2)
    await connected.close()
    with pytest.raises(urllib.error.HTTPError) as s3:
        await asyncio.to_thread(urllib.request.urlopen, f"http://{servers['s3']}/fleet-models/", timeout=10)
    assert s3.value.code == 403
    port = int(servers["redis"].rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=port).ping()
    assert redis.Redis.from_url(servers["redis"]).ping()


@pytest.mark.parametrize(
    ("path", "headers", "shape"),
    [
        ("/v1/chat/completions", {}, "openai"),
        ("/v1/chat/completions", bearer("fleet-wrong"), "openai"),
        ("/v1/messages", {"x-api-key": "fleet-wrong"}, "anthropic"),
        ("/api/chat", {}, "ollama"),
    ],
)
async def test_requests_without_a_valid_key_are_401_in_their_clients_shape(secured, path, headers, shape):
    status, body, response_headers = await post(secured.gateway_url + path, chat(), headers)
    assert status == 401
    assert response_headers["WWW-Authenticate"].startswith("Bearer")
    message = {"openai": lambda b: b["error"]["message"], "anthropic": lambda b: b["error"]["message"]}.get(
        shape, lambda b: b["error"]
    )(body)
    assert "API key" in message and "fleet-wrong" not in message
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"


def test_each_sdk_authenticates_with_the_header_it_sends(secured):
    key = KEYS["clients"]
    openai_client = openai.OpenAI(base_url=f"{secured.gateway_url}/v1", api_key=key, max_retries=0)
    reply = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert reply.usage.completion_tokens == 3
    anthropic_client = anthropic.Anthropic(base_url=secured.gateway_url, api_key=key, max_retries=0)
    message = anthropic_client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert message.usage.output_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{secured.gateway_url}/v1", api_key="nope", max_retries=0).models.list()


async def test_admin_endpoints_need_the_admin_key(secured):
    url = f"{secured.gateway_url}/instances"
    status, body, _ = await post(url, {"model": "no/such-model"}, bearer(KEYS["clients"]))
    assert (status, body["error"]["code"]) == (403, "admin_key_required")
    status, body, _ = await post(url, {"model": "no/such-model"}, bearer(secured.admin_key))
    assert status in (400, 404) and "not staged" in body["error"]["message"]  # past auth: validated
    async with aiohttp.ClientSession(headers=bearer(secured.admin_key)) as session:
        async with session.delete(f"{url}/no-such-instance") as response:
            assert response.status == 404
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{secured.gateway_url}/health") as response:
            assert response.status == 200  # probes need no key


async def test_the_dashboard_cookie_opens_reads_only(secured):
    cookie = {"Cookie": f"fleet_api_key={secured.admin_key}"}
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{secured.gateway_url}/state", headers=cookie) as response:
            assert response.status == 200 and MODEL in str(await response.json())
        async with session.get(f"{secured.gateway_url}/state") as response:
            assert response.status == 401
    status, _, _ = await post(f"{secured.gateway_url}/instances", {"model": MODEL}, cookie)
    assert status == 401  # a cross-site form cannot ride on the cookie


HI = b'"model": "tiny/llama-chat", "messages": [{"role": "user", "content": "hi"}]'
INVALID_UTF8 = b'{"model": "tiny/llama-chat", "messages": [{"role": "user", "content": "\xff\xfe"}]}'


@pytest.mark.parametrize(
    ("data", "status", "param"),
    [
        (b"{not json", 400, None),
        (INVALID_UTF8, 400, None),
        (b'{"model": "tiny/llama-chat", "messages": [], "temperature": NaN}', 400, None),
        (b"{" + HI + b', "top_p": 1e999}', 400, "top_p"),
        (b"{" + HI + b', "top_p": -0.5}', 400, "top_p"),
        (b"{" + HI + b', "max_tokens": -3}', 400, "max_tokens"),
        (b'{"model": 7, "messages": []}', 400, "model"),
        (b"[]", 400, None),
    ],
)  # fmt: skip
async def test_hostile_bodies_are_4xx_json_naming_the_field(secured, data, status, param):
    got, body, _ = await post(
        f"{secured.gateway_url}/v1/chat/completions", data=data, headers=bearer(KEYS["input"])
    )
    assert (got, body["error"]["type"]) == (status, "invalid_request_error"), body
    assert body["error"]["param"] == param


async def test_unknown_fields_are_ignored_by_the_model_apis_and_refused_by_admin(secured):
    # SDKs send fields newer than a server knows (vLLM ignores them too); admin bodies are Fleet's own.
    status, body, _ = await post(
        f"{secured.gateway_url}/v1/chat/completions", chat(2, future_field=1), bearer(KEYS["input"])
    )
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    status, body, _ = await post(
        f"{secured.gateway_url}/instances", {"model": MODEL, "colour": "red"}, bearer(secured.admin_key)
    )
    assert status == 400 and body["error"]["param"] == "colour"


async def test_operator_limits_are_clear_4xx(secured):
    url, key = f"{secured.gateway_url}/v1/chat/completions", bearer(KEYS["limits"])
    long = [{"role": "user", "content": "word " * 400}]
    status, body, _ = await post(url, {"model": MODEL, "messages": long, "max_tokens": 1}, key)
    assert (status, body["error"]["code"]) == (400, "prompt_too_long")
    assert (
        "at most 300 prompt tokens" in body["error"]["message"]
        and "context is 512" in body["error"]["message"]
    )
    status, body, _ = await post(url, chat(451), key)
    assert (status, body["error"]["code"], body["error"]["param"]) == (
        400,
        "max_tokens_too_large",
        "max_tokens",
    )
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 70_000}]}
    status, body, _ = await post(url, huge, key)
    assert status == 413 and body["error"]["type"] == "invalid_request_error"


async def test_a_key_gets_at_most_its_concurrent_streams(secured):
    url, key = f"{secured.gateway_url}/v1/chat/completions", bearer(KEYS["streams"])
    async with aiohttp.ClientSession(headers=key) as session:
        streams = [await session.post(url, json=chat(400, stream=True)) for _ in range(2)]
        try:
            for response in streams:
                assert response.status == 200
                await response.content.readuntil(b"\n\n")  # running
            async with session.post(url, json=chat(1)) as third:
                assert third.status == 429 and third.headers["Retry-After"] == "1"
                assert (await third.json())["error"]["code"] == "concurrency_limit"
        finally:
            for response in streams:
                response.close()
        for _ in range(50):  # the closed streams give their slots back
            async with session.post(url, json=chat(1)) as again:
                if again.status == 200:
                    break
            await asyncio.sleep(0.1)
        assert again.status == 200


async def test_a_key_over_its_rate_gets_429_with_retry_after(secured):
    url, key = f"{secured.gateway_url}/v1/chat/completions", bearer(KEYS["rate"])
    statuses = []
    async with aiohttp.ClientSession(headers=key) as session:
        for _ in range(12):  # burst 10 at 0.5/s: the 11th or 12th is refused
            async with session.post(url, json=chat(1)) as response:
                statuses.append(response.status)
                if response.status == 429:
                    retry_after = int(response.headers["Retry-After"])
                    body = await response.json()
    assert statuses.count(200) >= 10 and 429 in statuses, statuses
    assert body["error"]["code"] == "rate_limit_exceeded" and 1 <= retry_after <= 2


def test_no_secret_reaches_any_log(secured):
    """Runs last: every request above carried keys; the servers and services logged around them."""
    creds = secrets.read(Path(secured.state_dir))
    assert creds is not None
    values = [*msgspec_values(creds), *KEYS.values()]
    logs = list(Path(secured.state_dir, "logs").rglob("*"))
    assert any(p.name == "gateway.log" for p in logs)
    for path in (p for p in logs if p.is_file()):
        text = path.read_bytes()
        leaked = [v for v in values if len(v) >= 8 and v.encode() in text]
        assert not leaked, f"{path} holds a secret"


def msgspec_values(creds: secrets.StackSecrets) -> list[str]:
    """The secret fields: a user name and an S3 access key id are names (S3 servers log key ids)."""
    names = ("nats_user", "s3_access_key")
    return [getattr(creds, field) for field in creds.__struct_fields__ if field not in names]
