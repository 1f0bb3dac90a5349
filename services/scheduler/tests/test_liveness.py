from __future__ import annotations

import msgspec
import pytest

from fleet_proto import (
    EngineInfo,
    Instance,
    InstanceFailed,
    InstancePlaced,
    InstanceReady,
    NodeInfo,
    NodeJoined,
    NodeLeft,
    Shard,
    replay,
)
from fleet_scheduler.liveness import failover_events, timed_out_nodes

pytestmark = pytest.mark.unit


def node(node_id: str) -> NodeJoined:
    return NodeJoined(
        node=NodeInfo(
            node_id=node_id, hostname=node_id, system="Linux", machine="x86_64", cpu_count=2,
            memory_total_bytes=8, memory_available_bytes=8, disk_total_bytes=1, disk_free_bytes=1,
            engines=(EngineInfo(name="mlx", version="1"),),
        )
    )  # fmt: skip


def placed(instance_id: str, node_id: str) -> InstancePlaced:
    return InstancePlaced(
        instance=Instance(instance_id=instance_id, model_id="m", node_id=node_id, engine="mlx")
    )


STATE = replay(
    enumerate(
        [
            node("a"),
            node("b"),
            placed("i1", "a"),
            InstanceReady(instance_id="i1"),
            placed("i2", "a"),
            placed("i3", "b"),
        ],
        start=1,
    )
)


def test_nodes_silent_past_the_timeout_are_timed_out():
    assert timed_out_nodes(STATE, {"a": 100.0, "b": 104.0}, now=105.0, timeout_s=5.0) == ["a"]
    assert timed_out_nodes(STATE, {}, now=105.0, timeout_s=5.0) == []  # never heard: not yet counted


def test_failover_fails_the_nodes_instances_and_places_them_elsewhere():
    def to_b(state, instance):
        assert "a" not in state.nodes
        return Instance(
            instance_id=instance.instance_id, model_id=instance.model_id, node_id="b", engine="mlx"
        )

    events = failover_events(STATE, "a", "missed heartbeats for 5 s", to_b)
    assert events[0] == NodeLeft(node_id="a", reason="missed heartbeats for 5 s")
    assert [type(e) for e in events[1:]] == [InstanceFailed, InstancePlaced, InstanceFailed, InstancePlaced]
    assert {e.instance.node_id for e in events if isinstance(e, InstancePlaced)} == {"b"}


def test_failover_without_room_leaves_instances_failed():
    def nowhere(state, instance):
        raise ValueError("nothing fits")

    events = failover_events(STATE, "a", "gone", nowhere)
    assert [type(e) for e in events] == [NodeLeft, InstanceFailed, InstanceFailed]
    final = replay(enumerate(events, start=STATE.last_seq + 1), STATE)
    assert final.instances["i1"].status == "failed" and "gone" in final.instances["i1"].reason
    assert "a" not in final.nodes


@pytest.mark.parametrize("status_event", [InstanceFailed(instance_id="i3", reason="x")])
def test_failed_instances_are_not_failed_again(status_event):
    state = replay([(STATE.last_seq + 1, status_event)], STATE)
    events = failover_events(state, "b", "gone", lambda s, i: i)
    assert events == [NodeLeft(node_id="b", reason="gone")]


def test_a_draining_instance_on_a_dead_node_is_simply_deleted():
    from fleet_proto import InstanceDeleted, InstanceStatusChanged

    draining = replay(
        [(STATE.last_seq + 1, InstanceStatusChanged(instance_id="i3", status="draining"))], STATE
    )
    events = failover_events(draining, "b", "gone", lambda s, i: i)
    assert events == [NodeLeft(node_id="b", reason="gone"), InstanceDeleted(instance_id="i3")]


def test_a_pipeline_fails_over_when_any_node_holding_a_shard_is_lost():
    shards = (Shard(node_id="a", start_layer=0, end_layer=1), Shard(node_id="b", start_layer=1, end_layer=2))
    pipeline = Instance(
        instance_id="p1", model_id="m", node_id="a", engine="mlx", shards=shards, generation=2
    )
    state = replay([(STATE.last_seq + 1, InstancePlaced(instance=pipeline))], STATE)
    moved = msgspec.structs.replace(pipeline, generation=3)
    events = failover_events(state, "b", "gone", lambda s, i: moved if i.instance_id == "p1" else i)
    assert InstanceFailed(instance_id="p1", reason="node b: gone", generation=2) in events
    assert InstancePlaced(instance=moved) in events
    assert pipeline.runs_on("b") and pipeline.runs_on("a") and not pipeline.runs_on("c")
