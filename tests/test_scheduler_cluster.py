"""The scheduler with several engine-workers: placement, previews, capabilities, failover.

Real nats/S3/valkey and real worker processes; each worker is told what memory and engines to
report (FLEET_NODE_MEMORY_BYTES, FLEET_NODE_ENGINES) so placement can be exercised on one machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from fleet_bus import Bus
from fleet_local import stack
from fleet_local.processes import pid_alive, spawn, stop_pid
from tests.support import MESSAGES, MODEL, embedded_stack, make_chat_model, until_state, worker_env

GiB = 2**30


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[stack.StackManifest, dict[str, int]]]:
    """The stack's own worker is w1 (mlx, 2 GiB); w2 (mlx, 6 GiB) and w3 (no engine) join it."""
    root = tmp_path_factory.mktemp("cluster")
    model_dir = make_chat_model(root / "model")
    env = {
        **os.environ,
        "FLEET_NODE_ID": "w1",
        "FLEET_NODE_MEMORY_BYTES": str(2 * GiB),
        "FLEET_NODE_ENGINES": "mlx",
    }
    workers: dict[str, int] = {}
    with embedded_stack(root / "state", env=env) as manifest:
        try:
            for node_id, memory, engines in (("w2", 6 * GiB, "mlx"), ("w3", 16 * GiB, "none")):
                proc = spawn(
                    [sys.executable, "-m", "fleet_worker"],
                    root / f"{node_id}.log",
                    worker_env(
                        manifest, node_id, root / node_id, node_memory_bytes=str(memory), node_engines=engines
                    ),
                )
                workers[node_id] = proc.pid
            asyncio.run(stage(manifest.gateway_url, f"file://{model_dir}"))
            yield manifest, workers
        finally:
            for pid in workers.values():
                stop_pid(pid)


async def stage(gateway: str, source: str) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{gateway}/models", json={"model": MODEL, "source": source}) as response:
            assert response.status == 202
        await until_state(session, gateway, lambda s: MODEL in s["models"] and len(s["nodes"]) == 3, 60)


async def test_capabilities_list_the_engines_and_their_nodes(cluster):
    manifest, _ = cluster
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{manifest.gateway_url}/capabilities") as response,
    ):
        body = await response.json()
    assert body["mlx_available"] is True and body["vllm_available"] is False
    assert body["engines"]["mlx"]["nodes"] == ["w1", "w2"]


async def test_placement_previews_show_every_option_with_reasons(cluster):
    manifest, _ = cluster
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{manifest.gateway_url}/placements", params={"model": MODEL}) as response:
            assert response.status == 200
            options = (await response.json())["options"]
        async with session.get(f"{manifest.gateway_url}/placements", params={"model": "no/such"}) as response:
            assert response.status == 404
    feasible = [o for o in options if o["feasible"]]
    assert {o["shards"][0]["node_id"] for o in feasible} == {"w1", "w2"}
    assert feasible[0]["shards"][0]["node_id"] == "w2"  # the most memory left after placing
    assert all(o["memory_needed"] for o in feasible)


async def test_instance_lands_on_the_best_node_then_fails_over_when_it_dies(cluster):
    manifest, workers = cluster
    gateway = manifest.gateway_url
    bus = await Bus.connect(manifest.nats_url, "lifecycle-watcher")
    events: list[dict] = []

    async def record(msg) -> None:
        events.append(json.loads(msg.data))

    sub = await bus.nc.subscribe("fleet.evt.>", cb=record)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{gateway}/instances", json={"model": MODEL}) as response:
            instance_id = (await response.json())["instance_id"]
        state = await until_state(
            session, gateway, lambda s: s["instances"].get(instance_id, {}).get("status") == "ready", 60
        )
        assert state["instances"][instance_id]["node_id"] == "w2"
        await sub.unsubscribe()
        await bus.close()
        mine = [
            e
            for e in events
            if instance_id in (e.get("instance_id"), e.get("instance", {}).get("instance_id"))
        ]
        seen = [e.get("status") or e["kind"] for e in mine]
        # placed -> downloading (with progress) -> loading -> warming -> ready, each an event
        stages = [s for i, s in enumerate(seen) if i == 0 or s != seen[i - 1]]
        assert stages == ["instance_placed", "downloading", "instance_loading", "warming", "instance_ready"]

        os.killpg(workers["w2"], signal.SIGKILL)  # no goodbye: only the missing heartbeats tell
        killed = time.monotonic()
        state = await until_state(session, gateway, lambda s: "w2" not in s["nodes"], 15)
        detected_s = time.monotonic() - killed
        api_nodes = manifest.metrics_url.replace("/metrics", "/api/nodes")
        async with session.get(api_nodes) as response:  # the collector's live nodes follow State
            assert "w2" not in {n["node_id"] for n in (await response.json())["nodes"]}
        state = await until_state(
            session, gateway, lambda s: s["instances"][instance_id]["node_id"] == "w1"
            and s["instances"][instance_id]["status"] == "ready", 60,
        )  # fmt: skip
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
        async with session.post(f"{gateway}/v1/chat/completions", json=body) as response:
            assert response.status == 200
            assert (await response.json())["usage"]["completion_tokens"] == 4
    assert detected_s < 10
    assert not pid_alive(workers["w2"])


async def test_an_explicit_placement_is_validated(cluster):
    manifest, _ = cluster
    bad = {"model": MODEL, "shards": [{"node_id": "w3", "start_layer": 0, "end_layer": 2}]}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{manifest.gateway_url}/instances", json=bad) as response:
            instance_id = (await response.json())["instance_id"]
        state = await until_state(session, manifest.gateway_url, lambda s: instance_id in s["instances"], 10)
    instance = state["instances"][instance_id]
    assert instance["status"] == "failed", instance
    assert "w3" in instance["reason"]


async def test_deleting_a_model_removes_it_from_storage_and_worker_caches(cluster):
    manifest, _ = cluster
    gateway = manifest.gateway_url
    cached = Path(manifest.state_dir) / "models" / MODEL / "main"  # w1 ran it after the failover
    assert cached.is_dir()
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{gateway}/state") as response:
            instances = (await response.json())["instances"]
        for instance_id in instances:
            async with session.delete(f"{gateway}/instances/{instance_id}") as response:
                assert response.status == 202
        await until_state(session, gateway, lambda s: not s["instances"], 30)
        async with session.delete(f"{gateway}/downloads/{MODEL}") as response:
            assert response.status == 202
        await until_state(
            session, gateway, lambda s: MODEL not in s["models"] and MODEL not in s["downloads"], 30
        )
        async with session.get(f"{gateway}/downloads") as response:
            assert MODEL not in await response.json()
        async with session.get(f"{gateway}/placements", params={"model": MODEL}) as response:
            assert response.status == 404  # not staged any more
        async with session.delete(f"{gateway}/downloads/{MODEL}") as response:
            assert response.status == 404
    for _ in range(50):
        if not cached.exists():
            break
        await asyncio.sleep(0.1)
    assert not cached.exists()
