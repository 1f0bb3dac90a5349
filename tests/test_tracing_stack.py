"""Request tracing through the real stack (nats-server, weed mini, Redis, the five services, two MLX
workers on a tiny random llama): one chat request gives one trace whose spans come from the
gateway, the scheduler and the worker, linked parent to child, with a root as long as the client
waited (within 5%) and categories that add up to it; a disaggregated request's trace has the KV
transfer span with its bytes and, under it, the prefill worker's own spans; GET/DELETE /v1/traces
work without any external tool."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import aiohttp
import pytest

from fleet_local import stack
from fleet_local.processes import spawn, stop_pid
from tests.support import call, embedded_stack, make_chat_model, until_state, worker_env

MODEL = "tiny/llama-traced"
SHORT = [{"role": "user", "content": "tell me about the sea and the sky"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[stack.StackManifest]:
    root = tmp_path_factory.mktemp("tracing")
    model_dir = make_chat_model(root / "model")
    env = {**os.environ, "FLEET_NODE_ID": "w1", "FLEET_NODE_ENGINES": "mlx", "FLEET_TRACE_SAMPLE_RATE": "1"}
    with embedded_stack(root / "state", env=env) as manifest:
        w2 = spawn(
            [sys.executable, "-m", "fleet_worker"],
            root / "w2.log",
            worker_env(manifest, "w2", root / "w2", node_engines="mlx"),
        )
        try:
            asyncio.run(setup(manifest.gateway_url, model_dir))
            yield manifest
        finally:
            stop_pid(w2.pid)


async def setup(gateway: str, model_dir: Path) -> None:
    async with aiohttp.ClientSession() as session:
        await call(session, "POST", f"{gateway}/models", {"model": MODEL, "source": f"file://{model_dir}"})
        state = await until_state(
            session, gateway, lambda s: MODEL in s["models"] and len(s["nodes"]) == 2, 60
        )
        layers = state["models"][MODEL]["num_layers"]
        ids = []
        for node, role in (("w1", "both"), ("w2", "prefill")):
            body = {
                "model": MODEL,
                "shards": [{"node_id": node, "start_layer": 0, "end_layer": layers}],
                "role": role,
            }
            ids.append((await call(session, "POST", f"{gateway}/instances", body))["instance_id"])
        await until_state(
            session, gateway, lambda s: all(s["instances"][i]["status"] == "ready" for i in ids), 120
        )


# what a client's measured wait adds to the gateway's root span: connecting, sending, parsing (a
# loaded 2-core machine: up to ~10 ms)
CLIENT_SIDE_S = 0.03


async def whole_trace(
    session: aiohttp.ClientSession, gateway: str, request_id: str, needs: frozenset[str] = frozenset()
) -> tuple[dict, dict]:
    """The request's trace once every service's spans are in (and the spans named in `needs`: a
    prefill worker's come in its own batch), and its stats."""
    deadline = time.monotonic() + 10
    while True:  # spans reach the store within a publish interval or two
        async with session.get(f"{gateway}/v1/traces/{request_id}") as response:
            trace = await response.json()
        services = {s["service"] for s in trace.get("spans", ())}
        names = {s["name"] for s in trace.get("spans", ())}
        if {"gateway", "scheduler", "engine-worker"} <= services and {"worker task", *needs} <= names:
            break
        assert time.monotonic() < deadline, f"trace incomplete: {trace}"
        await asyncio.sleep(0.2)
    async with session.get(f"{gateway}/v1/traces/{request_id}/stats") as response:
        return trace, await response.json()


async def traced_request(
    gateway: str, needs: frozenset[str] = frozenset(), **options
) -> tuple[dict, float, dict, dict]:
    """A chat completion, how long the client waited (s), its trace's spans and stats."""
    body = {"model": MODEL, "messages": SHORT, "max_tokens": 32, "temperature": 0, **options}
    async with aiohttp.ClientSession() as session:
        started = time.perf_counter()
        reply = await call(session, "POST", f"{gateway}/bench/chat/completions", body)
        waited = time.perf_counter() - started
        trace, stats = await whole_trace(session, gateway, reply["id"], needs)
    return reply, waited, trace, stats


async def streamed_request(gateway: str) -> tuple[str, dict, dict]:
    """A streamed chat completion of 48 tokens; its id, its trace and the trace's stats."""
    body = {"model": MODEL, "messages": SHORT, "max_tokens": 48, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as session:
        ids = set()
        async with session.post(f"{gateway}/v1/chat/completions", json=body) as response:
            assert response.status == 200
            async for line in response.content:
                if line.startswith(b"data: {"):
                    ids.add(json.loads(line[6:])["id"])
        (request_id,) = ids
        trace, stats = await whole_trace(session, gateway, request_id)
    return request_id, trace, stats


def test_one_request_gives_one_linked_trace_that_adds_up(cluster: stack.StackManifest) -> None:
    reply, waited, trace, stats = asyncio.run(traced_request(cluster.gateway_url, disaggregated=False))
    spans = trace["spans"]
    assert {s["trace_id"] for s in spans} == {trace["trace_id"]}
    by_id = {s["span_id"]: s for s in spans}
    (root,) = [s for s in spans if not s["parent_id"]]
    assert root["service"] == "gateway" and root["category"] == "http"
    assert root["attributes"]["fleet.request_id"] == reply["id"]
    assert all(s["parent_id"] in by_id for s in spans if s is not root)  # no orphan
    names = {s["name"]: s for s in spans}
    parent = lambda span: by_id[span["parent_id"]]  # noqa: E731
    assert parent(names["route"]) is root and parent(names["generate"]) is root
    assert parent(names["route decision"])["name"] == "route"  # the scheduler's, under the gateway's
    assert (
        names["route decision"]["service"] == "scheduler"
        and names["route decision"]["attributes"]["fleet.reason"]
    )
    assert (
        parent(names["worker task"]) is names["generate"] and parent(names["decode"]) is names["worker task"]
    )
    for span in spans:
        assert span["end_ns"] >= span["start_ns"]
    # the root is the request as the client saw it, and the categories add up to the root
    root_s = (root["end_ns"] - root["start_ns"]) / 1e9
    # inside the client's wait, which adds only the connection and the HTTP exchange around it
    assert root_s <= waited <= 1.05 * root_s + CLIENT_SIDE_S
    assert stats["duration_ns"] == root["end_ns"] - root["start_ns"]
    total = sum(c["self_ns"] for c in stats["categories"])
    assert abs(total - stats["duration_ns"]) <= 0.05 * stats["duration_ns"]
    assert {"http", "route", "stream", "prefill", "decode"} <= {c["category"] for c in stats["categories"]}


def test_a_streamed_request_shows_its_gateway_and_engine_steps(cluster: stack.StackManifest) -> None:
    """Tokenize, the first (sampled) detokenize and stream write, and the engine's decode steps (one
    span per window of outputs, back to back) under decode; the gateway's per-output work runs
    alongside the worker's decode, so the categories may exceed the root by that (small) overlap."""
    request_id, trace, stats = asyncio.run(streamed_request(cluster.gateway_url))
    spans = trace["spans"]
    by_id = {s["span_id"]: s for s in spans}
    (root,) = [s for s in spans if not s["parent_id"]]
    assert root["attributes"]["fleet.request_id"] == request_id
    named = lambda name: [s for s in spans if s["name"] == name]  # noqa: E731
    (tokenize,) = named("tokenize")
    assert tokenize["parent_id"] == root["span_id"] and tokenize["attributes"]["fleet.prompt_tokens"] > 0
    (route,) = named("route")
    assert tokenize["end_ns"] <= route["start_ns"]
    for name in ("detokenize", "stream write"):
        assert named(name) and all(s["parent_id"] == root["span_id"] for s in named(name))
    (decode,) = named("decode")
    steps = named("decode steps")
    assert steps and all(by_id[s["parent_id"]] is decode for s in steps)
    assert all(decode["start_ns"] <= s["start_ns"] <= s["end_ns"] <= decode["end_ns"] for s in steps)
    assert all(b["start_ns"] == a["end_ns"] for a, b in pairwise(steps))
    # every output after the first token's is in a window (a short stream: under MAX_STEP_SPANS)
    assert sum(s["attributes"]["fleet.tokens"] for s in steps) < decode["attributes"]["fleet.tokens"]
    # the categories add up to the root, plus at most the gateway's per-output work (it overlaps
    # the worker's decode, so it is counted twice; a loaded machine makes it longer)
    overlap = sum(s["end_ns"] - s["start_ns"] for s in named("detokenize") + named("stream write"))
    total = sum(c["self_ns"] for c in stats["categories"])
    slack = 0.05 * stats["duration_ns"]
    assert -slack <= total - stats["duration_ns"] <= slack + overlap


def test_a_disaggregated_request_shows_its_transfer_and_the_prefill_workers_spans(
    cluster: stack.StackManifest,
) -> None:
    """The decoder's kv transfer (bytes), and under it the prefill worker's remote prefill and its
    kv send: one trace across both workers, with no time counted twice."""
    needs = frozenset({"remote prefill", "kv send (stream)"})
    reply, _, trace, stats = asyncio.run(
        traced_request(cluster.gateway_url, needs, disaggregated=True, transport="stream")
    )
    handoff = reply["generation_stats"]["handoff"]
    spans = trace["spans"]
    by_name = {s["name"]: s for s in spans}
    (transfer,) = [s for s in spans if s["name"] == "kv transfer"]
    assert transfer["category"] == "transfer"
    assert transfer["attributes"]["fleet.bytes"] == handoff["bytes"] > 0
    assert transfer["attributes"]["fleet.prefill_worker_id"] == "w2"
    remote, send = by_name["remote prefill"], by_name["kv send (stream)"]
    assert remote["service"] == "engine-worker" and remote["service_id"] != transfer["service_id"]
    assert remote["parent_id"] == transfer["span_id"] and send["parent_id"] == remote["span_id"]
    assert remote["attributes"]["fleet.transport"] == "stream" and not remote["error"]
    assert send["attributes"]["fleet.bytes"] == handoff["bytes"]  # what w2 sent is what w1 got
    total = sum(c["self_ns"] for c in stats["categories"])
    assert abs(total - stats["duration_ns"]) <= 0.05 * stats["duration_ns"]


def test_traces_are_listed_and_deleted(cluster: stack.StackManifest) -> None:
    async def run() -> tuple[list, int, int, int]:
        async with aiohttp.ClientSession() as session:
            listed = (await call(session, "GET", f"{cluster.gateway_url}/v1/traces?limit=5"))["data"]
            async with session.get(f"{cluster.gateway_url}/v1/traces?limit=0") as bad:
                bad_status = bad.status
            async with session.delete(f"{cluster.gateway_url}/v1/traces") as deleted:
                count = (await deleted.json())["deleted"]
            async with session.get(f"{cluster.gateway_url}/v1/traces/{listed[0]['trace_id']}") as gone:
                return listed, bad_status, count, gone.status

    listed, bad_status, count, gone_status = asyncio.run(run())
    assert listed and listed[0]["request_id"] and count >= 1
    assert (bad_status, gone_status) == (400, 404)
