"""OpenAI chat completions through the whole embedded stack on a real MLX engine.

A tiny random llama (with a ChatML tokenizer) is staged from a local folder through the downloader
into S3, placed by the scheduler, loaded by the engine-worker; the official `openai` client talks to
the gateway. Greedy output is compared token for token with mlx-lm run directly on the same folder.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest

from fleet_bus import Bus
from fleet_local import stack
from tests.support import (
    MESSAGES,
    MODEL,
    TokenTap,
    assert_all_validate,
    disconnect_mid_stream,
    embedded_stack,
    fifty_schema_samples,
    frames_until_done,
    make_chat_model,
    mlx_greedy,
    prompt_ids,
    stream_errors,
    tiny_tokenizer,
)


@pytest.fixture(scope="module")
def chat_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[stack.StackManifest]:
    model_dir = make_chat_model(tmp_path_factory.mktemp("model"))
    with embedded_stack(tmp_path_factory.mktemp("fleet-chat"), MODEL, model_dir) as manifest:
        yield manifest


@pytest.fixture(scope="module")
def model_dir(chat_stack) -> Path:
    return Path(chat_stack.state_dir) / "models" / MODEL / "main"


@pytest.fixture
def client(chat_stack) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{chat_stack.gateway_url}/v1", api_key="unused", max_retries=0, timeout=120
    )


def test_models_lists_the_ready_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


async def test_greedy_non_streamed_is_token_identical_to_mlx_lm(chat_stack, client, model_dir):
    prompt = prompt_ids(model_dir, MESSAGES)
    async with TokenTap(chat_stack.nats_url) as tap:
        response = await asyncio.to_thread(
            client.chat.completions.create, model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0
        )
        await asyncio.sleep(0.2)
    expected = mlx_greedy(model_dir, prompt, 12)
    assert tap.token_ids(response.id) == expected
    assert response.object == "chat.completion"
    assert response.choices[0].finish_reason == "length"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == tiny_tokenizer.build_tiny_tokenizer().decode(expected)
    assert response.usage.prompt_tokens == len(prompt)
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == len(prompt) + 12


@pytest.mark.parametrize("stream", [False, True])
async def test_every_finished_request_publishes_its_stats(chat_stack, client, stream: bool):
    def complete() -> tuple[str, int]:
        if not stream:
            response = client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0
            )
            return response.id, response.usage.prompt_tokens
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, stream=True,
                stream_options={"include_usage": True},
            )
        )  # fmt: skip
        return chunks[0].id, chunks[-1].usage.prompt_tokens

    bus = await Bus.connect(chat_stack.nats_url, "stats-reader")
    try:
        sub = await bus.nc.subscribe("fleet.stats.request")
        await bus.nc.flush()
        request_id, prompt_tokens = await asyncio.to_thread(complete)
        stats = json.loads((await sub.next_msg(timeout=10)).data)
    finally:
        await bus.close()
    assert stats["request_id"] == request_id
    assert (stats["prompt_tokens"], stats["completion_tokens"]) == (prompt_tokens, 6)
    assert 0 < stats["ttft_s"] <= stats["total_s"]
    assert stats["tpot_s"] > 0
    assert stats["finish_reason"] == "length"
    assert stats["node_id"] and stats["instance_id"]


async def test_prometheus_metrics_show_the_requests(chat_stack, client):
    from prometheus_client.parser import text_string_to_metric_families

    await asyncio.to_thread(client.chat.completions.create, model=MODEL, messages=MESSAGES, max_tokens=3)
    async with aiohttp.ClientSession() as session:
        for _ in range(50):  # the collector sees the stats a moment after the reply
            async with session.get(chat_stack.metrics_url) as response:
                text = await response.text()
            families = {f.name: f for f in text_string_to_metric_families(text)}
            ttft = [s for s in families["fleet_request_ttft_seconds"].samples if s.name.endswith("_count")]
            if ttft and ttft[0].value >= 1:
                break
            await asyncio.sleep(0.1)
    assert ttft[0].labels["model"] == MODEL and ttft[0].value >= 1
    generated = [s for s in families["fleet_tokens_generated"].samples if s.name.endswith("_total")]
    assert generated[0].value >= 3
    assert [s for s in families["fleet_node_memory_used_bytes"].samples if s.value > 0]


def test_streamed_matches_non_streamed_and_reports_usage(client):
    args = {"model": MODEL, "messages": MESSAGES, "max_tokens": 10, "temperature": 0}
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )


def test_eight_concurrent_streams_all_complete_correctly(client):
    prompts = [[{"role": "user", "content": f"Count to {n} please"}] for n in range(8)]

    def one(messages, stream: bool) -> str:
        if not stream:
            return (
                client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
                .choices[0]
                .message.content
            )
        parts = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)

    alone = [one(m, stream=False) for m in prompts]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda m: one(m, stream=True), prompts))
    assert together == alone


async def worker_active(nats_url: str) -> dict[str, int]:
    bus = await Bus.connect(nats_url, "metrics-reader")
    try:
        sub = await bus.nc.subscribe("fleet.metrics.*")
        msg = await sub.next_msg(timeout=5)
        return json.loads(msg.data)["active_requests"]
    finally:
        await bus.close()


async def test_client_disconnect_cancels_the_request_and_frees_the_slot(chat_stack):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 440, "temperature": 0, "stream": True}
    last, tokens = await disconnect_mid_stream(chat_stack, body)
    assert last.finish_reason == "cancelled"
    assert tokens < 440
    for _ in range(30):
        if sum((await worker_active(chat_stack.nats_url)).values()) == 0:
            break
        await asyncio.sleep(0.2)
    assert sum((await worker_active(chat_stack.nats_url)).values()) == 0


def test_stop_string_cuts_the_text(client):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    text = full.choices[0].message.content
    stop = text[3:6]
    assert stop and stop in text
    cut = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_fifty_samples_under_a_json_schema_all_validate(client, chat_stack) -> None:
    """The tiny random model writes nonsense, always in the schema's shape (the grammar's mask)."""
    assert_all_validate(fifty_schema_samples(chat_stack.gateway_url, MODEL))


def test_unknown_model_is_404_listing_the_available_ones(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no/such-model", messages=MESSAGES)
    error = info.value.body
    assert error["code"] == "model_not_found"
    assert MODEL in error["message"]


HELLO = b'"model": "tiny/llama-chat", "messages": [{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b'{"model": "tiny/llama-chat"}', "messages"),
        (b"{" + HELLO + b', "temperature": -1}', "temperature"),
        (b"{" + HELLO + b', "max_tokens": 0}', "max_tokens"),
    ],
)
async def test_malformed_requests_are_400_naming_the_field(chat_stack, body, param):
    async with aiohttp.ClientSession() as session:
        async with session.post(
            f"{chat_stack.gateway_url}/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        ) as response:
            assert response.status == 400
            error = (await response.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


async def until_deleted(session: aiohttp.ClientSession, gateway: str, instance_id: str) -> None:
    for _ in range(100):
        async with session.get(f"{gateway}/state") as response:
            if instance_id not in (await response.json())["instances"]:
                return
        await asyncio.sleep(0.1)
    raise AssertionError(f"instance {instance_id} was never deleted")


async def recreate_instance(session: aiohttp.ClientSession, gateway: str) -> None:
    """A new instance of the model, ready, for the tests that follow."""
    async with session.post(f"{gateway}/instances", json={"model": MODEL}) as response:
        assert response.status == 202
    for _ in range(600):
        async with session.get(f"{gateway}/v1/models") as response:
            if (await response.json())["data"]:
                return
        await asyncio.sleep(0.1)
    raise AssertionError("the new instance never became ready")


async def test_deleting_an_instance_drains_its_requests_first(chat_stack):
    gateway = chat_stack.gateway_url
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 300, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{gateway}/state") as response:
            instance_id = next(iter((await response.json())["instances"]))
        async with session.post(f"{gateway}/v1/chat/completions", json=body) as stream:
            await stream.content.readuntil(b"\n\n")  # running
            async with session.delete(f"{gateway}/instances/{instance_id}") as response:
                assert response.status == 202
            frames = (await stream.read()).decode()
        assert '"finish_reason":"length"' in frames  # it ran to the end, not cut off
        await until_deleted(session, gateway, instance_id)
        await recreate_instance(session, gateway)


async def test_model_without_ready_instance_is_503(chat_stack):
    async with aiohttp.ClientSession() as session:
        gateway = chat_stack.gateway_url
        async with session.get(f"{gateway}/state") as response:
            instance_id = next(iter((await response.json())["instances"]))
        async with session.delete(f"{gateway}/instances/{instance_id}") as response:
            assert response.status == 202
        await until_deleted(session, gateway, instance_id)
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
        async with session.post(f"{gateway}/v1/chat/completions", json=body) as response:
            assert response.status == 503
            assert "no ready instance" in (await response.json())["error"]["message"]
        await recreate_instance(session, gateway)


async def test_worker_dying_mid_stream_ends_the_stream_with_an_error(chat_stack):
    worker = next(p for p in chat_stack.processes if p.name == "engine-worker")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{chat_stack.gateway_url}/v1/chat/completions", json=body) as response:
            assert response.status == 200
            await response.content.readuntil(b"\n\n")
            os.killpg(worker.pid, signal.SIGKILL)  # the worker and its engine process, no goodbye
            killed_at = time.monotonic()
            frames = await frames_until_done(response, 15)
    assert time.monotonic() - killed_at < 10
    errors = stream_errors(frames)
    assert errors and "stopped responding" in errors[0]["message"]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param"),
    [
        ("POST", "/instances", {"model": "not/staged"}, 404, "model"),
        ("POST", "/instances", {"modle": "typo"}, 400, "modle"),
        ("DELETE", "/instances/inst-nope", None, 404, "instance_id"),
        ("POST", "/models", {"model": "m"}, 400, "source"),
    ],
)
async def test_admin_errors_are_openai_shaped(chat_stack, method, path, body, status, param):
    async with aiohttp.ClientSession() as session:
        async with session.request(method, f"{chat_stack.gateway_url}{path}", json=body) as response:
            assert response.status == status
            error = (await response.json())["error"]
    assert error["param"] == param
    assert error["message"]
