"""NVIDIA GPUs through NVML (nvidia-ml-py's `pynvml`): static facts for NodeInfo, samples for metrics.

A machine without the NVML library, without a driver or without GPUs is normal: `NvmlReader.open()`
answers None and the node reports no GPUs. Fields a device does not support (NVML_ERROR_NOT_SUPPORTED,
e.g. memory info on the unified-memory GB10 of a DGX Spark) are reported as -1 in samples; a GPU that
reports no memory of its own is static()'s `unified_memory`, its memory the host's.

NVML lists every GPU of the machine; CUDA_VISIBLE_DEVICES (indices or GPU UUIDs, comma-separated, as
CUDA reads it) narrows them to those this worker's engines may use, so a worker pinned to one GPU of
several reports that one (`visible_indices` says which; samples keep NVML's index, as nvidia-smi shows).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import psutil

from fleet_proto import GpuInfo, GpuSample

log = logging.getLogger(__name__)

NVIDIA = "nvidia"
NVML_TEMPERATURE_GPU = 0  # pynvml.NVML_TEMPERATURE_GPU
NVML_ERROR_NOT_SUPPORTED = 3  # pynvml.NVML_ERROR_NOT_SUPPORTED
UNKNOWN = -1
VISIBLE_DEVICES_VAR = "CUDA_VISIBLE_DEVICES"


class GpuReader(Protocol):
    """What probe needs from a GPU source (NvmlReader, or a test's stand-in)."""

    def static(self) -> tuple[GpuInfo, ...]: ...

    def sample(self) -> tuple[GpuSample, ...]: ...


_open_failure_logged = False


def parse_visible_devices(value: str | None) -> tuple[str, ...] | None:
    """CUDA_VISIBLE_DEVICES as entries: None when unset (every GPU), () when empty (none), else the
    comma-separated entries, stripped (indices like "1", or UUIDs like "GPU-8f6c...")."""
    if value is None:
        return None
    return tuple(entry.strip() for entry in value.split(",") if entry.strip())


def visible_indices(entries: tuple[str, ...] | None, uuids: Sequence[str]) -> tuple[int, ...]:
    """The NVML indices of the GPUs `entries` name, in their order; `uuids[i]` is NVML device i's
    UUID ("" when unknown). An index names device i; a UUID (or a unique prefix of one, as CUDA
    allows) the device with that UUID. As CUDA does, the first entry that names no device (-1, an
    index out of range, an unknown UUID, a MIG instance) ends the list; a repeated one is skipped."""
    if entries is None:
        return tuple(range(len(uuids)))
    chosen: list[int] = []
    for entry in entries:
        if entry.isdigit():
            index = int(entry) if int(entry) < len(uuids) else None
        else:
            matches = [i for i, uuid in enumerate(uuids) if uuid and uuid.lower().startswith(entry.lower())]
            index = matches[0] if len(matches) == 1 and entry.upper().startswith("GPU-") else None
        if index is None:
            break
        if index not in chosen:
            chosen.append(index)
    return tuple(chosen)


class NvmlReader:
    """Reads NVIDIA GPUs through an NVML module (`pynvml`, or a fake with the same functions), only
    those `visible_devices` (CUDA_VISIBLE_DEVICES' value; None: unset, every GPU) names."""

    def __init__(
        self,
        nvml: Any,
        system_memory_bytes: Callable[[], int] | None = None,
        visible_devices: str | None = None,
    ) -> None:
        self._nvml = nvml
        # Unified-memory GPUs (GB10) report no memory of their own: their memory is the system's.
        self._system_memory_bytes = system_memory_bytes or (lambda: int(psutil.virtual_memory().total))
        self._visible = parse_visible_devices(visible_devices)
        self._indices: tuple[int, ...] | None = None  # the selection, worked out once

    @classmethod
    def open(cls, nvml: Any = None, environ: Mapping[str, str] | None = None) -> NvmlReader | None:
        """An initialised reader of the GPUs CUDA_VISIBLE_DEVICES (in `environ`, default this process's
        environment) leaves visible, or None when NVML is missing or fails to start (logged once, at
        debug)."""
        global _open_failure_logged
        try:
            if nvml is None:
                import pynvml

                nvml = pynvml
            nvml.nvmlInit()
            env = os.environ if environ is None else environ
            return cls(nvml, visible_devices=env.get(VISIBLE_DEVICES_VAR))
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

    def _handle(self, index: int) -> Any:
        try:
            return self._nvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:
            log.debug("nvmlDeviceGetHandleByIndex(%d) failed: %r", index, exc)
            return None

    def _uuid(self, handle: Any) -> str:
        uuid = _field(lambda h: _text(self._nvml.nvmlDeviceGetUUID(h)), handle, "uuid")
        return uuid or ""

    def visible_indices(self) -> tuple[int, ...]:
        """NVML indices of the GPUs reported, worked out on first use (UUIDs only read when an entry
        of CUDA_VISIBLE_DEVICES is one)."""
        if self._indices is None:
            try:
                count = int(self._nvml.nvmlDeviceGetCount())
            except Exception as exc:
                log.debug("nvmlDeviceGetCount failed: %r", exc)
                return ()
            by_uuid = any(not entry.isdigit() for entry in self._visible or ())
            uuids = [self._uuid(self._handle(i)) if by_uuid else "" for i in range(count)]
            self._indices = visible_indices(self._visible, uuids)
        return self._indices

    def _handles(self) -> list[tuple[int, Any]]:
        return [(index, self._handle(index)) for index in self.visible_indices()]

    def static(self) -> tuple[GpuInfo, ...]:
        gpus = []
        for _, handle in self._handles():
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
        for index, handle in self._handles():
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
