"""Which instance serves a request: a pure function of State and load (KV-aware routing is issue 8).

The scheduler decides with it; the gateway uses it too when the scheduler does not answer.

cost(instance) = active requests it reported + requests routed to it since that report; the lowest
cost wins, ties broken by instance id so the choice is deterministic.
"""

from __future__ import annotations

from collections.abc import Mapping

from fleet_proto import InstanceStatus, RouteReply, RouteRequest, State


def ready_instances(state: State, model_id: str) -> list[str]:
    return sorted(
        i.instance_id
        for i in state.instances.values()
        if i.model_id == model_id and i.status == InstanceStatus.READY
    )


def route(state: State, request: RouteRequest, load: Mapping[str, int]) -> RouteReply:
    candidates = ready_instances(state, request.model_id)
    if not candidates:
        return RouteReply(error=f"no ready instance of {request.model_id}")
    instance_id = min(candidates, key=lambda i: (load.get(i, 0), i))
    instance = state.instances[instance_id]
    reason = f"least loaded of {len(candidates)} ready ({load.get(instance_id, 0)} active)"
    return RouteReply(instance_id=instance_id, worker_id=instance.node_id, reason=reason)
