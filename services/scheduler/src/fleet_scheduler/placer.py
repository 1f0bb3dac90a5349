"""The scheduler's one path for changing where instances run.

Every event that changes a placement leaves through `Placer.publish`: InstancePlaced, and the
InstanceFailed, InstanceDeleted, InstanceStatusChanged and NodeLeft that go with a decision. That
holds whether a command asked for the change (create, delete) or one of the leader's reactors
decided it (a node timed out, a pipeline failed, an engine measured faster). The decisions stay
pure functions: placement.py, liveness.py, replacement.py, engine_choice.py and the two below. The
Placer stamps each event with the scheduler's id and the time, and publishes the events in order.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import msgspec

from fleet_proto import (
    CreateInstance,
    DeleteInstance,
    Instance,
    InstanceDeleted,
    InstancePlaced,
    InstanceStatus,
    InstanceStatusChanged,
    State,
)
from fleet_proto.events import EventBase
from fleet_scheduler.placement import PlacementError, place

Publish = Callable[[EventBase], Awaitable[object]]


def created(state: State, command: CreateInstance) -> Instance | None:
    """The instance a CreateInstance places: where placement puts it, or failed with placement's
    reason when nothing fits; None when a redelivered command placed it already."""
    if command.instance_id in state.instances:
        return None
    try:
        instance = place(
            state, command.model_id, command.instance_id, command.engine, shards=command.shards or None
        )
        return msgspec.structs.replace(instance, role=command.role, engine_pinned=bool(command.engine))
    except PlacementError as exc:
        return Instance(
            instance_id=command.instance_id,
            model_id=command.model_id,
            node_id="",
            engine=command.engine,
            role=command.role,
            status=InstanceStatus.FAILED,
            reason=str(exc),
        )


def deletion(state: State, command: DeleteInstance) -> InstanceDeleted | InstanceStatusChanged | None:
    """What a DeleteInstance changes: a failed instance, or one whose node is gone, is deleted at once
    (nothing runs it); any other drains (its worker stops routing to it, lets its requests finish,
    unloads and reports it deleted). None when there is no such instance."""
    instance = state.instances.get(command.instance_id)
    if instance is None:
        return None
    if instance.status == InstanceStatus.FAILED or instance.node_id not in state.nodes:
        return InstanceDeleted(instance_id=instance.instance_id)
    return InstanceStatusChanged(instance_id=instance.instance_id, status=InstanceStatus.DRAINING)


class Placer:
    """Publishes placement changes, the only code in the scheduler that does."""

    def __init__(self, publish: Publish, origin: str, clock: Callable[[], float] = time.time) -> None:
        self._publish = publish
        self._origin = origin
        self._clock = clock

    async def publish(self, *events: EventBase) -> None:
        """Each event stamped with this scheduler's id and the time it leaves, in order."""
        for event in events:
            await self._publish(msgspec.structs.replace(event, origin=self._origin, at=self._clock()))

    async def place(self, instance: Instance) -> None:
        """`instance` placed (or failed to place, when its status says so)."""
        await self.publish(InstancePlaced(instance=instance))
