"""Admission at saturation on the real stack (issue 43): one instance of the tiny chat model whose
engine runs 2 requests at once; the gateway queues at most 4 more.

- 6 concurrent streams: 2 run, 4 wait (GET /admission says so), then all complete, in full;
- beyond the bound the gateway refuses at once with a 503, Retry-After, in the client's error shape;
- an admin sets a key's priority (POST /admission/priorities) and every replica reads it;
- the metrics-collector exports the wait time, the queue depth and the refusals.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator

import aiohttp
import pytest

from fleet_local import stack
from tests.support import MODEL, embedded_stack, make_chat_model

SLOTS = 2
QUEUE = 4
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def saturated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[stack.StackManifest]:
    root = tmp_path_factory.mktemp("admission")
    model_dir = make_chat_model(root / "model")
    env = {
        **os.environ,
        "FLEET_ENGINE_OPTIONS": json.dumps({"mlx": {"max_batch_size": SLOTS}}),
        "FLEET_ADMISSION_QUEUE": str(QUEUE),
        "FLEET_ADMISSION_TIMEOUT_S": "60",
    }
    with embedded_stack(root / "state", MODEL, model_dir, env=env) as manifest:
        yield manifest


def body(stream: bool) -> dict:
    return {
        "model": MODEL,
        "prompt": "Count slowly, please.",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


async def until_slots_known(session: aiohttp.ClientSession, gateway: str) -> None:
    """The worker's 1 Hz metrics have told the gateway the instance's capacity."""
    for _ in range(100):
        async with session.get(f"{gateway}/state") as response:
            state = await response.json()
        if any(i["status"] == "ready" for i in state["instances"].values()):
            await asyncio.sleep(1.5)
            return
        await asyncio.sleep(0.2)
    raise AssertionError("no ready instance")


async def test_requests_wait_for_a_slot_and_beyond_the_bound_are_refused(saturated) -> None:
    gateway = saturated.gateway_url
    async with aiohttp.ClientSession() as session:
        await until_slots_known(session, gateway)

        async def complete(stream: bool) -> tuple[int, dict | str, dict]:
            async with session.post(f"{gateway}/v1/completions", json=body(stream)) as response:
                text = await response.text()
                return response.status, text if stream else json.loads(text), dict(response.headers)

        admitted = [asyncio.create_task(complete(True)) for _ in range(SLOTS + QUEUE)]
        waiting: dict = {}
        for _ in range(200):  # the queue fills as the two slots run
            async with session.get(f"{gateway}/admission") as response:
                waiting = (await response.json())["waiting"]
            if waiting.get(MODEL) == QUEUE:
                break
            await asyncio.sleep(0.02)
        assert waiting == {MODEL: QUEUE}

        status, refusal, headers = await complete(False)  # one more: over the bound
        assert status == 503, refusal
        assert isinstance(refusal, dict) and refusal["error"]["code"] == "overloaded"
        assert int(headers["Retry-After"]) >= 1

        results = await asyncio.wait_for(asyncio.gather(*admitted), 120)
    for status, text, _ in results:
        assert status == 200
        assert isinstance(text, str) and text.rstrip().endswith("data: [DONE]")
        assert text.count('"text"') >= MAX_TOKENS / 8  # streamed in full (chunks hold a few tokens)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{gateway}/admission") as response:
            after = await response.json()
        for _ in range(30):  # the collector has the samples and the stats
            async with session.get(saturated.metrics_url) as response:
                metrics = await response.text()
            if 'fleet_admission_refused_total{reason="queue_full"} 1.0' in metrics:
                break
            await asyncio.sleep(0.2)
    assert after["waiting"] == {} and after["refused"] == {"queue_full": 1}
    assert 'fleet_admission_refused_total{reason="queue_full"} 1.0' in metrics
    waits = [line for line in metrics.splitlines() if line.startswith("fleet_admission_wait_seconds_count")]
    assert waits and float(waits[0].split()[-1]) >= SLOTS + QUEUE
    assert "fleet_admission_waiting_requests" in metrics or after["waiting"] == {}


async def test_an_admin_sets_a_keys_priority(saturated) -> None:
    gateway = saturated.gateway_url
    async with aiohttp.ClientSession() as session:
        body = {"key": "sk-urgent", "priority": 7}
        async with session.post(f"{gateway}/admission/priorities", json=body) as response:
            assert response.status == 200, await response.text()
            set_to = await response.json()
        assert set_to["identity"].startswith("key-") and set_to["priority"] == 7
        async with session.get(f"{gateway}/admission") as response:
            assert (await response.json())["priorities"][set_to["identity"]] == 7
        both = {"key": "k", "identity": "key-1", "priority": 1}
        async with session.post(f"{gateway}/admission/priorities", json=both) as response:
            assert response.status == 400
