"""The one placement path (placer.py): what commands decide, and how every change is published."""

from __future__ import annotations

import msgspec
import pytest

from fleet_proto import (
    CreateInstance,
    DeleteInstance,
    Instance,
    InstanceDeleted,
    InstanceFailed,
    InstancePlaced,
    InstanceStatus,
    InstanceStatusChanged,
    NodeLeft,
    decode_event,
    encode,
)
from fleet_proto.events import EventBase
from fleet_scheduler.engine_choice import moved_to_engine
from fleet_scheduler.liveness import failover_events
from fleet_scheduler.placement import placed_again
from fleet_scheduler.placer import Placer, created, deletion
from fleet_scheduler.replacement import replacement

from .test_placement_rules import card, cluster, node

pytestmark = pytest.mark.unit

STATE = cluster(node("a", 8.0), node("b", 4.0), cards=(card(),))


class Recorder:
    """Stands in for the bus: what was published, in order, as it would travel."""

    def __init__(self) -> None:
        self.events: list[EventBase] = []

    async def __call__(self, event: EventBase) -> int:
        self.events.append(decode_event(encode(event)))
        return len(self.events)


def recording(origin: str = "scheduler-1", clock: float = 123.5) -> tuple[Placer, Recorder]:
    recorder = Recorder()
    return Placer(recorder, origin, clock=lambda: clock), recorder


def unstamped(event: EventBase) -> EventBase:
    return msgspec.structs.replace(event, origin="", at=0.0)


# --- commands ------------------------------------------------------------------------------------


def test_a_create_command_places_its_instance_with_its_role_and_pinned_engine() -> None:
    command = CreateInstance(command_id="c1", model_id="org/m", instance_id="i1", engine="mlx", role="decode")
    instance = created(STATE, command)
    assert instance is not None
    assert (instance.node_id, instance.engine, instance.role, instance.engine_pinned) == (
        "a",
        "mlx",
        "decode",
        True,
    )
    assert instance.status == InstanceStatus.PLACED
    unpinned = created(STATE, CreateInstance(command_id="c1", model_id="org/m", instance_id="i1"))
    assert unpinned is not None and not unpinned.engine_pinned


def test_a_create_command_nothing_fits_gives_a_failed_instance_saying_why() -> None:
    instance = created(
        STATE, CreateInstance(command_id="c1", model_id="org/unknown", instance_id="i1", engine="vllm")
    )
    assert instance == Instance(
        instance_id="i1",
        model_id="org/unknown",
        node_id="",
        engine="vllm",
        status=InstanceStatus.FAILED,
        reason="model org/unknown is not staged",
    )


def test_a_redelivered_create_command_places_nothing() -> None:
    placed = Instance(instance_id="i1", model_id="org/m", node_id="a", engine="mlx")
    state = cluster(node("a", 8.0), cards=(card(),), instances=(placed,))
    assert created(state, CreateInstance(command_id="c1", model_id="org/m", instance_id="i1")) is None


def test_a_delete_command_deletes_what_nothing_runs_and_drains_the_rest() -> None:
    running = Instance(instance_id="run", model_id="org/m", node_id="a", engine="mlx")
    failed = msgspec.structs.replace(running, instance_id="failed", status=InstanceStatus.FAILED)
    orphan = msgspec.structs.replace(running, instance_id="orphan", node_id="gone")
    state = cluster(node("a", 8.0), cards=(card(),), instances=(running, failed, orphan))
    assert deletion(state, DeleteInstance(command_id="c1", instance_id="run")) == InstanceStatusChanged(
        instance_id="run", status=InstanceStatus.DRAINING
    )
    assert deletion(state, DeleteInstance(command_id="c1", instance_id="failed")) == InstanceDeleted(
        instance_id="failed"
    )
    assert deletion(state, DeleteInstance(command_id="c1", instance_id="orphan")) == InstanceDeleted(
        instance_id="orphan"
    )
    assert deletion(state, DeleteInstance(command_id="c1", instance_id="unknown")) is None


# --- the one path --------------------------------------------------------------------------------


async def test_every_event_is_stamped_with_the_scheduler_and_the_time_and_kept_in_order() -> None:
    placer, bus = recording()
    events = (
        NodeLeft(node_id="a", reason="missed heartbeats for 5 s"),
        InstanceFailed(instance_id="i1", reason="node a: missed heartbeats for 5 s", generation=0),
        InstanceDeleted(instance_id="i2"),
    )
    await placer.publish(*events)
    assert [unstamped(e) for e in bus.events] == list(events)
    assert {(e.origin, e.at) for e in bus.events} == {("scheduler-1", 123.5)}


async def test_a_placed_instance_leaves_as_instance_placed() -> None:
    placer, bus = recording()
    instance = created(STATE, CreateInstance(command_id="c1", model_id="org/m", instance_id="i1"))
    assert instance is not None
    await placer.place(instance)
    assert bus.events == [InstancePlaced(instance=instance, origin="scheduler-1", at=123.5)]


async def test_each_reactors_decision_leaves_through_the_placer_unchanged() -> None:
    """Failover, a failed pipeline placed again and an engine move: the events the pure decisions
    give, each with only the scheduler's id and the time added."""
    on_a = Instance(
        instance_id="i1", model_id="org/m", node_id="a", engine="mlx", status=InstanceStatus.READY
    )
    on_b = msgspec.structs.replace(on_a, instance_id="i2", node_id="b")
    state = cluster(
        node("a", 8.0, engines=("mlx", "vllm")), node("b", 8.0), cards=(card(),), instances=(on_a, on_b)
    )
    decisions = [
        failover_events(state, "b", "missed heartbeats for 5 s", placed_again),
        [replacement(state, on_b, placed_again, (), 0.0)],
        [InstancePlaced(instance=moved_to_engine(state, on_a, "vllm"))],
    ]
    for events in decisions:
        placer, bus = recording()
        await placer.publish(*events)
        assert [unstamped(e) for e in bus.events] == events
        assert all((e.origin, e.at) == ("scheduler-1", 123.5) for e in bus.events)
    assert [type(e) for e in decisions[0]] == [NodeLeft, InstanceFailed, InstancePlaced]
