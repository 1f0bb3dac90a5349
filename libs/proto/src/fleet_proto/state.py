"""The cluster State: what every service knows after folding the event stream with apply()."""

from __future__ import annotations

import msgspec

from fleet_proto.common import DownloadStatus, Instance, ModelCard, NodeInfo, ServiceInfo
from fleet_proto.scaling import ModelScaling


class State(msgspec.Struct, frozen=True, kw_only=True):
    last_seq: int = 0  # stream sequence of the last event applied
    services: dict[str, ServiceInfo] = {}
    nodes: dict[str, NodeInfo] = {}
    instances: dict[str, Instance] = {}
    downloads: dict[str, DownloadStatus] = {}
    models: dict[str, ModelCard] = {}  # staged models by id
    scaling: dict[str, ModelScaling] = {}  # models whose instances follow demand, by id
