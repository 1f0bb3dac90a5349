"""NVIDIA GPUs through NVML (nvidia-ml-py's `pynvml`): static facts for NodeInfo, samples for metrics.

A machine without the NVML library, without a driver or without GPUs is normal: `NvmlReader.open()`
answers None and the node reports no GPUs. Fields a device does not support (NVML_ERROR_NOT_SUPPORTED,
e.g. memory info on the unified-memory GB10 of a DGX Spark) are reported as -1 in samples; a GPU that
reports no memory of its own is static()'s `unified_memory`, its memory the host's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import psutil

from fleet_proto import GpuInfo, GpuSample

log = logging.getLogger(__name__)

NVIDIA = "nvidia"
NVML_TEMPERATURE_GPU = 0  # pynvml.NVML_TEMPERATURE_GPU
NVML_ERROR_NOT_SUPPORTED = 3  # pynvml.NVML_ERROR_NOT_SUPPORTED
UNKNOWN = -1


class GpuReader(Protocol):
    """What probe needs from a GPU source (NvmlReader, or a test's stand-in)."""

    def static(self) -> tuple[GpuInfo, ...]: ...

    def sample(self) -> tuple[GpuSample, ...]: ...


_open_failure_logged = False


class NvmlReader:
    """Reads NVIDIA GPUs through an NVML module (`pynvml`, or a fake with the same functions)."""

    def __init__(self, nvml: Any, system_memory_bytes: Callable[[], int] | None = None) -> None:
        self._nvml = nvml
        # Unified-memory GPUs (GB10) report no memory of their own: their memory is the system's.
        self._system_memory_bytes = system_memory_bytes or (lambda: int(psutil.virtual_memory().total))

    @classmethod
    def open(cls, nvml: Any = None) -> NvmlReader | None:
        """An initialised reader, or None when NVML is missing or fails to start (logged once, at debug)."""
        global _open_failure_logged
        try:
            if nvml is None:
                import pynvml

                nvml = pynvml
            nvml.nvmlInit()
            return cls(nvml)
        except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
            if not _open_failure_logged:
                _open_failure_logged = True
                log.debug("no NVML, so no NVIDIA GPUs reported: %r", exc)
            return None

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception as exc:
            log.debug("nvmlShutdown failed: %r", exc)

    def _handles(self) -> list[Any]:
        try:
            count = int(self._nvml.nvmlDeviceGetCount())
        except Exception as exc:
            log.debug("nvmlDeviceGetCount failed: %r", exc)
            return []
        handles = []
        for index in range(count):
            try:
                handles.append(self._nvml.nvmlDeviceGetHandleByIndex(index))
            except Exception as exc:
                log.debug("nvmlDeviceGetHandleByIndex(%d) failed: %r", index, exc)
                handles.append(None)
        return handles

    def static(self) -> tuple[GpuInfo, ...]:
        gpus = []
        for handle in self._handles():
            if handle is None:
                continue
            name = _field(lambda h: _text(self._nvml.nvmlDeviceGetName(h)), handle, "name")
            total = _field(lambda h: int(self._nvml.nvmlDeviceGetMemoryInfo(h).total), handle, "memory")
            unified = total is None or total <= 0  # no framebuffer of its own: it shares the host's
            if unified:
                total = self._system_memory_bytes()
            gpus.append(
                GpuInfo(name=name or "NVIDIA GPU", vendor=NVIDIA, memory_bytes=total, unified_memory=unified)
            )
        return tuple(gpus)

    def sample(self) -> tuple[GpuSample, ...]:
        samples = []
        nvml = self._nvml
        temperature_sensor = getattr(nvml, "NVML_TEMPERATURE_GPU", NVML_TEMPERATURE_GPU)
        for index, handle in enumerate(self._handles()):
            if handle is None:
                samples.append(GpuSample(index=index))
                continue
            util = _field(lambda h: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0, handle, "utilization")
            temp = _field(
                lambda h: float(nvml.nvmlDeviceGetTemperature(h, temperature_sensor)), handle, "temp"
            )
            power = _field(lambda h: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0, handle, "power")  # mW -> W
            memory = _field(lambda h: nvml.nvmlDeviceGetMemoryInfo(h), handle, "memory")
            samples.append(
                GpuSample(
                    index=index,
                    utilization_ratio=UNKNOWN if util is None else min(max(float(util), 0.0), 1.0),
                    temperature_c=UNKNOWN if temp is None else temp,
                    power_w=UNKNOWN if power is None else float(power),
                    memory_used_bytes=UNKNOWN if memory is None else int(memory.used),
                    memory_total_bytes=UNKNOWN if memory is None else int(memory.total),
                )
            )
        return tuple(samples)


def _field(read: Callable[[Any], Any], handle: Any, what: str) -> Any:
    """`read(handle)`, or None when the device does not support it (or reading it failed)."""
    try:
        return read(handle)
    except Exception as exc:
        if getattr(exc, "value", None) != NVML_ERROR_NOT_SUPPORTED:
            log.debug("NVML %s read failed: %r", what, exc)
        return None


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
