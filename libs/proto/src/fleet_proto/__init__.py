"""Fleet's message contract: commands, events, per-request messages, State and the reducer."""

from fleet_proto.apply import EventOrderError, UnknownEventError, apply, replay
from fleet_proto.codec import UnknownCommandError, decode, decode_command, decode_event, encode
from fleet_proto.commands import Command, CreateInstance, DeleteInstance, DownloadModel
from fleet_proto.common import (
    DownloadPhase,
    DownloadStatus,
    EngineInfo,
    Instance,
    InstanceStatus,
    NodeInfo,
    ServiceInfo,
    ServiceKind,
)
from fleet_proto.events import (
    DownloadProgressed,
    Event,
    InstanceDeleted,
    InstanceFailed,
    InstanceLoading,
    InstancePlaced,
    InstanceReady,
    NodeJoined,
    NodeLeft,
    ServiceStarted,
    ServiceStopped,
)
from fleet_proto.messages import CancelRequest, GenerateTask, NodeMetrics, SamplingParams, TokenChunk
from fleet_proto.state import State

__all__ = [
    "CancelRequest",
    "Command",
    "CreateInstance",
    "DeleteInstance",
    "DownloadModel",
    "DownloadPhase",
    "DownloadProgressed",
    "DownloadStatus",
    "EngineInfo",
    "Event",
    "EventOrderError",
    "GenerateTask",
    "Instance",
    "InstanceDeleted",
    "InstanceFailed",
    "InstanceLoading",
    "InstancePlaced",
    "InstanceReady",
    "InstanceStatus",
    "NodeInfo",
    "NodeJoined",
    "NodeLeft",
    "NodeMetrics",
    "SamplingParams",
    "ServiceInfo",
    "ServiceKind",
    "ServiceStarted",
    "ServiceStopped",
    "State",
    "TokenChunk",
    "UnknownCommandError",
    "UnknownEventError",
    "apply",
    "decode",
    "decode_command",
    "decode_event",
    "encode",
    "replay",
]
