"""Placement and routing are pure functions of State (and load)."""

from __future__ import annotations

import pytest

from fleet_proto import (
    DownloadPhase,
    DownloadProgressed,
    EngineInfo,
    Instance,
    InstancePlaced,
    InstanceReady,
    NodeInfo,
    NodeJoined,
    RouteRequest,
    State,
    replay,
)
from fleet_proto.routing import route
from fleet_scheduler.placement import PlacementError, place

GiB = 2**30


def node(node_id: str, free_gib: float, engines=("mlx",)) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        hostname=node_id,
        system="Linux",
        machine="x86_64",
        cpu_count=2,
        memory_total_bytes=64 * GiB,
        memory_available_bytes=int(free_gib * GiB),
        disk_total_bytes=1,
        disk_free_bytes=1,
        engines=tuple(EngineInfo(name=e, version="1") for e in engines),
    )


def state_of(*events) -> State:
    return replay(enumerate(events, start=1))


def downloaded(model_id: str, gib: float) -> DownloadProgressed:
    size = int(gib * GiB)
    return DownloadProgressed(model_id=model_id, phase=DownloadPhase.DONE, done_bytes=size, total_bytes=size)


def test_places_on_the_capable_node_with_most_memory_left():
    state = state_of(NodeJoined(node=node("a", 4)), NodeJoined(node=node("b", 8)), downloaded("m", 1))
    assert place(state, "m", "i1").node_id == "b"


def test_skips_nodes_without_the_engine():
    state = state_of(NodeJoined(node=node("a", 4)), NodeJoined(node=node("b", 8, engines=("vllm",))))
    assert place(state, "m", "i1").node_id == "a"


def test_counts_memory_promised_to_instances_still_loading():
    state = state_of(
        NodeJoined(node=node("a", 10)),
        NodeJoined(node=node("b", 8)),
        downloaded("m", 2),
        InstancePlaced(instance=Instance(instance_id="i0", model_id="m", node_id="a", engine="mlx")),
    )
    assert place(state, "m", "i1").node_id == "b"  # a has 10 - 2.6 left


@pytest.mark.parametrize(
    ("events", "reason"),
    [
        ((), "no engine-worker has joined"),
        ((NodeJoined(node=node("a", 8, engines=())),), "no node has the 'mlx' engine"),
        ((NodeJoined(node=node("a", 1)), downloaded("m", 4)), "needs 5.20 GiB"),
    ],
)
def test_refuses_with_a_reason_when_nothing_fits(events, reason):
    with pytest.raises(PlacementError, match=reason):
        place(state_of(*events), "m", "i1")


def ready(instance_id: str, node_id: str, model_id: str = "m"):
    return (
        InstancePlaced(
            instance=Instance(instance_id=instance_id, model_id=model_id, node_id=node_id, engine="mlx")
        ),
        InstanceReady(instance_id=instance_id),
    )


def test_routes_to_the_least_loaded_ready_instance():
    state = state_of(*ready("i1", "a"), *ready("i2", "b"), *ready("i3", "c", model_id="other"))
    request = RouteRequest(request_id="r", model_id="m", prompt_tokens=5)
    assert route(state, request, {"i1": 3, "i2": 1}).worker_id == "b"
    assert route(state, request, {}).instance_id == "i1"  # tie: lowest id


def test_route_without_ready_instance_says_so():
    placed_only = state_of(
        InstancePlaced(instance=Instance(instance_id="i1", model_id="m", node_id="a", engine="mlx"))
    )
    reply = route(placed_only, RouteRequest(request_id="r", model_id="m", prompt_tokens=5), {})
    assert reply.instance_id == ""
    assert reply.error == "no ready instance of m"
