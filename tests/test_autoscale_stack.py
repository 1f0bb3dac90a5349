"""Instances follow demand on the real stack (issue 45): `fleet up` serves the tiny chat model with one
instance on worker w1 (2 request slots); an admin enables autoscaling (PUT /scaling/<model>, min 1,
max 2, short windows); under load a second worker, w2, joins:

- the scheduler adds an instance on w2 within the policy's window, recorded as a scale_up decision
  with its reason in /state; TTFT measured before and after it serves;
- after the load stops it drains one (scale_down), back to one instance;
- with min_instances 0 the last instance drains after idle_s; the next request (streamed) waits,
  sees waiting_for_instance progress comments, and gets its answer from the instance placed for it.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from fleet_local import stack
from fleet_local.processes import spawn, stop_pid
from tests.support import MODEL, call, embedded_stack, make_chat_model, until_state, worker_env

SLOTS = 2
CLIENTS = 6  # 3x the first instance's slots: over target until a second instance serves
POLICY = {
    "min_instances": 1,
    "max_instances": 2,
    "scale_up_window_s": 2,
    "scale_up_cooldown_s": 5,
    "scale_down_delay_s": 4,
    "idle_s": 600,
}


class Cluster:
    def __init__(self, manifest: stack.StackManifest, root: Path) -> None:
        self.manifest = manifest
        self.root = root
        self.gateway = manifest.gateway_url


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("autoscale")
    env = {
        **os.environ,
        "FLEET_NODE_ID": "w1",
        "FLEET_NODE_ENGINES": "mlx",
        "FLEET_ENGINE_OPTIONS": json.dumps({"mlx": {"max_batch_size": SLOTS}}),
    }
    with embedded_stack(root / "state", MODEL, make_chat_model(root / "model"), env=env) as manifest:
        yield Cluster(manifest, root)


def serving(state: dict) -> list[dict]:
    live = ("placed", "downloading", "loading", "warming", "ready")
    return [i for i in state["instances"].values() if i["model_id"] == MODEL and i["status"] in live]


def decisions(state: dict, kind: str) -> list[dict]:
    return [d for d in state.get("scaling", {}).get(MODEL, {}).get("decisions", []) if d["kind"] == kind]


async def streamed(session: aiohttp.ClientSession, gateway: str, max_tokens: int) -> tuple[float, str]:
    """One streamed completion: its TTFT (s) and its whole SSE text."""
    body = {"model": MODEL, "prompt": "Count slowly.", "max_tokens": max_tokens, "temperature": 0}
    started, first = time.monotonic(), 0.0
    text = ""
    async with session.post(f"{gateway}/v1/completions", json={**body, "stream": True}) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            text += line.decode()
            if not first and line.startswith(b"data: {") and b'"text":""' not in line:
                first = time.monotonic() - started
    return first, text


async def load(gateway: str, stop: asyncio.Event, ttfts: list[tuple[float, float]]) -> None:
    """CLIENTS closed loops of streamed completions until `stop` (bounded: 400 requests at most)."""
    async with aiohttp.ClientSession() as session:

        async def client() -> None:
            for _ in range(400 // CLIENTS):
                if stop.is_set():
                    return
                ttft, _ = await streamed(session, gateway, 48)
                ttfts.append((time.monotonic(), ttft))

        await asyncio.gather(*(client() for _ in range(CLIENTS)))


async def test_instances_follow_load_onto_a_joining_worker_and_back(cluster: Cluster) -> None:
    gateway = cluster.gateway
    worker = None
    async with aiohttp.ClientSession() as session:
        await until_state(session, gateway, lambda s: any(i["status"] == "ready" for i in serving(s)), 120)
        await call(session, "PUT", f"{gateway}/scaling/{MODEL}", POLICY)
        await until_state(
            session, gateway, lambda s: s["scaling"].get(MODEL, {}).get("policy", {}).get("enabled"), 20
        )

        stop, ttfts = asyncio.Event(), []
        loading = asyncio.create_task(load(gateway, stop, ttfts))
        try:
            # over target on w1 alone: holds for the window, then because w1 is the only node
            nowhere = "every node runs an instance of it already"
            await until_state(
                session, gateway, lambda s: any(nowhere in d["reason"] for d in decisions(s, "hold")), 20
            )
            worker = spawn(
                [sys.executable, "-m", "fleet_worker"],
                cluster.root / "w2.log",
                worker_env(cluster.manifest, "w2", cluster.root / "w2", node_engines="mlx",
                           engine_options=json.dumps({"mlx": {"max_batch_size": SLOTS}})),
            )  # fmt: skip
            joined_at = time.monotonic()

            def on_w2(state: dict) -> bool:
                return any(i["node_id"] == "w2" and i["status"] == "ready" for i in serving(state))

            scaled = await until_state(session, gateway, on_w2, 120)
            ready_at = time.monotonic()
            [up] = decisions(scaled, "scale_up")
            assert up["instance_id"].startswith("auto-") and "1 -> 2 instances" in up["reason"]
            await asyncio.sleep(8)  # both instances serve the load
        finally:
            stop.set()
            await asyncio.wait_for(loading, 120)
        before = [t for at, t in ttfts if at < joined_at]
        after = [t for at, t in ttfts if at > ready_at + 2]
        assert before and after
        print(
            f"TTFT p50 on 1 instance {statistics.median(before):.3f} s ({len(before)} requests), "
            f"on 2 {statistics.median(after):.3f} s ({len(after)}): "
            f"{statistics.median(after) / statistics.median(before):.2f}x; "
            f"second instance ready {ready_at - joined_at:.1f} s after w2 started"
        )

        # no load: one drains after scale_down_delay_s
        def one_left(state: dict) -> bool:
            return len(serving(state)) == 1 and bool(decisions(state, "scale_down"))

        down = await until_state(session, gateway, one_left, 60)
        assert "drains (least loaded" in decisions(down, "scale_down")[-1]["reason"]

        # to zero after idle_s; a request then waits for an instance placed for it
        await call(session, "PUT", f"{gateway}/scaling/{MODEL}", {"min_instances": 0, "idle_s": 2})
        await until_state(session, gateway, lambda s: not serving(s), 60)
        ttft, text = await streamed(session, gateway, 8)
        waits = [
            json.loads(line.split(" ", 2)[2]) for line in text.splitlines() if line.startswith(": waiting")
        ]
        assert waits and waits[0]["model"] == MODEL
        assert text.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in text
        state = await until_state(session, gateway, lambda s: len(serving(s)) == 1, 10)
        assert "0 -> 1 instances" in decisions(state, "scale_up")[-1]["reason"]
        print(f"cold start: first token after {ttft:.1f} s, {len(waits)} progress comments")
    if worker is not None:
        stop_pid(worker.pid)
