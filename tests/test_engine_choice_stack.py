"""Engines chosen by measurement through the real stack: a worker told it is an Apple node (whose
prior puts MLX first) places the default model on MLX; it times MLX as it loads and llama.cpp in the
background, reports both in its node info, and the leader moves the instance to llama.cpp, which
measured faster on this CPU; it then serves there. The numbers persist in the worker's state dir."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import aiohttp
import pytest

from fleet_downloader.defaults import DEFAULT_MODEL_ID, DEFAULT_MODEL_SOURCE
from tests.support import call, embedded_stack, until_state

pytestmark = pytest.mark.slow


def test_an_instance_placed_by_the_prior_moves_to_the_engine_measured_faster(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "FLEET_NODE_ID": "w1",
        "FLEET_NODE_KIND": "apple",
        "FLEET_NODE_ENGINES": "mlx=test,llamacpp=test",
        "FLEET_CALIBRATION": "all",
    }
    with embedded_stack(tmp_path / "state", env=env) as manifest:
        asyncio.run(serve_and_check(manifest.gateway_url))
    entries = json.loads(next((tmp_path / "state").rglob("calibration.json")).read_text())
    assert {(e["engine"], e["model_id"]) for e in entries} == {
        ("mlx", DEFAULT_MODEL_ID),
        ("llamacpp", DEFAULT_MODEL_ID),
    }


async def serve_and_check(gateway: str) -> None:
    async with aiohttp.ClientSession() as session:
        await call(
            session, "POST", f"{gateway}/models", {"model": DEFAULT_MODEL_ID, "source": DEFAULT_MODEL_SOURCE}
        )
        await until_state(session, gateway, lambda s: DEFAULT_MODEL_ID in s["models"] and s["nodes"], 300)
        placed = await call(session, "POST", f"{gateway}/instances", {"model": DEFAULT_MODEL_ID})
        instance_id = placed["instance_id"]

        def moved(state: dict) -> bool:
            instance = state["instances"].get(instance_id, {})
            return instance.get("engine") == "llamacpp" and instance.get("status") == "ready"

        state = await until_state(session, gateway, moved, 600)
        instance = state["instances"][instance_id]
        assert instance["generation"] == 1 and not instance["engine_pinned"]
        speeds = {c["engine"]: c for c in state["nodes"]["w1"]["calibrations"]}
        assert set(speeds) == {"mlx", "llamacpp"}
        assert all(c["prefill_tokens_per_s"] > 0 and c["decode_tokens_per_s"] > 0 for c in speeds.values())
        body = {"model": DEFAULT_MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        reply = await call(session, "POST", f"{gateway}/v1/chat/completions", body)
        assert reply["choices"][0]["message"]["content"]
