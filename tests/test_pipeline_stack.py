"""Pipeline parallel through the real stack: SmolLM2-135M-Instruct (30 layers) split 15/15 across two
engine-workers (separate processes, their engine children joined by MLX's ring over loopback).

The pipeline's greedy tokens equal the single-worker instance's, for one request and for two at
once (batched through both ranks); asked again, a question reuses its prefix (each rank keeps its
layers' blocks in memory); a streamed request shows the prompt's prefill progress (rank 0
reports it: the ranks prefill in step, chunk by chunk). Killing rank 1's engine process fails the
instance with a reason that names the rank; the scheduler places it again (generation 1, new ring
ports) and it serves the same tokens.

Disaggregated, a pipeline decodes from a single-worker instance's handoff (rank 0's worker receives
it, every rank takes its layers) and prefills for one (rank 0 sends every rank's layers), with the
tokens of the colocated run.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Iterator

import aiohttp
import msgspec
import pytest

from fleet_bus import Bus
from fleet_downloader.defaults import DEFAULT_MODEL_ID, DEFAULT_MODEL_SOURCE
from fleet_local import stack
from fleet_local.processes import free_port, spawn, stop_pid
from fleet_proto import InstanceFailed
from fleet_proto.subjects import event_subject
from tests.support import call, embedded_stack, engine_children, until_ready, until_state, worker_env

pytestmark = pytest.mark.slow
QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow."]
MAX_TOKENS = 12
# Prefill in chunks of 8 tokens: every chat prompt here reports its progress a few times; KV blocks
# of 16 tokens: a question asked again reuses its prefix from each rank's memory.
ENGINE_OPTIONS = json.dumps({"mlx": {"prefill_step_size": 8}})
KV_BLOCK = 16
PROGRESS = ": prefill_progress "


class Cluster:
    def __init__(self, manifest: stack.StackManifest, w2_pid: int) -> None:
        self.manifest = manifest
        self.w2_pid = w2_pid
        self.gateway = manifest.gateway_url


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("pipeline")
    env = {
        **os.environ,
        "FLEET_NODE_ID": "w1",
        "FLEET_NODE_ENGINES": "mlx",
        "FLEET_RING_HOST": "127.0.0.1",
        "FLEET_RING_PORT_BASE": str(free_port()),
        "FLEET_ENGINE_OPTIONS": ENGINE_OPTIONS,
        "FLEET_KV_BLOCK_SIZE": str(KV_BLOCK),
    }
    with embedded_stack(root / "state", env=env) as manifest:
        w2_env = worker_env(
            manifest,
            "w2",
            root / "w2",
            node_engines="mlx",
            ring_host="127.0.0.1",
            ring_port_base=str(free_port()),
        )
        w2 = spawn(
            [sys.executable, "-m", "fleet_worker"],
            root / "w2.log",
            {**w2_env, "FLEET_ENGINE_OPTIONS": ENGINE_OPTIONS, "FLEET_KV_BLOCK_SIZE": str(KV_BLOCK)},
        )
        try:
            asyncio.run(stage(manifest.gateway_url))
            yield Cluster(manifest, w2.pid)
        finally:
            stop_pid(w2.pid)


async def stage(gateway: str) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": DEFAULT_MODEL_ID, "source": DEFAULT_MODEL_SOURCE}
        await call(session, "POST", f"{gateway}/models", body)

        def staged(state: dict) -> bool:
            return DEFAULT_MODEL_ID in state["models"] and {"w1", "w2"} <= set(state["nodes"])

        await until_state(session, gateway, staged, 300)


async def create(session: aiohttp.ClientSession, gateway: str, shards: list[dict], role: str = "both") -> str:
    body = {"model": DEFAULT_MODEL_ID, "engine": "mlx", "shards": shards, "role": role}
    instance_id = (await call(session, "POST", f"{gateway}/instances", body))["instance_id"]
    await until_ready(session, gateway, instance_id)
    return instance_id


async def delete(session: aiohttp.ClientSession, gateway: str, instance_id: str) -> None:
    async with session.delete(f"{gateway}/instances/{instance_id}") as response:
        assert response.status < 300, await response.text()
    await until_state(session, gateway, lambda s: instance_id not in s["instances"], 60)


async def answers(session: aiohttp.ClientSession, gateway: str) -> list[list[int]]:
    """The greedy completion token ids of every question, all asked at once."""

    async def ask(question: str) -> list[int]:
        body = {
            "model": DEFAULT_MODEL_ID,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "logprobs": True,
        }
        reply = await call(session, "POST", f"{gateway}/v1/chat/completions", body)
        return [entry["token"] for entry in reply["choices"][0]["logprobs"]["content"]]

    return list(await asyncio.gather(*(ask(q) for q in QUESTIONS)))


async def bench(
    session: aiohttp.ClientSession, gateway: str, question: str, **options
) -> tuple[list[int], dict]:
    """One question through the bench endpoint: its token ids and generation stats."""
    body = {
        "model": DEFAULT_MODEL_ID,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": True,
        **options,
    }
    reply = await call(session, "POST", f"{gateway}/bench/chat/completions", body)
    return [entry["token"] for entry in reply["choices"][0]["logprobs"]["content"]], reply["generation_stats"]


async def streamed_progress(session: aiohttp.ClientSession, gateway: str) -> tuple[list[dict], int]:
    """The prefill progress comments of one streamed chat (a new question), and its prompt's token
    count (usage)."""
    body = {
        "model": DEFAULT_MODEL_ID,
        "messages": [{"role": "user", "content": "Describe the sea in one sentence."}],
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    progress, usage = [], {}
    async with session.post(f"{gateway}/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith(PROGRESS):
                progress.append(json.loads(line[len(PROGRESS) :]))
            elif line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return progress, usage["prompt_tokens"]


def halves(first: str, second: str) -> list[dict]:
    return [
        {"node_id": first, "start_layer": 0, "end_layer": 15},
        {"node_id": second, "start_layer": 15, "end_layer": 30},
    ]


def test_pipeline_decodes_like_one_worker_and_a_dead_rank_is_placed_again(cluster: Cluster) -> None:
    asyncio.run(scenario(cluster))


async def scenario(cluster: Cluster) -> None:
    gateway = cluster.gateway
    async with aiohttp.ClientSession() as session:
        single = await create(session, gateway, [{"node_id": "w1", "start_layer": 0, "end_layer": 30}])
        expected = await answers(session, gateway)
        await delete(session, gateway, single)

        pipeline = await create(session, gateway, halves("w1", "w2"))
        state = await until_state(session, gateway, lambda s: True, 1)
        shards = state["instances"][pipeline]["shards"]
        assert [s["node_id"] for s in shards] == ["w1", "w2"]
        assert len({s["ring_address"] for s in shards}) == 2
        assert await answers(session, gateway) == expected
        assert all(expected) and max(map(len, expected)) > 3
        # every rank kept its layers' blocks of the question: asked again, its prefix is reused
        again, stats = await bench(session, gateway, QUESTIONS[0])
        assert again == expected[0]
        assert stats["prefix_cached_tokens"] == (stats["prompt_tokens"] - 1) // KV_BLOCK * KV_BLOCK > 0
        progress, prompt_tokens = await streamed_progress(session, gateway)
        done = [p["processed_tokens"] for p in progress]
        # after each 8-token chunk past the cached prefix (the chat template's first block is shared)
        assert done and (done[0] - 8) % KV_BLOCK == 0, done
        assert done == list(range(done[0], prompt_tokens - 1, 8)), (done, prompt_tokens)
        assert {p["total_tokens"] for p in progress} == {prompt_tokens}

        failures: list[InstanceFailed] = []

        async def on_failed(msg) -> None:
            failures.append(msgspec.json.decode(msg.data, type=InstanceFailed))

        bus = await Bus.connect(cluster.manifest.nats_url, "pipeline-test")
        sub = await bus.nc.subscribe(event_subject(InstanceFailed), cb=on_failed)
        try:
            (rank1,) = engine_children(cluster.w2_pid)
            os.kill(rank1, signal.SIGKILL)
            killed = time.monotonic()

            def placed_again(state: dict) -> bool:
                instance = state["instances"].get(pipeline, {})
                return instance.get("generation") == 1 and instance.get("status") == "ready"

            state = await until_state(session, gateway, placed_again, 300)
            replaced_s = time.monotonic() - killed
        finally:
            await sub.unsubscribe()
            await bus.close()
        reasons = [f.reason for f in failures if f.instance_id == pipeline and f.generation == 0]
        assert any("rank 1 of 2 (layers 15-30 on w2)" in r and "SIGKILL" in r for r in reasons), reasons
        old = {s["ring_address"] for s in shards}
        assert not old & {s["ring_address"] for s in state["instances"][pipeline]["shards"]}
        assert await answers(session, gateway) == expected
        print(f"pipeline placed again and ready {replaced_s:.1f} s after rank 1 was killed")
        await delete(session, gateway, pipeline)


def test_a_pipeline_decodes_from_and_prefills_for_a_one_worker_instance(cluster: Cluster) -> None:
    asyncio.run(handoffs(cluster.gateway))


async def disaggregated(session: aiohttp.ClientSession, gateway: str, question: str) -> dict:
    """The question colocated, then disaggregated (stream handoff): the same tokens, the handoff used."""
    colocated, stats = await bench(session, gateway, question, disaggregated=False)
    assert stats["handoff"] is None
    tokens, stats = await bench(session, gateway, question, disaggregated=True, transport="stream")
    handoff = stats["handoff"]
    assert stats["disaggregated"] and handoff["fallback"] == "" and handoff["bytes"] > 0, handoff
    assert tokens == colocated and len(tokens) > 3
    return handoff


async def handoffs(gateway: str) -> None:
    whole_w2 = [{"node_id": "w2", "start_layer": 0, "end_layer": 30}]
    async with aiohttp.ClientSession() as session:
        pipeline = await create(session, gateway, halves("w1", "w2"), role="decode")
        prefiller = await create(session, gateway, whole_w2, role="prefill")
        handoff = await disaggregated(session, gateway, QUESTIONS[0])
        assert handoff["prefill_worker_id"] == "w2"
        await delete(session, gateway, pipeline)
        await delete(session, gateway, prefiller)

        pipeline = await create(session, gateway, halves("w1", "w2"), role="prefill")
        decoder = await create(session, gateway, whole_w2, role="decode")
        handoff = await disaggregated(session, gateway, QUESTIONS[1])
        assert handoff["prefill_worker_id"] == "w1"  # rank 0's worker sends every rank's layers
        await delete(session, gateway, pipeline)
        await delete(session, gateway, decoder)
