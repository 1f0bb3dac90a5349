"""The embedded stack end to end: `fleet up`, five healthy services, /state, /events, `fleet down`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from fleet_bus import Bus
from fleet_local import stack
from fleet_local.processes import free_port, pid_alive
from fleet_local.servers import leftover_weed_sockets
from fleet_proto import NodeLeft
from tests.support import fleet

SERVICE_NAMES = {name for name, _ in stack.SERVICES}


@pytest.fixture(scope="module")
def running_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[stack.StackManifest]:
    state_dir = tmp_path_factory.mktemp("fleet-state")
    sockets_before = set(leftover_weed_sockets())
    port = free_port()
    manifest = None
    result = fleet("up", "--state-dir", str(state_dir), "--port", str(port), "--detach", "--model", "")
    try:
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"http://127.0.0.1:{port}" in result.stdout
        manifest = stack.read_manifest(state_dir)
        assert manifest is not None
        yield manifest
    finally:
        down = fleet("down", "--state-dir", str(state_dir))
    assert down.returncode == 0, down.stderr
    manifest = manifest or stack.StackManifest(state_dir=str(state_dir))
    alive = [p.name for p in manifest.processes if pid_alive(p.pid, p.started_at)]
    assert alive == [], f"still running after fleet down: {alive}"
    assert set(leftover_weed_sockets()) <= sockets_before, "weed left socket files in /tmp"
    assert not (state_dir / "stack.json").exists()


def test_all_five_services_report_healthy(running_stack):
    status = fleet("status", "--state-dir", running_stack.state_dir, "--json", timeout=60)
    assert status.returncode == 0, status.stdout
    rows = {row["name"]: row for row in json.loads(status.stdout)["processes"]}
    assert SERVICE_NAMES | {"nats", "s3", "redis"} == set(rows)
    assert all(row["healthy"] for row in rows.values())


def keyed(manifest: stack.StackManifest) -> dict[str, str]:
    """`fleet up` turns the gateway's keys on: reads need the API key it generated."""
    assert manifest.api_key
    return {"Authorization": f"Bearer {manifest.api_key}"}


async def get_json(url: str, headers: dict[str, str]) -> dict:
    async with aiohttp.ClientSession(headers=headers) as session, session.get(url) as response:
        assert response.status == 200
        return await response.json()


async def test_state_lists_the_workers_node_and_every_service(running_stack):
    state = await get_json(f"{running_stack.gateway_url}/state", keyed(running_stack))
    assert len(state["nodes"]) == 1
    node = next(iter(state["nodes"].values()))
    assert node["cpu_count"] == os.cpu_count()
    assert node["memory_total_bytes"] > 0 and node["disk_free_bytes"] > 0
    kinds = sorted(s["kind"] for s in state["services"].values())
    assert kinds == sorted(SERVICE_NAMES)
    workers = [s for s in state["services"].values() if s["kind"] == "engine-worker"]
    assert workers[0]["node_id"] == node["node_id"]


async def test_events_are_readable_json_on_nats_and_on_sse(running_stack):
    bus = await Bus.connect(running_stack.nats_url, "test-watcher")
    raw = await bus.nc.subscribe("fleet.>")
    try:
        # nats-style inspection: the worker's 1 Hz metrics are plain JSON
        metrics = await raw.next_msg(timeout=5)
        while not metrics.subject.startswith("fleet.metrics."):
            metrics = await raw.next_msg(timeout=5)
        assert json.loads(metrics.data)["memory_available_bytes"] > 0

        async with (
            aiohttp.ClientSession(headers=keyed(running_stack)) as session,
            session.get(f"{running_stack.gateway_url}/events") as sse,
        ):
            assert sse.headers["Content-Type"].startswith("text/event-stream")
            await sse.content.readuntil(b"\n\n")  # the opening comment: the gateway is listening
            seq = await bus.publish_event(NodeLeft(node_id="ghost", reason="test"))
            frame = (await asyncio.wait_for(sse.content.readuntil(b"\n\n"), 10)).decode()
        assert frame.startswith(f"event: node_left\nid: {seq}\ndata: ")
        assert json.loads(frame.split("data: ", 1)[1])["node_id"] == "ghost"

        on_nats = await raw.next_msg(timeout=5)
        while on_nats.subject != "fleet.evt.node_left":
            on_nats = await raw.next_msg(timeout=5)
        assert json.loads(on_nats.data)["reason"] == "test"
    finally:
        await raw.unsubscribe()
        await bus.close()


async def test_sigterm_stops_a_service_cleanly_and_it_says_so(running_stack):
    worker = next(p for p in running_stack.processes if p.name == "engine-worker")
    os.kill(worker.pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while pid_alive(worker.pid, worker.started_at) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not pid_alive(worker.pid, worker.started_at)
    state = await get_json(f"{running_stack.gateway_url}/state", keyed(running_stack))
    for _ in range(50):
        if not state["nodes"]:
            break
        await asyncio.sleep(0.1)
        state = await get_json(f"{running_stack.gateway_url}/state", keyed(running_stack))
    assert state["nodes"] == {}  # NodeLeft published on shutdown
    assert "engine-worker" not in {s["kind"] for s in state["services"].values()}  # ServiceStopped
    assert "stopping" in Path(worker.log_path).read_text()


def test_a_service_without_nats_exits_with_a_clear_message(tmp_path):
    dead = f"nats://127.0.0.1:{free_port()}"
    env = {**os.environ, "FLEET_NATS_URL": dead, "FLEET_LOG_FORMAT": "text"}
    result = subprocess.run(
        [sys.executable, "-m", "fleet_scheduler"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert f"cannot reach NATS at {dead}" in result.stderr
    assert "Traceback" not in result.stderr


def test_fleet_pull_stages_a_model_with_a_progress_bar(running_stack, tmp_path):
    from tests.support import MODEL, make_chat_model

    folder = make_chat_model(tmp_path / "model")
    result = fleet("pull", MODEL, "--source", f"file://{folder}", "--state-dir", running_stack.state_dir)
    assert result.returncode == 0, result.stderr
    assert MODEL in result.stderr and "done" in result.stderr  # tqdm draws on stderr
    bad = fleet("pull", "x/y", "--source", "file:///no/such/dir", "--state-dir", running_stack.state_dir)
    assert bad.returncode == 1
    assert "failed" in bad.stderr
