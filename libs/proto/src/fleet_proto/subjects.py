"""The one table that ties every NATS subject to its message type, stream and retention.

fleet_bus creates streams from STREAMS; `python -m fleet_proto.generate` writes proto/ from CHANNELS.
"""

from __future__ import annotations

import re
from enum import StrEnum

import msgspec

from fleet_proto.commands import COMMAND_TYPES
from fleet_proto.events import EVENT_TYPES
from fleet_proto.messages import (
    AdmissionSample,
    CancelRequest,
    EmbedTask,
    GenerateTask,
    LivenessProbe,
    LivenessReply,
    NodeMetrics,
    PlacementsReply,
    PlacementsRequest,
    PrefillReply,
    PrefillRequest,
    RequestStats,
    RouteDecided,
    RouteReply,
    RouteRequest,
    TokenChunk,
)
from fleet_proto.traces import (
    SpanBatch,
    TraceDeleteReply,
    TraceDeleteRequest,
    TraceListReply,
    TraceListRequest,
    TraceReply,
    TraceRequest,
)


class Retention(StrEnum):
    WORK_QUEUE = "workqueue"  # each message is consumed once, acked, redelivered if not acked
    LIMITS = "limits"  # kept up to an age/size, replayable by anyone
    CORE = "core"  # plain NATS, not persisted


class StreamSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    subjects: tuple[str, ...]
    retention: Retention
    max_age_s: float = 0.0  # 0: no limit
    max_bytes: int = -1
    description: str = ""


class Channel(msgspec.Struct, frozen=True, kw_only=True):
    subject: str  # NATS subject; {name} marks a token filled in per message
    messages: tuple[type, ...]
    retention: Retention
    stream: str = ""
    reply: type | None = None
    description: str = ""


CMD_STREAM = StreamSpec(
    name="FLEET_CMD",
    subjects=("fleet.cmd.>",),
    retention=Retention.WORK_QUEUE,
    description="Commands (create/delete instance, download); consumed once by the scheduler or downloader.",
)
EVT_STREAM = StreamSpec(
    name="FLEET_EVT",
    subjects=("fleet.evt.>",),
    retention=Retention.LIMITS,
    max_age_s=7 * 24 * 3600.0,
    max_bytes=1 << 30,
    description="Events: the cluster's ordered truth; every service folds it into State.",
)
TASK_STREAM = StreamSpec(
    name="FLEET_TASK",
    subjects=("fleet.task.>",),
    retention=Retention.WORK_QUEUE,
    max_age_s=3600.0,
    description="Tasks for one worker; redelivered if the worker dies before acking.",
)
STREAMS: tuple[StreamSpec, ...] = (CMD_STREAM, EVT_STREAM, TASK_STREAM)

LEADER_BUCKET = "fleet-leader"
STATE_BUCKET = "fleet-state"
LOCKS_BUCKET = "fleet-locks"
KV_BUCKETS: tuple[str, ...] = (LEADER_BUCKET, STATE_BUCKET, LOCKS_BUCKET)

_TOKEN = re.compile(r"^[A-Za-z0-9_\-]+$")


class SubjectTokenError(ValueError):
    """An id cannot be used as one NATS subject token."""


def subject_token(value: str) -> str:
    """`value`, checked to be one safe subject token (no dots, wildcards or spaces)."""
    if not _TOKEN.match(value):
        raise SubjectTokenError(f"{value!r} is not a valid subject token (letters, digits, '_' and '-' only)")
    return value


def _tag(message_type: type) -> str:
    return str(msgspec.inspect.type_info(message_type).tag)  # type: ignore[attr-defined]


def event_subject(kind: type) -> str:
    return f"fleet.evt.{_tag(kind)}"


def command_subject(kind: type) -> str:
    return f"fleet.cmd.{_tag(kind)}"


ROUTE_SUBJECT = "fleet.route"
ROUTE_DECIDED_SUBJECT = "fleet.route.decided"
PLACEMENTS_SUBJECT = "fleet.placements"
REQUEST_STATS_SUBJECT = "fleet.stats.request"


# Subjects with one token per message: {name} marks it (as CHANNELS and proto/ show them).
TASK_SUBJECT = "fleet.task.{worker_id}"
TOKEN_SUBJECT = "fleet.tok.{request_id}"
CANCEL_SUBJECT = "fleet.cancel.{request_id}"
PREFILL_SUBJECT = "fleet.prefill.{worker_id}"
METRICS_SUBJECT = "fleet.metrics.{node_id}"
ALIVE_SUBJECT = "fleet.alive.{node_id}"
ADMISSION_SUBJECT = "fleet.admission.{gateway_id}"


def task_subject(worker_id: str) -> str:
    return TASK_SUBJECT.format(worker_id=subject_token(worker_id))


def token_subject(request_id: str) -> str:
    return TOKEN_SUBJECT.format(request_id=subject_token(request_id))


def cancel_subject(request_id: str) -> str:
    return CANCEL_SUBJECT.format(request_id=subject_token(request_id))


def prefill_subject(worker_id: str) -> str:
    return PREFILL_SUBJECT.format(worker_id=subject_token(worker_id))


def metrics_subject(node_id: str) -> str:
    return METRICS_SUBJECT.format(node_id=subject_token(node_id))


def alive_subject(node_id: str) -> str:
    return ALIVE_SUBJECT.format(node_id=subject_token(node_id))


def admission_subject(gateway_id: str) -> str:
    return ADMISSION_SUBJECT.format(gateway_id=subject_token(gateway_id))


# What a subscriber to every request's or node's messages listens on.
ALL_CANCELS_SUBJECT = CANCEL_SUBJECT.format(request_id="*")
ALL_METRICS_SUBJECT = METRICS_SUBJECT.format(node_id="*")
ALL_ADMISSION_SUBJECT = ADMISSION_SUBJECT.format(gateway_id="*")


TRACE_SPANS_SUBJECT = "fleet.traces.spans"
TRACE_LIST_SUBJECT = "fleet.traces.list"
TRACE_GET_SUBJECT = "fleet.traces.get"
TRACE_DELETE_SUBJECT = "fleet.traces.delete"


CHANNELS: tuple[Channel, ...] = (
    *(
        Channel(
            subject=command_subject(t),
            messages=(t,),
            retention=Retention.WORK_QUEUE,
            stream=CMD_STREAM.name,
            description=(t.__doc__ or t.__name__).strip().splitlines()[0],
        )
        for t in COMMAND_TYPES
    ),
    *(
        Channel(
            subject=event_subject(t),
            messages=(t,),
            retention=Retention.LIMITS,
            stream=EVT_STREAM.name,
            description=(t.__doc__ or t.__name__).strip().splitlines()[0],
        )
        for t in EVENT_TYPES
    ),
    Channel(
        subject=TASK_SUBJECT,
        messages=(GenerateTask, EmbedTask),
        retention=Retention.WORK_QUEUE,
        stream=TASK_STREAM.name,
        description="Generation and embedding tasks for one worker (token ids in, tokens or vectors out).",
    ),
    Channel(
        subject=TOKEN_SUBJECT,
        messages=(TokenChunk,),
        retention=Retention.CORE,
        description="Token stream of one request, worker -> gateway.",
    ),
    Channel(
        subject=CANCEL_SUBJECT,
        messages=(CancelRequest,),
        retention=Retention.CORE,
        description="Cancel one request wherever it runs.",
    ),
    Channel(
        subject=ROUTE_SUBJECT,
        messages=(RouteRequest,),
        reply=RouteReply,
        retention=Retention.CORE,
        description="Routing decision, gateway -> scheduler (request/reply).",
    ),
    Channel(
        subject=PREFILL_SUBJECT,
        messages=(PrefillRequest,),
        reply=PrefillReply,
        retention=Retention.CORE,
        description="Remote prefill of one prompt, decode worker -> prefill worker (request/reply).",
    ),
    Channel(
        subject=ROUTE_DECIDED_SUBJECT,
        messages=(RouteDecided,),
        retention=Retention.CORE,
        description="Every routing decision with its reason (scheduler -> anyone watching).",
    ),
    Channel(
        subject=PLACEMENTS_SUBJECT,
        messages=(PlacementsRequest,),
        reply=PlacementsReply,
        retention=Retention.CORE,
        description="Placement previews for a model, gateway -> scheduler (request/reply).",
    ),
    Channel(
        subject=REQUEST_STATS_SUBJECT,
        messages=(RequestStats,),
        retention=Retention.CORE,
        description="Timings and token counts of every finished request (gateway -> metrics-collector).",
    ),
    Channel(
        subject=ADMISSION_SUBJECT,
        messages=(AdmissionSample,),
        retention=Retention.CORE,
        description="A gateway's admission queue (waiting per model, refusals), about once a second.",
    ),
    Channel(
        subject=ALIVE_SUBJECT,
        messages=(LivenessProbe,),
        reply=LivenessReply,
        retention=Retention.CORE,
        description="Is this worker there? Gateway -> worker (request/reply); no responders: it died.",
    ),
    Channel(
        subject=METRICS_SUBJECT,
        messages=(NodeMetrics,),
        retention=Retention.CORE,
        description="A node's dynamic metrics, about once a second.",
    ),
    Channel(
        subject=TRACE_SPANS_SUBJECT,
        messages=(SpanBatch,),
        retention=Retention.CORE,
        description="Finished spans of request traces, every service -> metrics-collector.",
    ),
    Channel(
        subject=TRACE_LIST_SUBJECT,
        messages=(TraceListRequest,),
        reply=TraceListReply,
        retention=Retention.CORE,
        description="The newest traces, gateway -> metrics-collector (request/reply).",
    ),
    Channel(
        subject=TRACE_GET_SUBJECT,
        messages=(TraceRequest,),
        reply=TraceReply,
        retention=Retention.CORE,
        description="One trace's spans and time per category, gateway -> metrics-collector.",
    ),
    Channel(
        subject=TRACE_DELETE_SUBJECT,
        messages=(TraceDeleteRequest,),
        reply=TraceDeleteReply,
        retention=Retention.CORE,
        description="Forget one trace or all, gateway -> metrics-collector (request/reply).",
    ),
)
