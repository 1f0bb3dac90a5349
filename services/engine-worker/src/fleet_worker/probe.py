"""What this node is and has: static facts for NodeJoined, dynamic ones for fleet.metrics.<node>."""

from __future__ import annotations

import importlib.metadata
import platform
import re
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec
import psutil

from fleet_proto import EngineCalibration, EngineInfo, GpuInfo, NodeInfo, NodeKind, NodeMetrics, QualityBudget
from fleet_proto.quality import DEFAULT_BUDGET
from fleet_worker.engines.base import ENGINES
from fleet_worker.gpu import GpuReader, GpuSample, NvmlReader

DMI_DIR = Path("/sys/class/dmi/id")
CPUINFO = Path("/proc/cpuinfo")
DGX_SPARK_CHIP = "NVIDIA DGX Spark (GB10)"

# Libraries a node reports after its engines (EngineSpec.distributions), found the same way.
LIBRARY_DISTRIBUTIONS = {"mlx-lm": ("mlx-lm",), "torch": ("torch",)}


def node_id_from(hostname: str) -> str:
    """A hostname made safe as one NATS subject token (dots and the like become '-')."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", hostname) or "node"


def installed_engines() -> tuple[EngineInfo, ...]:
    """The engines whose distributions are installed (at Fleet's revision of each), then the libraries."""
    probes = [(name, spec.distributions, spec.revision) for name, spec in ENGINES.items()]
    probes += [(name, distributions, 0) for name, distributions in LIBRARY_DISTRIBUTIONS.items()]
    found = []
    for name, distributions, revision in probes:
        for distribution in distributions:
            try:
                version = importlib.metadata.version(distribution)
            except importlib.metadata.PackageNotFoundError:
                continue
            found.append(EngineInfo(name=name, version=f"{version}+fleet{revision}" if revision else version))
            break
    return tuple(found)


def node_kind(gpus: Sequence[GpuInfo] = ()) -> NodeKind:
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return NodeKind.APPLE
    if any(gpu.vendor == "nvidia" for gpu in gpus) or Path("/proc/driver/nvidia/gpus").is_dir():
        return NodeKind.CUDA
    return NodeKind.CPU


def cpuinfo_fields(cpuinfo: Path = CPUINFO) -> dict[str, str]:
    """Each field of /proc/cpuinfo as the first CPU that has it gives it ("model name", "flags"...);
    empty when unreadable."""
    fields: dict[str, str] = {}
    try:
        text = cpuinfo.read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        if colon:
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model_name(cpuinfo: Path = CPUINFO) -> str:
    fields = cpuinfo_fields(cpuinfo)
    return fields["model name"] if "model name" in fields else platform.processor() or platform.machine()


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The first CPU's flags (x86 "flags", Arm "Features"); empty when unreadable."""
    fields = cpuinfo_fields(cpuinfo)
    return frozenset(fields.get("flags", fields.get("Features", "")).split())


def read_dmi(field: str, dmi_dir: Path = DMI_DIR) -> str:
    """One DMI field ("product_name", "sys_vendor", "board_name"), "" when absent or unreadable."""
    try:
        return (dmi_dir / field).read_text().strip()
    except OSError:
        return ""


def is_dgx_spark(product_name: str, gpus: Sequence[GpuInfo] = ()) -> bool:
    """A GB10 GPU, or DMI naming the box a DGX Spark ("DGX_Spark") or an OEM GX10 (ASUS Ascent GX10)."""
    product = product_name.lower().replace("_", " ")
    return any("gb10" in gpu.name.lower() for gpu in gpus) or "dgx spark" in product or "gx10" in product


def has_unified_memory(kind: NodeKind, product_name: str, gpus: Sequence[GpuInfo] = ()) -> bool:
    """Whether the node's GPU shares host memory: Apple silicon, a DGX Spark (whatever NVML said of its
    memory), or a GPU that reports no memory of its own. Placement then counts one pool for every
    engine (fleet_proto.memory)."""
    return kind == NodeKind.APPLE or is_dgx_spark(product_name, gpus) or any(g.unified_memory for g in gpus)


def chip_name(
    gpus: Sequence[GpuInfo] = (),
    *,
    system: str | None = None,
    dmi_dir: Path = DMI_DIR,
    cpuinfo: Path = CPUINFO,
) -> str:
    """NodeInfo.chip: "Apple M3 Max", "NVIDIA DGX Spark (GB10)", "NVIDIA H100 80GB HBM3", a CPU model."""
    system = system or platform.system()
    if system == "Darwin":
        return _sysctl("machdep.cpu.brand_string") or _sysctl("hw.model") or platform.machine()
    if system != "Linux":
        return platform.processor() or platform.machine()
    product = read_dmi("product_name", dmi_dir)
    if is_dgx_spark(product, gpus):
        return DGX_SPARK_CHIP
    if gpus:  # the GPU is what placement cares about; several of one kind read "8x NVIDIA H100 ..."
        names = [gpu.name for gpu in gpus]
        return names[0] if len(names) == 1 else f"{len(names)}x {names[0]}"
    if "nvidia" in read_dmi("sys_vendor", dmi_dir).lower():  # another NVIDIA system, its GPUs unseen
        return product.replace("_", " ") or read_dmi("board_name", dmi_dir) or "NVIDIA System"
    if (model := cpuinfo_fields(cpuinfo).get("model name")) is not None:
        return model
    # Many ARM boards have no "model name" in /proc/cpuinfo: the board's DMI name says more than "aarch64".
    return (
        product.replace("_", " ")
        or read_dmi("board_name", dmi_dir)
        or platform.processor()
        or platform.machine()
    )


def _sysctl(name: str) -> str:
    try:
        done = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def gpu_metrics_fields(samples: Sequence[GpuSample]) -> dict[str, Any]:
    """The NodeMetrics keyword arguments carrying GPU samples: {"gpus": (GpuSample, ...)}."""
    return {"gpus": tuple(samples)}


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


AUTO: Literal["auto"] = "auto"  # node_info/node_metrics: open NVML if this machine has it


def _reader(reader: GpuReader | Literal["auto"] | None) -> GpuReader | None:
    return NvmlReader.open() if reader == AUTO else reader


def node_engines(overrides: Overrides = PROBED) -> tuple[EngineInfo, ...]:
    """The engines this node offers: FLEET_NODE_ENGINES when set, else those installed."""
    return parse_engines(overrides.engines) if overrides.engines else installed_engines()


def node_info(
    node_id: str,
    model_dir: Path,
    overrides: Overrides = PROBED,
    cached: tuple[str, ...] = (),
    reader: GpuReader | Literal["auto"] | None = AUTO,
    ring_host: str = "",
    ring_port_base: int = 0,
    calibrations: tuple[EngineCalibration, ...] = (),
    quality_budget: QualityBudget = DEFAULT_BUDGET,
) -> NodeInfo:
    memory = psutil.virtual_memory()
    disk = psutil.disk_usage(str(_existing(model_dir)))
    source = _reader(reader)
    gpus = source.static() if source is not None else ()
    kind = NodeKind(overrides.kind) if overrides.kind else node_kind(gpus)
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
        engines=node_engines(overrides),
        kind=kind,
        chip=chip_name(gpus),
        gpus=gpus,
        cached_models=tuple(cached),
        ring_host=ring_host,
        ring_port_base=ring_port_base,
        calibrations=calibrations,
        quality_budget=quality_budget,
        unified_memory=has_unified_memory(kind, read_dmi("product_name"), gpus),
    )


def node_metrics(
    node_id: str, model_dir: Path, overrides: Overrides = PROBED, reader: GpuReader | None = None
) -> NodeMetrics:
    """Metrics now; with a reader (open it once, e.g. NvmlReader.open()), GPU samples too once
    NodeMetrics has its `gpus` field."""
    memory = psutil.virtual_memory()
    extra: dict[str, Any] = {}
    if reader is not None:
        extra = gpu_metrics_fields(reader.sample())
    return NodeMetrics(
        node_id=node_id,
        at=time.time(),
        memory_used_bytes=int(memory.total - memory.available),
        memory_available_bytes=overrides.memory_bytes or int(memory.available),
        cpu_percent=float(psutil.cpu_percent(interval=None)),
        disk_free_bytes=int(psutil.disk_usage(str(_existing(model_dir))).free),
        **extra,
    )


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@dataclass(frozen=True)
class Interface:
    name: str
    address: str  # IPv4
    speed_mbps: int  # 0: unknown
    loopback: bool = False


def network_interfaces() -> list[Interface]:
    """This node's up IPv4 interfaces with their link speed (for ranking handoff endpoints)."""
    stats = psutil.net_if_stats()
    found = []
    for name, addresses in psutil.net_if_addrs().items():
        stat = stats.get(name)
        if stat is None or not stat.isup:
            continue
        for address in addresses:
            if address.family == socket.AF_INET:
                loopback = address.address.startswith("127.")
                found.append(Interface(name, address.address, stat.speed, loopback))
    return found


def fastest_addresses(interfaces: Sequence[Interface]) -> list[str]:
    """Interface addresses, fastest network path first (the seed ranks Thunderbolt, then Ethernet, then
    Wi-Fi: link speed orders them the same way); loopback only when there is nothing else."""
    ranked = sorted(interfaces, key=lambda i: (i.loopback, -i.speed_mbps, i.name))
    return [i.address for i in ranked if not i.loopback] or [i.address for i in ranked]


def resolved_ring_host(configured: str, interfaces: Sequence[Interface]) -> str:
    """FLEET_RING_HOST as NodeInfo carries it: "auto" becomes this machine's fastest address."""
    if configured.strip() != AUTO:
        return configured.strip()
    return next(iter(fastest_addresses(interfaces)), "127.0.0.1")
