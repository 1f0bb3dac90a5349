"""The shared KV cache through the real stack with two MLX workers (a tiny random llama, 4k context).

A ~2,000-token shared system prompt is prefilled once on w1; its blocks go to object storage and
the Redis index. The same prefix on w2 is fetched from object storage (one blob corrupted on the
way: recomputed from there) and decodes exactly like a cold run; then the router sends a third
request to the worker that holds the prefix in memory.
"""

from __future__ import annotations

import asyncio
import io
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import msgspec
import pytest
from minio import Minio

from fleet_bus import Bus
from fleet_local import stack
from fleet_local.processes import spawn, stop_pid
from fleet_proto import RouteDecided
from fleet_store import SHA256_METADATA, ObjectStore, load_manifest
from fleet_store.kv import block_hashes, manifest_fingerprint
from fleet_store.kv_index import TIER2, KVIndex, leading_run, object_key
from tests.support import (
    TokenTap,
    call,
    embedded_stack,
    make_chat_model,
    mlx_greedy,
    prompt_ids,
    until_state,
    worker_env,
)

MODEL = "tiny/llama-long"
BLOCK = 64
SYSTEM = " ".join(f"rule {n}: be kind to the number {n * 7 % 101}." for n in range(110))


def conversation(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[stack.StackManifest, Path]]:
    """The stack's own worker is w1; w2 joins it. Both run MLX with KV blocks of 64 tokens."""
    root = tmp_path_factory.mktemp("kv-cluster")
    model_dir = make_chat_model(root / "model", max_positions=4096)
    env = {
        **os.environ,
        "FLEET_NODE_ID": "w1",
        "FLEET_NODE_ENGINES": "mlx",
        "FLEET_KV_BLOCK_SIZE": str(BLOCK),
    }
    with embedded_stack(root / "state", env=env) as manifest:
        worker = spawn(
            [sys.executable, "-m", "fleet_worker"],
            root / "w2.log",
            worker_env(manifest, "w2", root / "w2", node_engines="mlx", kv_block_size=str(BLOCK)),
        )
        try:
            asyncio.run(stage(manifest.gateway_url, f"file://{model_dir}"))
            yield manifest, model_dir
        finally:
            stop_pid(worker.pid)


async def stage(gateway: str, source: str) -> None:
    async with aiohttp.ClientSession() as session:
        await call(session, "POST", f"{gateway}/models", {"model": MODEL, "source": source})
        await until_state(session, gateway, lambda s: MODEL in s["models"] and len(s["nodes"]) == 2, 60)


async def serve_on(gateway: str, node: str) -> str:
    """An instance of the model on `node` only, ready."""
    shards = [{"node_id": node, "start_layer": 0, "end_layer": 2}]
    async with aiohttp.ClientSession() as session:
        instance_id = (
            await call(session, "POST", f"{gateway}/instances", {"model": MODEL, "shards": shards})
        )["instance_id"]
        await until_state(
            session, gateway, lambda s: s["instances"].get(instance_id, {}).get("status") == "ready", 120
        )
    return instance_id


async def delete(gateway: str, instance_id: str) -> None:
    async with aiohttp.ClientSession() as session:
        await call(session, "DELETE", f"{gateway}/instances/{instance_id}")
        await until_state(session, gateway, lambda s: instance_id not in s["instances"], 60)


class Requests:
    """Chat completions with the route decision and the token chunks of each, seen on NATS."""

    def __init__(self, manifest: stack.StackManifest) -> None:
        self.manifest = manifest
        self.decisions: dict[str, RouteDecided] = {}

    async def chat(self, messages: list[dict], max_tokens: int = 10) -> tuple[list[int], int, RouteDecided]:
        bus = await Bus.connect(self.manifest.nats_url, "kv-test")

        async def on_decided(msg) -> None:
            decided = msgspec.json.decode(msg.data, type=RouteDecided)
            self.decisions[decided.request_id] = decided

        sub = await bus.nc.subscribe("fleet.route.decided", cb=on_decided)
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        try:
            async with TokenTap(self.manifest.nats_url) as tap, aiohttp.ClientSession() as session:
                reply = await call(session, "POST", f"{self.manifest.gateway_url}/v1/chat/completions", body)
                await asyncio.sleep(0.3)
        finally:
            await sub.unsubscribe()
            await bus.close()
        request_id = reply["id"]
        final = max(tap.chunks[request_id], key=lambda c: c.index)
        return tap.token_ids(request_id), final.prefix_cached_tokens, self.decisions[request_id]


def redis_url(manifest: stack.StackManifest) -> str:
    return next(p.url for p in manifest.processes if p.name == "redis")


def s3_client(manifest: stack.StackManifest) -> Minio:
    settings = stack.connection_settings(manifest)
    return Minio(
        settings.s3_endpoint,
        access_key=settings.s3_access_key,
        secret_key=settings.s3_secret_key,
        secure=False,
        region="us-east-1",
    )


async def test_prefill_once_fetch_from_object_storage_route_to_memory(two_workers) -> None:
    manifest, model_dir = two_workers
    gateway = manifest.gateway_url
    first_question, second_question = conversation("What is rule 3?"), conversation("What is rule 9?")
    prompt = prompt_ids(model_dir, first_question)
    assert len(prompt) > 2000
    requests = Requests(manifest)

    # 1. w1 alone: a cold prefill, whose blocks reach object storage and the index
    on_w1 = await serve_on(gateway, "w1")
    tokens, cached, decided = await requests.chat(first_question)
    assert decided.reply.worker_id == "w1" and cached == 0
    assert tokens == mlx_greedy(model_dir, prompt, 10)

    store = ObjectStore.from_settings(stack.connection_settings(manifest))
    fingerprint = manifest_fingerprint(load_manifest(store, "fleet-models", MODEL, "main"))
    store.close()
    shared = block_hashes(fingerprint, prompt, BLOCK)[: (len(prompt) - 1) // BLOCK]
    second = block_hashes(fingerprint, prompt_ids(model_dir, second_question), BLOCK)
    system_blocks = next(
        (i for i, (a, b) in enumerate(zip(shared, second, strict=False)) if a != b), len(shared)
    )
    assert system_blocks >= 25  # the shared system prompt: ~2,000 tokens
    index = KVIndex.from_url(redis_url(manifest))
    try:
        for _ in range(100):
            holders = await index.holders(fingerprint, shared)
            if leading_run(holders, TIER2) == len(shared):
                break
            await asyncio.sleep(0.1)
        assert leading_run(holders, TIER2) == len(shared)  # uploaded, every block
        assert leading_run(holders, "w1") == len(shared)  # and held in w1's memory

        # 2. only w2 serves: it fetches the prefix from object storage; one blob is corrupted there,
        #    so the prefix stops at that block and w2 recomputes the rest
        bad = 20
        client = s3_client(manifest)
        stat = client.stat_object("fleet-kv", object_key(fingerprint, shared[bad]))
        garbage = b"\0" * stat.size
        # the object keeps its sha256 metadata: the worker's verified download refuses it
        (original,) = [v for k, v in stat.metadata.items() if k.lower().endswith(SHA256_METADATA.lower())]
        sha = {SHA256_METADATA: original}
        client.put_object(
            "fleet-kv", object_key(fingerprint, shared[bad]), io.BytesIO(garbage), stat.size, metadata=sha
        )
        await serve_on(gateway, "w2")
        await delete(gateway, on_w1)
        second_prompt = prompt_ids(model_dir, second_question)
        tokens, cached, decided = await requests.chat(second_question)
        assert decided.reply.worker_id == "w2"
        assert cached == bad * BLOCK  # blocks 0..19 fetched and verified, block 20 refused
        assert tokens == mlx_greedy(model_dir, second_prompt, 10)

        # 3. w1 serves again (its memory is empty now): the router picks w2, which holds the prefix
        await serve_on(gateway, "w1")
        holders = await index.holders(fingerprint, shared)
        assert leading_run(holders, "w1") == 0 and leading_run(holders, "w2") >= bad
        third_question = conversation("What is rule 40?")
        tokens, cached, decided = await requests.chat(third_question)
        third_prompt = prompt_ids(model_dir, third_question)
        assert decided.reply.worker_id == "w2", decided.reply.reason
        assert cached >= system_blocks * BLOCK
        assert f"{cached} of {len(third_prompt)} prompt tokens cached in memory" in decided.reply.reason
        assert tokens == mlx_greedy(model_dir, third_prompt, 10)

        # 4. what a user sees: GET /kv and the collector's Prometheus metrics
        await asyncio.sleep(1.5)  # one metrics period
        async with aiohttp.ClientSession() as session:
            view = await call(session, "GET", f"{gateway}/kv")
            async with session.get(manifest.metrics_url) as response:
                metrics = await response.text()
        assert view["block_size"] == BLOCK and view["index"]["available"]
        assert view["index"]["object_storage_blocks"] >= len(shared)
        assert view["index"]["memory_blocks_by_node"]["w2"] >= system_blocks
        assert view["nodes"]["w2"]["fetched_blocks"] == bad and view["nodes"]["w2"]["fetched_bytes"] > 0
        assert view["nodes"]["w1"]["uploaded_blocks"] >= len(shared)
        assert f'fleet_kv_fetched_blocks_total{{node="w2"}} {float(bad)}' in metrics
    finally:
        await index.close()
