"""Worker liveness: which nodes missed their heartbeats, and the events that fail them over (pure).

Workers publish metrics every second; a node silent for `timeout_s` is declared gone: NodeLeft, then
each live instance with a shard on it fails and, where placement finds room elsewhere, is placed again
under the same instance id as its next generation (so clients keep addressing it by model; the id
stays in /state).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import msgspec

from fleet_proto import (
    Instance,
    InstanceDeleted,
    InstanceFailed,
    InstancePlaced,
    InstanceStatus,
    NodeLeft,
    State,
)
from fleet_proto.events import EventBase


def timed_out_nodes(state: State, last_seen: Mapping[str, float], now: float, timeout_s: float) -> list[str]:
    """Nodes in State not heard from for timeout_s (a node never heard from counts from `last_seen` too)."""
    return sorted(n for n in state.nodes if now - last_seen.get(n, now) >= timeout_s)


def failover_events(
    state: State,
    node_id: str,
    reason: str,
    replace: Callable[[State, Instance], Instance],
) -> list[EventBase]:
    """NodeLeft, then per live instance on the node: InstanceFailed and, if `replace` finds room,
    InstancePlaced there. `replace` raises (PlacementError) when nothing fits."""
    events: list[EventBase] = [NodeLeft(node_id=node_id, reason=reason)]
    remaining = msgspec.structs.replace(state, nodes={k: v for k, v in state.nodes.items() if k != node_id})
    for instance in sorted(state.instances.values(), key=lambda i: i.instance_id):
        if not instance.runs_on(node_id) or instance.status == InstanceStatus.FAILED:
            continue
        if instance.status == InstanceStatus.DRAINING:  # it was being deleted anyway
            events.append(InstanceDeleted(instance_id=instance.instance_id))
            continue
        events.append(
            InstanceFailed(
                instance_id=instance.instance_id,
                reason=f"node {node_id}: {reason}",
                generation=instance.generation,
            )
        )
        try:
            moved = replace(remaining, instance)
        except ValueError:
            continue
        events.append(InstancePlaced(instance=moved))
        # what the moved instance takes counts for the next one placed
        remaining = msgspec.structs.replace(
            remaining, instances={**remaining.instances, moved.instance_id: moved}
        )
    return events
