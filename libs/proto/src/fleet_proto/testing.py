"""Builders for tests of Fleet's pure logic (routing, placement, admission): a node with nothing
but its id, and a State replayed from events with such a node joined for every instance whose
node did not join (routing takes only instances whose nodes are in the cluster)."""

from __future__ import annotations

from fleet_proto.apply import replay
from fleet_proto.common import NodeInfo
from fleet_proto.events import Event, NodeJoined
from fleet_proto.state import State


def bare_node(node_id: str) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        hostname=node_id,
        system="Linux",
        machine="x86_64",
        cpu_count=2,
        memory_total_bytes=1,
        memory_available_bytes=1,
        disk_total_bytes=1,
        disk_free_bytes=1,
    )


def state_of(*events: Event) -> State:
    state = replay(enumerate(events, start=1))
    nodes = {i.node_id for i in state.instances.values()} | {
        s.node_id for i in state.instances.values() for s in i.shards
    }
    joined = [NodeJoined(node=bare_node(n)) for n in sorted(nodes - state.nodes.keys())]
    return replay(enumerate(joined, start=len(events) + 1), state)


def then(state: State, *events: Event) -> State:
    """`state` with `events` folded after its last one."""
    return replay(enumerate(events, start=state.last_seq + 1), state)
