"""Events: facts that happened, appended to the FLEET_EVT stream and folded into State by apply()."""

from __future__ import annotations

from typing import dataclass_transform

import msgspec

from fleet_proto.common import DownloadPhase, Instance, ModelCard, NodeInfo, ServiceInfo
from fleet_proto.scaling import ScalingDecision, ScalingPolicy


# Subclasses inherit `frozen` (see fleet_proto.common.Frozen).
@dataclass_transform(frozen_default=True, field_specifiers=(msgspec.field,))
class EventBase(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    origin: str = ""  # service_id of the publisher
    at: float = 0.0  # unix time at the publisher


class ServiceStarted(EventBase, tag="service_started"):
    """A service process started and announces itself."""

    service: ServiceInfo


class ServiceStopped(EventBase, tag="service_stopped"):
    """A service process stopped cleanly."""

    service_id: str


class NodeJoined(EventBase, tag="node_joined"):
    """An engine-worker's node joined (or re-announced) with its static facts."""

    node: NodeInfo


class NodeLeft(EventBase, tag="node_left"):
    """An engine-worker's node left the cluster."""

    node_id: str
    reason: str = ""


class InstancePlaced(EventBase, tag="instance_placed"):
    """The scheduler placed a model instance on a node."""

    instance: Instance


class InstanceLoading(EventBase, tag="instance_loading"):
    """A worker is loading an instance; progress in [0, 1]."""

    instance_id: str
    progress: float = 0.0


class InstanceReady(EventBase, tag="instance_ready"):
    """An instance is loaded and accepts tasks."""

    instance_id: str


class InstanceFailed(EventBase, tag="instance_failed"):
    """An instance failed to load or crashed; reason says why."""

    instance_id: str
    reason: str
    generation: int = -1  # the placement generation the failure is about (-1: whichever is current)


class InstanceDeleted(EventBase, tag="instance_deleted"):
    """An instance was unloaded and its memory freed."""

    instance_id: str


class DownloadProgressed(EventBase, tag="download_progressed"):
    """Progress of staging a model into object storage."""

    model_id: str
    phase: DownloadPhase
    done_bytes: int = 0
    total_bytes: int = 0
    reason: str = ""
    bytes_per_s: float = 0.0
    eta_s: float = -1.0  # -1: unknown


class ModelStaged(EventBase, tag="model_staged"):
    """A model is completely staged in object storage; its card says what placement needs."""

    card: ModelCard


class ModelDeleted(EventBase, tag="model_deleted"):
    """A model was removed from object storage; workers drop their copies once no instance uses them."""

    model_id: str


class InstanceStatusChanged(EventBase, tag="instance_status_changed"):
    """An instance moved to a lifecycle state without a dedicated event (downloading, warming, draining)."""

    instance_id: str
    status: str
    progress: float = 0.0


class ScalingPolicySet(EventBase, tag="scaling_policy_set"):
    """A model's scaling policy was set (the admin API, through the scheduler)."""

    model_id: str
    policy: ScalingPolicy


class ScalingDecided(EventBase, tag="scaling_decided"):
    """The scheduler's autoscaler decided for a model: an instance added or drained, or a hold."""

    model_id: str
    decision: ScalingDecision


Event = (
    ServiceStarted
    | ServiceStopped
    | NodeJoined
    | NodeLeft
    | InstancePlaced
    | InstanceLoading
    | InstanceReady
    | InstanceFailed
    | InstanceDeleted
    | DownloadProgressed
    | ModelStaged
    | ModelDeleted
    | InstanceStatusChanged
    | ScalingPolicySet
    | ScalingDecided
)
EVENT_TYPES: tuple[type[EventBase], ...] = (
    ServiceStarted,
    ServiceStopped,
    NodeJoined,
    NodeLeft,
    InstancePlaced,
    InstanceLoading,
    InstanceReady,
    InstanceFailed,
    InstanceDeleted,
    DownloadProgressed,
    ModelStaged,
    ModelDeleted,
    InstanceStatusChanged,
    ScalingPolicySet,
    ScalingDecided,
)
