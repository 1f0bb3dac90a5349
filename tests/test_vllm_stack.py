"""OpenAI chat completions through the whole embedded stack on the real vLLM CPU engine.

`fleet up --engine vllm` stages a tiny random llama (ChatML tokenizer, head size 32, like real
models) and serves it from a vLLM instance; greedy output through the stack must equal vLLM's
own `LLM.generate` on the same folder and the same prompt token ids.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import openai
import pytest

from fleet_bus import Bus
from fleet_local import stack
from fleet_store import ObjectStore, load_manifest
from fleet_store.kv import block_hashes, manifest_fingerprint
from fleet_store.kv_index import TIER2, KVIndex
from tests.support import (
    REPO,
    TokenTap,
    assert_all_validate,
    disconnect_mid_stream,
    embedded_stack,
    fifty_schema_samples,
    make_chat_model,
    mlx_greedy,
    prompt_ids,
    until_state,
)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

MODEL = "tiny/llama-vllm"
REFERENCE_SCRIPT = REPO / "services/engine-worker/tests/vllm_reference.py"
CONVERSATIONS = [[{"role": "user", "content": f"Tell me about the number {n}"}] for n in range(4)]


@pytest.fixture(scope="module")
def vllm_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[stack.StackManifest]:
    model_dir = make_chat_model(tmp_path_factory.mktemp("model-vllm"), hidden=128)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",  # fastest for a tiny model on 2 cores
        "FLEET_ENGINE_OPTIONS": json.dumps({"vllm": {"kv_cache_bytes": 128 << 20}}),
        # the cross-engine tests rely on the prior (MLX decodes when it is ready): background
        # calibration of MLX would let measured speeds pick vLLM, by when it happens to finish
        "FLEET_CALIBRATION": "off",
    }
    with embedded_stack(tmp_path_factory.mktemp("fleet-vllm"), MODEL, model_dir, "vllm", env) as manifest:
        yield manifest


@pytest.fixture(scope="module")
def model_dir(vllm_stack) -> Path:
    return Path(vllm_stack.state_dir) / "models" / MODEL / "main"


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[int, list[int]]:
    """vLLM's own greedy tokens for each conversation's prompt ids, 12 tokens."""
    prompts = [prompt_ids(model_dir, messages) for messages in CONVERSATIONS]
    request = json.dumps({"prompts": prompts, "max_tokens": 12})
    result = subprocess.run(
        [sys.executable, str(REFERENCE_SCRIPT), str(model_dir), request],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(enumerate(json.loads(result.stdout.strip().splitlines()[-1])))


@pytest.fixture
def client(vllm_stack) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{vllm_stack.gateway_url}/v1", api_key="unused", max_retries=0, timeout=120
    )


async def get_json(url: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return await response.json()


async def test_the_model_runs_on_a_vllm_instance(vllm_stack) -> None:
    state = await get_json(f"{vllm_stack.gateway_url}/state")
    (instance,) = [i for i in state["instances"].values() if i["model_id"] == MODEL]
    assert instance["engine"] == "vllm" and instance["status"] == "ready"
    capabilities = await get_json(f"{vllm_stack.gateway_url}/capabilities")
    assert capabilities["vllm_available"] is True
    assert capabilities["engines"]["vllm"]["versions"] == ["0.32.0"]


async def test_weight_loading_progress_reached_the_event_stream(vllm_stack) -> None:
    bus = await Bus.connect(vllm_stack.nats_url, "progress-reader")
    try:
        sub = await bus.js.subscribe(
            "fleet.evt.instance_loading", ordered_consumer=True, deliver_policy="all"
        )
        progress = []
        while True:
            try:
                msg = await sub.next_msg(timeout=1)
            except TimeoutError:
                break
            progress.append(json.loads(msg.data)["progress"])
    finally:
        await bus.close()
    assert progress[0] == 0.0 and progress[-1] == 1.0  # layers loaded / total, from the vLLM loader
    assert progress == sorted(progress)


async def greedy_chat(client: openai.OpenAI, messages, max_tokens: int):
    response = await asyncio.to_thread(
        client.chat.completions.create, model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )
    await asyncio.sleep(0.2)  # the TokenTap sees the last chunk
    return response


async def test_greedy_through_the_stack_equals_vllm_generate(vllm_stack, client, reference) -> None:
    async with TokenTap(vllm_stack.nats_url) as tap:
        response = await greedy_chat(client, CONVERSATIONS[0], 12)
    assert tap.token_ids(response.id) == reference[0]
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 12


async def test_four_concurrent_streams_each_equal_vllm_generate(vllm_stack, client, reference) -> None:
    def stream(messages) -> tuple[str, str]:
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True
            )
        )
        return chunks[0].id, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    async with TokenTap(vllm_stack.nats_url) as tap:
        with ThreadPoolExecutor(4) as pool:
            results = await asyncio.to_thread(lambda: list(pool.map(stream, CONVERSATIONS)))
        await asyncio.sleep(0.2)
    for i, (request_id, text) in enumerate(results):
        assert tap.token_ids(request_id) == reference[i]
        assert text  # the gateway detokenized it


async def test_a_repeated_prompt_reuses_vllm_prefix_cache(vllm_stack, client, model_dir) -> None:
    prompt = prompt_ids(model_dir, CONVERSATIONS[2])
    async with TokenTap(vllm_stack.nats_url) as tap:
        for _ in range(2):
            response = await greedy_chat(client, CONVERSATIONS[2], 2)
    final = max(tap.chunks[response.id], key=lambda c: c.index)
    # vLLM caches whole 32-token pages, and always computes the last prompt token itself
    assert final.prefix_cached_tokens == (len(prompt) - 1) // 32 * 32 > 0


async def test_client_disconnect_cancels_the_vllm_request(vllm_stack) -> None:
    body = {"model": MODEL, "messages": CONVERSATIONS[1], "max_tokens": 400, "temperature": 0, "stream": True}
    last, tokens = await disconnect_mid_stream(vllm_stack, body)
    assert last.finish_reason == "cancelled"
    assert tokens < 400


async def test_kv_computed_by_vllm_is_reused_by_an_mlx_instance(vllm_stack, client, model_dir) -> None:
    """Cross-engine reuse through object storage: vLLM's connector writes the prompt's block, the
    worker uploads it; an MLX instance of the same model then fetches it and skips those tokens,
    decoding exactly as MLX does cold."""
    messages = [{"role": "user", "content": " ".join(f"item {n} is blue" for n in range(28))}]
    prompt = prompt_ids(model_dir, messages)
    assert 256 < len(prompt) < 500
    async with TokenTap(vllm_stack.nats_url) as tap:
        response = await greedy_chat(client, messages, 8)  # only the vLLM instance is ready
    # computed here (vLLM's own prefix cache may hold a page of the chat template from earlier tests)
    assert max(tap.chunks[response.id], key=lambda c: c.index).prefix_cached_tokens < 256

    fingerprint = manifest_fingerprint(load_manifest_of(vllm_stack, MODEL))
    first_block = block_hashes(fingerprint, prompt, 256)[0]
    index = KVIndex.from_url(next(p.url for p in vllm_stack.processes if p.name == "redis"))
    try:
        for _ in range(100):
            if TIER2 in (await index.holders(fingerprint, [first_block]))[0]:
                break
            await asyncio.sleep(0.1)
        assert TIER2 in (await index.holders(fingerprint, [first_block]))[0]
    finally:
        await index.close()

    async with aiohttp.ClientSession() as session:
        body = {"model": MODEL, "engine": "mlx"}
        async with session.post(f"{vllm_stack.gateway_url}/instances", json=body) as response:
            mlx_instance = (await response.json())["instance_id"]
        # the instance appears in State once the scheduler has placed it
        await until_state(
            session,
            vllm_stack.gateway_url,
            lambda s: s["instances"].get(mlx_instance, {}).get("status") == "ready",
            60,
        )
    async with TokenTap(vllm_stack.nats_url) as tap:
        response = await greedy_chat(client, messages, 8)  # MLX is preferred for decode
    final = max(tap.chunks[response.id], key=lambda c: c.index)
    assert final.prefix_cached_tokens == 256
    assert tap.token_ids(response.id) == mlx_greedy(model_dir, prompt, 8)


async def ensure_mlx_instance(gateway: str) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{gateway}/state") as response:
            instances = (await response.json())["instances"].values()
        if not any(i["engine"] == "mlx" for i in instances):
            async with session.post(
                f"{gateway}/instances", json={"model": MODEL, "engine": "mlx"}
            ) as response:
                assert response.status == 202, await response.text()

        def mlx_ready(state: dict) -> bool:
            return any(i["engine"] == "mlx" and i["status"] == "ready" for i in state["instances"].values())

        await until_state(session, gateway, mlx_ready, 60)


@pytest.mark.parametrize("transport", ["stream", "staged"])
async def test_vllm_prefills_and_mlx_decodes_a_disaggregated_request(
    vllm_stack, model_dir, transport
) -> None:
    """The seed's headline path: the vLLM instance prefills, its KV goes over (layer by layer from
    the connector) and the MLX instance decodes exactly as MLX does colocated."""
    await ensure_mlx_instance(vllm_stack.gateway_url)
    messages = [{"role": "user", "content": f"Count the {transport} sheep, one by one"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    body |= {"disaggregated": True, "transport": transport}
    async with TokenTap(vllm_stack.nats_url) as tap, aiohttp.ClientSession() as session:
        async with session.post(f"{vllm_stack.gateway_url}/bench/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()
            reply = await response.json()
        await asyncio.sleep(0.2)
    stats = reply["generation_stats"]
    assert stats["disaggregated"], stats["handoff"]
    assert stats["handoff"]["transport"] == transport and stats["handoff"]["bytes"] > 0
    prompt = prompt_ids(model_dir, messages)
    assert tap.token_ids(reply["id"]) == mlx_greedy(model_dir, prompt, 8)


def load_manifest_of(manifest: stack.StackManifest, model: str):
    store = ObjectStore.from_settings(stack.connection_settings(manifest))
    try:
        return load_manifest(store, "fleet-models", model, "main")
    finally:
        store.close()


def test_fifty_samples_under_a_json_schema_all_validate(client, vllm_stack) -> None:
    """The tiny random model writes nonsense, always in the schema's shape (the grammar's mask)."""
    assert_all_validate(fifty_schema_samples(vllm_stack.gateway_url, MODEL))
