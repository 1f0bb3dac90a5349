"""The scaling story without Docker: each service its own process against shared servers, as docker
compose or Kubernetes run them.

`fleet up --infra-only` starts NATS, S3 and Redis (with credentials, the gateway keyed); `fleet env`
writes the settings that join them; then two schedulers, a downloader, a metrics collector, two
gateways and two engine-workers run from that one env file (`fleet <service> --env-file`). Through both
gateways the cluster serves; the leading scheduler and one engine-worker are SIGKILLed together, and
the survivors must re-place that worker's instance and keep answering; a third worker then joins (a
scale-up) and takes the next instance.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import msgspec
import pytest

from fleet_bus import Bus
from fleet_local import stack
from fleet_local.processes import free_port, pid_alive, process_started_at, spawn, stop_pid, wait_http
from fleet_scheduler.leader import read_lease
from tests.support import FLEET, MESSAGES, MODEL, fleet, make_chat_model, until_state

GiB = 2**30
WORKER_MEMORY = str(4 * GiB)  # reported by every worker: room for all three instances on any one
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}


class Service(msgspec.Struct):
    name: str
    pid: int
    started_at: float
    log_path: Path
    health_url: str


class Cluster(msgspec.Struct):
    root: Path
    env_file: Path
    manifest: stack.StackManifest
    services: dict[str, Service]
    gateways: list[str]

    def start(self, command: str, name: str, *flags: str, **settings: str) -> Service:
        """`fleet <command> --env-file fleet.env`, its own state dir, /health on a free port."""
        port = free_port()
        log_path = self.root / "logs" / f"{name}.log"
        env = os.environ | {"FLEET_STATE_DIR": str(self.root / name), "FLEET_LOG_FORMAT": "text"}
        env |= {f"FLEET_{key.upper()}": value for key, value in settings.items()}
        argv = [*FLEET, command, "--env-file", str(self.env_file)]
        proc = spawn([*argv, "--port", str(port), *flags], log_path, env=env)
        service = Service(
            name, proc.pid, process_started_at(proc.pid), log_path, f"http://127.0.0.1:{port}/health"
        )
        self.services[name] = service
        wait_http(proc, name, log_path, service.health_url, 120)
        return service

    def start_worker(self, node_id: str) -> Service:
        return self.start("worker", node_id, "--node-id", node_id, node_memory_bytes=WORKER_MEMORY)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("remote")
    state = root / "infra"
    up = fleet("up", "--infra-only", "--detach", "--state-dir", str(state))
    assert up.returncode == 0, up.stdout + up.stderr
    manifest = stack.read_manifest(state)
    assert manifest is not None and [p.name for p in manifest.processes] == ["nats", "s3", "redis"]
    env = fleet("env", "--state-dir", str(state))
    assert env.returncode == 0, env.stderr
    env_file = root / "fleet.env"
    env_file.write_text(env.stdout)
    env_file.chmod(0o600)
    cluster = Cluster(root=root, env_file=env_file, manifest=manifest, services={}, gateways=[])
    try:
        for name in ("scheduler-a", "scheduler-b"):
            cluster.start("scheduler", name)
        cluster.start("downloader", "downloader")
        cluster.start("metrics-collector", "metrics-collector")
        for name in ("gateway-a", "gateway-b"):
            gateway = cluster.start("gateway", name)
            cluster.gateways.append(gateway.health_url.removesuffix("/health"))
        for node_id in ("w1", "w2"):
            cluster.start_worker(node_id)
        yield cluster
    finally:
        for service in reversed(cluster.services.values()):
            stop_pid(service.pid, service.started_at)
        stack.down(state)
    assert not any(pid_alive(s.pid, s.started_at) for s in cluster.services.values())


async def chat(session: aiohttp.ClientSession, gateway: str) -> int:
    async with session.post(f"{gateway}/v1/chat/completions", json=CHAT) as response:
        assert response.status == 200, await response.text()
        return (await response.json())["usage"]["completion_tokens"]


async def new_instance(session: aiohttp.ClientSession, gateway: str, node_id: str, layers: int) -> str:
    """An instance placed on node_id: the scheduler would prefer a node that has the files already."""
    body = {"model": MODEL, "shards": [{"node_id": node_id, "start_layer": 0, "end_layer": layers}]}
    async with session.post(f"{gateway}/instances", json=body) as response:
        assert response.status == 202, await response.text()
        return (await response.json())["instance_id"]


def ready_on(instance_id: str, node_id: str):
    def check(state: dict) -> bool:
        instance = state["instances"].get(instance_id, {})
        return instance.get("node_id") == node_id and instance.get("status") == "ready"

    return check


async def test_services_run_apart_scale_out_and_survive_a_scheduler_and_a_worker_killed(cluster: Cluster):
    model_dir = make_chat_model(cluster.root / "model")
    headers = {"Authorization": f"Bearer {cluster.manifest.admin_key}"}
    gateway_a, gateway_b = cluster.gateways
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=60)) as session:
        # Every process found the others through the shared servers only.
        async with session.post(
            f"{gateway_a}/models", json={"model": MODEL, "source": f"file://{model_dir}"}
        ) as r:
            assert r.status == 202, await r.text()
        state = await until_state(
            session, gateway_b, lambda s: MODEL in s["models"] and {"w1", "w2"} <= set(s["nodes"]), 60
        )
        layers = state["models"][MODEL]["num_layers"]
        on_w1 = await new_instance(session, gateway_a, "w1", layers)
        on_w2 = await new_instance(session, gateway_b, "w2", layers)
        await until_state(session, gateway_a, ready_on(on_w1, "w1"), 120)
        await until_state(session, gateway_a, ready_on(on_w2, "w2"), 120)
        answered = [await chat(session, gateway) for gateway in (gateway_a, gateway_b, gateway_a, gateway_b)]
        assert answered == [4] * 4

        # The leading scheduler and worker w2 die together, without a goodbye.
        bus = await Bus.connect(cluster.manifest.nats_url, "remote-services-test")
        try:
            leader = await read_lease(bus)
            schedulers = {s.pid: s for n, s in cluster.services.items() if n.startswith("scheduler")}
            assert leader is not None and leader.pid in schedulers
            os.kill(leader.pid, signal.SIGKILL)
            os.killpg(cluster.services["w2"].pid, signal.SIGKILL)  # the worker and its engine children
            killed = time.monotonic()
            # Requests sent right away are answered: routed to w1, or re-routed off the dead worker.
            answered = await asyncio.gather(*(chat(session, g) for g in (gateway_a, gateway_b) * 2))
            assert answered == [4] * 4
            state = await until_state(session, gateway_b, ready_on(on_w2, "w1"), 90)
            replaced_s = time.monotonic() - killed
            assert "w2" not in state["nodes"]
            successor = await read_lease(bus)
            assert successor is not None and successor.pid in set(schedulers) - {leader.pid}
        finally:
            await bus.close()
        assert [await chat(session, gateway) for gateway in (gateway_a, gateway_b)] == [4, 4]

        # Scale out: a third worker joins and serves an instance.
        cluster.start_worker("w3")
        await until_state(session, gateway_a, lambda s: "w3" in s["nodes"], 30)
        third = await new_instance(session, gateway_a, "w3", layers)
        await until_state(session, gateway_a, ready_on(third, "w3"), 120)
        assert await chat(session, gateway_b) == 4
    print(f"w2's instance ready again on w1 {replaced_s:.1f} s after the leader and w2 were killed")
