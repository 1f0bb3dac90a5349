"""Plain data shared by commands, events, tasks and State."""

from __future__ import annotations

from enum import StrEnum

import msgspec


class Frozen(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """Base of every value type: immutable, keyword-only, tolerant of fields added by newer peers."""


class EngineInfo(Frozen):
    name: str
    version: str


class NodeInfo(Frozen):
    """Static facts of one engine-worker's machine, sent when it joins."""

    node_id: str
    hostname: str
    system: str
    machine: str
    cpu_count: int
    memory_total_bytes: int
    memory_available_bytes: int
    disk_total_bytes: int
    disk_free_bytes: int
    engines: tuple[EngineInfo, ...] = ()


class ServiceKind(StrEnum):
    GATEWAY = "gateway"
    SCHEDULER = "scheduler"
    DOWNLOADER = "downloader"
    METRICS = "metrics-collector"
    WORKER = "engine-worker"


class ServiceInfo(Frozen):
    service_id: str
    kind: ServiceKind
    hostname: str
    pid: int
    version: str
    started_at: float
    node_id: str = ""


class InstanceStatus(StrEnum):
    PLACED = "placed"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


class Instance(Frozen):
    instance_id: str
    model_id: str
    node_id: str
    engine: str
    status: InstanceStatus = InstanceStatus.PLACED
    progress: float = 0.0
    reason: str = ""


class DownloadPhase(StrEnum):
    DOWNLOADING = "downloading"
    CONVERTING = "converting"
    UPLOADING = "uploading"
    DONE = "done"
    FAILED = "failed"


class DownloadStatus(Frozen):
    model_id: str
    phase: DownloadPhase
    done_bytes: int = 0
    total_bytes: int = 0
    reason: str = ""
