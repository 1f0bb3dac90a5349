"""The embedded stack: infrastructure servers plus the five services, as child processes.

Everything lives under one state dir: data, logs/ and stack.json, which records each process's PID
and start time so `fleet down` (from another shell) stops exactly what `fleet up` started.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from pathlib import Path

import msgspec
import psutil

from fleet_local.processes import StartupError, free_port, pid_alive, process_started_at, spawn, wait_http
from fleet_local.servers import ServerHandle, start_nats, start_redis, start_s3
from fleet_runtime.settings import Settings, load_settings, settings_env

MANIFEST = "stack.json"
# (process name, python module); started together, then waited on together.
SERVICES: tuple[tuple[str, str], ...] = (
    ("scheduler", "fleet_scheduler"),
    ("downloader", "fleet_downloader"),
    ("metrics-collector", "fleet_metrics"),
    ("engine-worker", "fleet_worker"),
    ("gateway", "fleet_gateway"),
)


class StackManifest(msgspec.Struct, kw_only=True):
    state_dir: str
    gateway_url: str = ""
    metrics_url: str = ""
    nats_url: str = ""
    processes: list[ServerHandle] = []


def manifest_path(state_dir: Path) -> Path:
    return state_dir / MANIFEST


def read_manifest(state_dir: Path) -> StackManifest | None:
    path = manifest_path(state_dir)
    if not path.exists():
        return None
    return msgspec.json.decode(path.read_bytes(), type=StackManifest)


def _write_manifest(manifest: StackManifest) -> None:
    path = manifest_path(Path(manifest.state_dir))
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(manifest)))
    tmp.replace(path)


def running(manifest: StackManifest) -> list[ServerHandle]:
    return [p for p in manifest.processes if pid_alive(p.pid, p.started_at)]


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _service_settings(
    state_dir: Path, nats: ServerHandle, s3: ServerHandle, redis: ServerHandle, port: int
) -> Settings:
    """The user's FLEET_* settings (node overrides, log level...) with the embedded servers' addresses."""
    return msgspec.structs.replace(
        load_settings(),
        nats_url=nats.url,
        s3_endpoint=s3.url,
        redis_url=redis.url,
        gateway_host="127.0.0.1",
        gateway_port=port,
        metrics_port=free_port(),
        state_dir=str(state_dir),
    )


def up(state_dir: Path, gateway_port: int = 8000, timeout_s: float = 120.0) -> StackManifest:
    """Start everything and return once every service answers /health; on failure, stop what started."""
    state_dir = state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    existing = read_manifest(state_dir)
    if existing is not None and running(existing):
        raise StartupError(f"a stack is already running from {state_dir} (run `fleet down` first)")
    if not _port_free(gateway_port):
        raise StartupError(f"port {gateway_port} is in use: stop what listens there or pass --port")
    manifest = StackManifest(state_dir=str(state_dir))
    try:
        for start in (start_nats, start_s3, start_redis):
            manifest.processes.append(start(state_dir))
            _write_manifest(manifest)
        nats, s3, redis = manifest.processes
        settings = _service_settings(state_dir, nats, s3, redis, gateway_port)
        manifest.nats_url = nats.url
        manifest.gateway_url = f"http://127.0.0.1:{gateway_port}"
        manifest.metrics_url = f"http://127.0.0.1:{settings.metrics_port}/metrics"
        base_env = {**os.environ, **settings_env(settings)}
        started = []
        for name, module in SERVICES:
            health_port = {"gateway": gateway_port, "metrics-collector": settings.metrics_port}.get(
                name, free_port()
            )
            env = base_env | {"FLEET_HEALTH_PORT": str(health_port)}
            if name in ("gateway", "metrics-collector"):
                env["FLEET_HEALTH_PORT"] = "0"  # they serve /health on their own port
            log = state_dir / "logs" / f"{name}.log"
            proc = spawn([sys.executable, "-m", module], log, env=env)
            handle = ServerHandle(
                name=name,
                pid=proc.pid,
                started_at=process_started_at(proc.pid),
                url=f"http://127.0.0.1:{health_port}",
                log_path=str(log),
                health_url=f"http://127.0.0.1:{health_port}/health",
            )
            manifest.processes.append(handle)
            started.append((proc, handle))
            _write_manifest(manifest)
        deadline = time.monotonic() + timeout_s
        for proc, handle in started:
            wait_http(
                proc,
                handle.name,
                Path(handle.log_path),
                handle.health_url,
                max(deadline - time.monotonic(), 1),
            )
    except BaseException:
        down(state_dir)
        raise
    return manifest


def down(state_dir: Path) -> list[str]:
    """Stop every process of the stack (services first), remove leftovers; returns what was stopped."""
    manifest = read_manifest(state_dir.resolve())
    if manifest is None:
        return []
    stopped = []
    for handle in reversed(manifest.processes):
        if pid_alive(handle.pid, handle.started_at):
            stopped.append(handle.name)
        handle.stop()
    with contextlib.suppress(FileNotFoundError):
        manifest_path(Path(manifest.state_dir)).unlink()
    return stopped


def resident_bytes(manifest: StackManifest) -> int:
    """Total RSS of the stack's processes and their children."""
    total = 0
    for handle in running(manifest):
        with contextlib.suppress(psutil.NoSuchProcess):
            process = psutil.Process(handle.pid)
            total += sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])
    return total
