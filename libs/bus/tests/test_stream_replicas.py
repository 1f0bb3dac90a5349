"""FLEET_STREAM_REPLICAS on a real three-server JetStream cluster (loopback): every stream and KV
bucket is kept on three servers, and a command published before one server is killed is still there.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet_bus import Bus, ensure_streams
from fleet_local.processes import free_port, spawn, stop_pid, wait_http
from fleet_local.servers import find_binary
from fleet_proto import CreateInstance, decode_command
from fleet_proto.subjects import CMD_STREAM, KV_BUCKETS, STREAMS

SERVERS = 3


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[tuple[int, str]]]:
    """Three nats-servers routed to each other: (pid, client URL) each."""
    cluster_ports = [free_port() for _ in range(SERVERS)]
    routes = ",".join(f"nats://127.0.0.1:{p}" for p in cluster_ports)
    started = []
    try:
        for n, cluster_port in enumerate(cluster_ports):
            port, monitor = free_port(), free_port()
            argv = [
                find_binary("nats-server"), "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor),
                "-js", "-sd", str(tmp_path / f"js{n}"), "-n", f"fleet-{n}",
                "--cluster_name", "fleet", "--cluster", f"nats://127.0.0.1:{cluster_port}",
                "--routes", routes,
            ]  # fmt: skip
            log = tmp_path / f"nats{n}.log"
            proc = spawn(argv, log)
            started.append((proc, log, monitor, f"nats://127.0.0.1:{port}"))
        for proc, log, monitor, _ in started:  # healthy = JetStream has its meta leader
            wait_http(
                proc, "nats-server", log, f"http://127.0.0.1:{monitor}/healthz?js-enabled-only=true", 30
            )
        yield [(proc.pid, url) for proc, _, _, url in started]
    finally:
        for proc, *_ in started:
            stop_pid(proc.pid)


async def ensure_when_the_cluster_is_ready(bus: Bus, replicas: int) -> None:
    """The meta leader is elected a moment after the servers answer health: retry briefly."""
    for attempt in range(40):
        try:
            await ensure_streams(bus.js, replicas)
            return
        except Exception:
            if attempt == 39:
                raise
            await asyncio.sleep(0.5)


async def test_three_replicas_keep_a_command_when_a_server_dies(cluster):
    (first_pid, first_url), (_, second_url), _ = cluster
    bus = await Bus.connect(first_url, "replicas-test")
    try:
        await ensure_when_the_cluster_is_ready(bus, replicas=3)
        for spec in STREAMS:
            assert (await bus.js.stream_info(spec.name)).config.num_replicas == 3
        for bucket in KV_BUCKETS:
            assert (await bus.js.stream_info(f"KV_{bucket}")).config.num_replicas == 3
        command = CreateInstance(command_id="cmd-replicated", model_id="m", instance_id="i-1")
        await bus.publish_command(command)
    finally:
        await bus.close()
    os.kill(first_pid, signal.SIGKILL)

    survivor = await Bus.connect(second_url, "replicas-test")
    try:
        for attempt in range(40):  # the stream elects a new leader among the two left
            try:
                stored = await survivor.js.get_last_msg(CMD_STREAM.name, "fleet.cmd.>")
                break
            except Exception:
                if attempt == 39:
                    raise
                await asyncio.sleep(0.5)
        assert decode_command(stored.data) == command
    finally:
        await survivor.close()
