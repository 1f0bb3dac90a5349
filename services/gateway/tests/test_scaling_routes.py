"""The autoscaling admin API (fleet_gateway.scaling_routes) over HTTP: a PUT names what it changes and
sends SetScaling; bad policies, unknown fields and unstaged models are 4xx with nothing sent; GET shows
the policy and decisions the State holds; a model scaled to zero is listed and resolves.
FakeBus stands in for NATS: it records the commands published."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fleet_gateway.aliases import servable_models, serving_model
from fleet_gateway.errors import error_middleware
from fleet_gateway.scaling_routes import scaling_routes
from fleet_proto import (
    ModelCard,
    ModelStaged,
    ScalingDecided,
    ScalingDecision,
    ScalingPolicy,
    ScalingPolicySet,
    SetScaling,
)
from fleet_proto.routing_view import RoutingView
from fleet_proto.testing import state_of

pytestmark = pytest.mark.unit

MODEL = "org/small"
CARD = ModelCard(
    model_id=MODEL, architecture="llama", num_layers=1, hidden_size=8, num_kv_heads=1, head_dim=8,
    dtype="float32", storage_bytes=1,
)  # fmt: skip


class FakeBus:
    def __init__(self) -> None:
        self.commands: list[object] = []

    async def publish_command(self, command: object) -> None:
        self.commands.append(command)


async def client_for(state, bus: FakeBus) -> TestClient:
    app = web.Application(middlewares=[error_middleware])
    app.add_routes(scaling_routes(bus, SimpleNamespace(state=state)))  # type: ignore[arg-type]
    return TestClient(TestServer(app))


async def test_a_put_sends_the_current_policy_with_its_changes_enabled():
    decided = ScalingDecision(kind="hold", reason="at max_instances", at=5.0)
    current = ScalingPolicy(enabled=False, min_instances=1, max_instances=3, idle_s=60)
    state = state_of(
        ModelStaged(card=CARD),
        ScalingPolicySet(model_id=MODEL, policy=current),
        ScalingDecided(model_id=MODEL, decision=decided),
    )
    bus = FakeBus()
    async with await client_for(state, bus) as client:
        reply = await client.put(f"/scaling/{MODEL}", json={"min_instances": 0})
        assert reply.status == 202
        body = await reply.json()
        shown = await (await client.get(f"/scaling/{MODEL}")).json()
        everything = await (await client.get("/scaling")).json()
    [command] = bus.commands
    assert isinstance(command, SetScaling) and command.model_id == MODEL
    assert command.policy == ScalingPolicy(enabled=True, min_instances=0, max_instances=3, idle_s=60)
    assert body["policy"]["min_instances"] == 0 and body["model"] == MODEL
    assert shown["decisions"] == [
        {"kind": "hold", "reason": "at max_instances", "instance_id": "", "at": 5.0}
    ]
    assert set(everything) == {MODEL}


@pytest.mark.parametrize(
    ("model", "body", "status", "says"),
    [
        (MODEL, {"min_instances": 3, "max_instances": 2}, 400, "min_instances 3 is over max_instances 2"),
        (MODEL, {"target_utilization": 1.5}, 400, "target_utilization"),
        (MODEL, {"max_replicas": 2}, 400, "max_replicas"),
        (MODEL, {"min_instances": "two"}, 400, "min_instances"),
        ("org/unstaged", {"min_instances": 0}, 404, "is not staged"),
    ],
)
async def test_a_bad_put_is_a_4xx_and_sends_nothing(model: str, body: dict, status: int, says: str):
    bus = FakeBus()
    async with await client_for(state_of(ModelStaged(card=CARD)), bus) as client:
        reply = await client.put(f"/scaling/{model}", json=body)
        assert reply.status == status
        assert says in (await reply.json())["error"]["message"]
    assert bus.commands == []


async def test_delete_disables_the_policy():
    bus = FakeBus()
    policy = ScalingPolicy(enabled=True, min_instances=0, max_instances=2)
    state = state_of(ModelStaged(card=CARD), ScalingPolicySet(model_id=MODEL, policy=policy))
    async with await client_for(state, bus) as client:
        assert (await client.delete(f"/scaling/{MODEL}")).status == 202
    [command] = bus.commands
    assert command.policy == ScalingPolicy(enabled=False, min_instances=0, max_instances=2)


def test_a_model_scaled_to_zero_is_listed_and_resolves_to_itself():
    policy = ScalingPolicy(enabled=True, min_instances=0, max_instances=2)
    staged = state_of(ModelStaged(card=CARD))
    on_demand = state_of(ModelStaged(card=CARD), ScalingPolicySet(model_id=MODEL, policy=policy))
    assert servable_models(staged) == [] and serving_model(RoutingView(staged), MODEL) is None
    assert servable_models(on_demand) == [MODEL] and serving_model(RoutingView(on_demand), MODEL) == MODEL
