"""Engine and worker crashes on the real stack, injected with SIGKILL by PID.

- The engine child of an instance is killed mid-stream (what the kernel's OOM killer does): the
  stream ends with an error within 2 s, the instance is reported failed with the signal, the worker
  restarts the engine and the instance serves again.
- A whole worker is killed while requests are on their way to it: tasks it never took are
  withdrawn from its work queue and re-routed to another worker, so every request is answered.
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
import msgspec
import psutil
import pytest

from fleet_bus import Bus
from fleet_local import stack
from fleet_local.processes import spawn, stop_pid
from fleet_proto import RouteDecided
from tests.support import (
    MESSAGES,
    MODEL,
    embedded_stack,
    engine_children,
    frames_until_done,
    make_chat_model,
    stream_errors,
    until_state,
    worker_env,
)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[stack.StackManifest]:
    root = tmp_path_factory.mktemp("faults")
    model_dir = make_chat_model(root / "model")
    with embedded_stack(
        root / "state", MODEL, model_dir, env={**os.environ, "FLEET_NODE_ID": "w1"}
    ) as manifest:
        yield manifest


def chat(max_tokens: int, stream: bool = False) -> dict:
    return {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


async def instance_on(session: aiohttp.ClientSession, gateway: str, node: str) -> dict:
    async with session.get(f"{gateway}/state") as response:
        state = await response.json()
    return next(i for i in state["instances"].values() if i["node_id"] == node)


async def test_a_killed_engine_fails_its_streams_within_2_s_and_is_restarted(faulty):
    gateway = faulty.gateway_url
    worker = next(p for p in faulty.processes if p.name == "engine-worker")
    [child] = engine_children(worker.pid)
    events: list[dict] = []
    bus = await Bus.connect(faulty.nats_url, "fault-test")

    async def on_event(msg) -> None:
        events.append(json.loads(msg.data))

    sub = await bus.nc.subscribe("fleet.evt.>", cb=on_event)
    try:
        async with aiohttp.ClientSession() as session:
            instance_id = (await instance_on(session, gateway, "w1"))["instance_id"]
            async with session.post(
                f"{gateway}/v1/chat/completions", json=chat(400, stream=True)
            ) as response:
                assert response.status == 200
                await response.content.readuntil(b"\n\n")  # generating
                os.kill(child, signal.SIGKILL)
                killed_at = time.monotonic()
                frames = await frames_until_done(response, 5)
                ended_s = time.monotonic() - killed_at
            errors = stream_errors(frames)
            assert errors and "killed by SIGKILL" in errors[0]["message"], frames[-3:]
            assert ended_s < 2.0, f"the stream ended {ended_s:.2f} s after the kill"
            print(f"stream ended {ended_s * 1000:.0f} ms after the engine was killed")

            ready = await until_state(
                session,
                gateway,
                lambda s: (  # ready again after the failure, on a new engine process
                    any(e["kind"] == "instance_failed" for e in events)
                    and s["instances"][instance_id]["status"] == "ready"
                    and engine_children(worker.pid) not in ([], [child])
                ),
                120,
            )
            restarted_s = time.monotonic() - killed_at
            print(f"instance ready again {restarted_s:.1f} s after the kill")
            assert ready["instances"][instance_id]["reason"] == ""
            async with session.post(f"{gateway}/v1/chat/completions", json=chat(5)) as response:
                assert response.status == 200
                assert (await response.json())["usage"]["completion_tokens"] == 5
    finally:
        await sub.unsubscribe()
        await bus.close()
    failed = [e for e in events if e["kind"] == "instance_failed" and e["instance_id"] == instance_id]
    assert len(failed) == 1 and "SIGKILL" in failed[0]["reason"] and "restarting it" in failed[0]["reason"]
    assert psutil.pid_exists(worker.pid)  # the worker itself never went down


async def test_tasks_a_killed_worker_never_took_are_rerouted(faulty, tmp_path: Path):
    gateway = faulty.gateway_url
    w2 = spawn(
        [sys.executable, "-m", "fleet_worker"], tmp_path / "w2.log", worker_env(faulty, "w2", tmp_path / "w2")
    )
    decisions: dict[str, list[str]] = {}
    bus = await Bus.connect(faulty.nats_url, "fault-test")

    async def on_decided(msg) -> None:
        decided = msgspec.json.decode(msg.data, type=RouteDecided)
        decisions.setdefault(decided.request_id, []).append(decided.reply.worker_id)

    sub = await bus.nc.subscribe("fleet.route.decided", cb=on_decided)
    try:
        async with aiohttp.ClientSession() as session:
            await until_state(session, gateway, lambda s: "w2" in s["nodes"], 60)
            shards = [{"node_id": "w2", "start_layer": 0, "end_layer": 2}]
            async with session.post(
                f"{gateway}/instances", json={"model": MODEL, "shards": shards}
            ) as response:
                assert response.status == 202
                on_w2 = (await response.json())["instance_id"]
            await until_state(
                session, gateway, lambda s: s["instances"].get(on_w2, {}).get("status") == "ready", 120
            )
            await asyncio.sleep(1.5)  # both workers' metrics say idle

            os.killpg(w2.pid, signal.SIGKILL)  # the worker and its engine: no goodbye, tasks unacked
            killed_at = time.monotonic()

            async def ask() -> tuple[int, dict]:
                async with session.post(f"{gateway}/v1/chat/completions", json=chat(4)) as response:
                    return response.status, await response.json()

            # Sent at once, the routed load alternates them between the two idle instances.
            replies = await asyncio.wait_for(asyncio.gather(*(ask() for _ in range(4))), 60)
            answered_s = time.monotonic() - killed_at
    finally:
        await sub.unsubscribe()
        await bus.close()
        stop_pid(w2.pid)
    assert all(status == 200 for status, _ in replies), replies
    assert all(body["usage"]["completion_tokens"] == 4 for _, body in replies)
    rerouted = [decisions[body["id"]] for _, body in replies if decisions.get(body["id"], [""])[0] == "w2"]
    assert rerouted, f"no request was routed to the killed worker: {decisions}"
    assert all(path == ["w2", "w1"] for path in rerouted), rerouted
    print(
        f"{len(rerouted)} of 4 requests re-routed off the killed worker; all answered in {answered_s:.1f} s"
    )
