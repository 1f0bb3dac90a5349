"""Routing is a pure function of State and load (placement rules: test_placement_rules.py)."""

from __future__ import annotations

import pytest

from fleet_proto import (
    Instance,
    InstancePlaced,
    InstanceReady,
    RouteRequest,
)
from fleet_proto.routing import route
from fleet_proto.testing import state_of

pytestmark = pytest.mark.unit


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
