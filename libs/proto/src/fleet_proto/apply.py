"""The pure reducer: apply(state, event, seq) -> state.

Dispatches with `match` to one small function per event kind. It never mutates its input
(dicts are copied on write), does no I/O, and checks that stream sequences only increase, so
folding the same ordered events always yields the same State.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

import msgspec

from fleet_proto.common import DownloadStatus, InstanceStatus
from fleet_proto.events import (
    DownloadProgressed,
    Event,
    InstanceDeleted,
    InstanceFailed,
    InstanceLoading,
    InstancePlaced,
    InstanceReady,
    InstanceStatusChanged,
    ModelDeleted,
    ModelStaged,
    NodeJoined,
    NodeLeft,
    ScalingDecided,
    ScalingPolicySet,
    ServiceStarted,
    ServiceStopped,
)
from fleet_proto.scaling import KEPT_DECISIONS, ModelScaling
from fleet_proto.state import State

V = TypeVar("V")


class EventOrderError(ValueError):
    """An event arrived with a sequence number not after the last one applied."""


class UnknownEventError(TypeError):
    """Something that is not one of the event kinds this version knows was given to apply()."""


def _with(mapping: dict[str, V], key: str, value: V) -> dict[str, V]:
    return {**mapping, key: value}


def _without(mapping: dict[str, V], key: str) -> dict[str, V]:
    return {k: v for k, v in mapping.items() if k != key}


def _apply_service_started(state: State, event: ServiceStarted) -> State:
    service = event.service
    return msgspec.structs.replace(state, services=_with(state.services, service.service_id, service))


def _apply_service_stopped(state: State, event: ServiceStopped) -> State:
    return msgspec.structs.replace(state, services=_without(state.services, event.service_id))


def _apply_node_joined(state: State, event: NodeJoined) -> State:
    return msgspec.structs.replace(state, nodes=_with(state.nodes, event.node.node_id, event.node))


def _apply_node_left(state: State, event: NodeLeft) -> State:
    return msgspec.structs.replace(state, nodes=_without(state.nodes, event.node_id))


def _apply_instance_placed(state: State, event: InstancePlaced) -> State:
    instance = event.instance
    return msgspec.structs.replace(state, instances=_with(state.instances, instance.instance_id, instance))


def _update_instance(state: State, instance_id: str, **changes: object) -> State:
    instance = state.instances.get(instance_id)
    if instance is None:  # an update for an instance already deleted: nothing to change
        return state
    updated = msgspec.structs.replace(instance, **changes)
    return msgspec.structs.replace(state, instances=_with(state.instances, instance_id, updated))


def _apply_instance_failed(state: State, event: InstanceFailed) -> State:
    instance = state.instances.get(event.instance_id)
    if instance is None:
        return state
    if event.generation >= 0 and event.generation != instance.generation:
        return state  # about a placement replaced since (a late report from one of its ranks)
    # The first report names the cause (a pipeline's other ranks fail after it, for the same reason);
    # a later one replaces it only when it extends it (the scheduler adding why it did not re-place).
    first = instance.status == InstanceStatus.FAILED and not event.reason.startswith(instance.reason)
    reason = instance.reason if first else event.reason
    return _update_instance(state, event.instance_id, status=InstanceStatus.FAILED, reason=reason)


def _apply_instance_deleted(state: State, event: InstanceDeleted) -> State:
    return msgspec.structs.replace(state, instances=_without(state.instances, event.instance_id))


def _apply_download_progressed(state: State, event: DownloadProgressed) -> State:
    status = DownloadStatus(
        model_id=event.model_id,
        phase=event.phase,
        done_bytes=event.done_bytes,
        total_bytes=event.total_bytes,
        reason=event.reason,
        bytes_per_s=event.bytes_per_s,
        eta_s=event.eta_s,
    )
    return msgspec.structs.replace(state, downloads=_with(state.downloads, event.model_id, status))


def _apply_model_staged(state: State, event: ModelStaged) -> State:
    return msgspec.structs.replace(state, models=_with(state.models, event.card.model_id, event.card))


def _apply_model_deleted(state: State, event: ModelDeleted) -> State:
    return msgspec.structs.replace(
        state,
        models=_without(state.models, event.model_id),
        downloads=_without(state.downloads, event.model_id),
        scaling=_without(state.scaling, event.model_id),  # nothing left to place
    )


def _apply_scaling_policy_set(state: State, event: ScalingPolicySet) -> State:
    past = state.scaling.get(event.model_id, ModelScaling())
    scaling = msgspec.structs.replace(past, policy=event.policy)
    return msgspec.structs.replace(state, scaling=_with(state.scaling, event.model_id, scaling))


def _apply_scaling_decided(state: State, event: ScalingDecided) -> State:
    past = state.scaling.get(event.model_id, ModelScaling())
    decisions = (*past.decisions, event.decision)[-KEPT_DECISIONS:]
    scaling = msgspec.structs.replace(past, decisions=decisions)
    return msgspec.structs.replace(state, scaling=_with(state.scaling, event.model_id, scaling))


def _dispatch(state: State, event: Event) -> State:
    match event:
        case ServiceStarted():
            return _apply_service_started(state, event)
        case ServiceStopped():
            return _apply_service_stopped(state, event)
        case NodeJoined():
            return _apply_node_joined(state, event)
        case NodeLeft():
            return _apply_node_left(state, event)
        case InstancePlaced():
            return _apply_instance_placed(state, event)
        case InstanceLoading():
            return _update_instance(
                state, event.instance_id, status=InstanceStatus.LOADING, progress=event.progress
            )
        case InstanceReady():
            # a ready instance has no failure to show (an engine restarted after a crash)
            return _update_instance(
                state, event.instance_id, status=InstanceStatus.READY, progress=1.0, reason=""
            )
        case InstanceFailed():
            return _apply_instance_failed(state, event)
        case InstanceDeleted():
            return _apply_instance_deleted(state, event)
        case DownloadProgressed():
            return _apply_download_progressed(state, event)
        case ModelStaged():
            return _apply_model_staged(state, event)
        case ModelDeleted():
            return _apply_model_deleted(state, event)
        case ScalingPolicySet():
            return _apply_scaling_policy_set(state, event)
        case ScalingDecided():
            return _apply_scaling_decided(state, event)
        case InstanceStatusChanged():
            try:
                status = InstanceStatus(event.status)
            except ValueError:
                return state  # a status this version does not know: leave the instance as it is
            return _update_instance(state, event.instance_id, status=status, progress=event.progress)
        case _:
            raise UnknownEventError(f"apply() does not know event {type(event).__name__!r}")


def apply(state: State, event: Event, seq: int) -> State:
    """Fold one event, found at stream sequence `seq`, into `state`."""
    if seq <= state.last_seq:
        raise EventOrderError(f"event seq {seq} is not after the last applied seq {state.last_seq}")
    return msgspec.structs.replace(_dispatch(state, event), last_seq=seq)


def replay(events: Iterable[tuple[int, Event]], state: State | None = None) -> State:
    """Fold (seq, event) pairs in order, starting from `state` (or an empty State)."""
    current = State() if state is None else state
    for seq, event in events:
        current = apply(current, event, seq)
    return current
