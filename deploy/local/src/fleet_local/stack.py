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
from collections.abc import Mapping
from pathlib import Path

import msgspec
import psutil

from fleet_local import secrets
from fleet_local.processes import StartupError, free_port, pid_alive, process_started_at, spawn, wait_http
from fleet_local.secrets import StackSecrets
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
    """What `fleet up` started. It holds credentials, so stack.json is written 0600."""

    state_dir: str
    gateway_url: str = ""
    metrics_url: str = ""
    nats_url: str = ""  # with the user and password in it, as the nats CLI and nats-py take it
    # The gateway's keys ("" when started with --no-auth).
    api_key: str = ""
    admin_key: str = ""
    # FLEET_* connection settings (servers and their credentials) for a process joining the stack.
    env: dict[str, str] = {}
    processes: list[ServerHandle] = []


def manifest_path(state_dir: Path) -> Path:
    return state_dir / MANIFEST


def read_manifest(state_dir: Path) -> StackManifest | None:
    path = manifest_path(state_dir)
    if not path.exists():
        return None
    return msgspec.json.decode(path.read_bytes(), type=StackManifest)


def write_manifest(manifest: StackManifest) -> None:
    encoded = msgspec.json.format(msgspec.json.encode(manifest))
    secrets.write_private(manifest_path(Path(manifest.state_dir)), encoded)


def running(manifest: StackManifest) -> list[ServerHandle]:
    return [p for p in manifest.processes if pid_alive(p.pid, p.started_at)]


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def connection_env(
    nats: ServerHandle, s3: ServerHandle, redis: ServerHandle, creds: StackSecrets
) -> dict[str, str]:
    """The FLEET_* variables that reach the embedded servers, credentials included."""
    return {
        "FLEET_NATS_URL": nats.url,
        "FLEET_NATS_USER": creds.nats_user,
        "FLEET_NATS_PASSWORD": creds.nats_password,
        "FLEET_S3_ENDPOINT": s3.url,
        "FLEET_S3_ACCESS_KEY": creds.s3_access_key,
        "FLEET_S3_SECRET_KEY": creds.s3_secret_key,
        "FLEET_REDIS_URL": redis.url,
    }


def joining_env(manifest: StackManifest) -> dict[str, str]:
    """What a service run on its own needs to join the stack: the servers with their credentials,
    and the gateway's keys when the stack has them (so a gateway started that way is keyed too)."""
    keys = {"FLEET_API_KEYS": manifest.api_key, "FLEET_ADMIN_KEYS": manifest.admin_key}
    return manifest.env | {name: key for name, key in keys.items() if key}


def connection_settings(manifest: StackManifest) -> Settings:
    """Settings that reach `manifest`'s servers with their credentials (ObjectStore.from_settings...)."""
    return load_settings(manifest.env)


def nats_url_with_credentials(url: str, creds: StackSecrets) -> str:
    return url.replace("nats://", f"nats://{creds.nats_user}:{creds.nats_password}@", 1)


def _service_settings(
    state_dir: Path,
    connection: dict[str, str],
    port: int,
    auth: StackSecrets | None,
    defaults: Mapping[str, str],
) -> Settings:
    """The user's FLEET_* settings (node overrides, log level...; `defaults` where they set none)
    with the embedded servers' addresses and credentials, and the gateway's keys unless auth is off."""
    user, connected = load_settings({**defaults, **os.environ}), load_settings(connection)
    servers = {f: getattr(connected, f) for f in (name.removeprefix("FLEET_").lower() for name in connection)}
    keys = {"api_keys": "", "admin_keys": ""}
    if auth is not None:  # the generated keys, and any the user's FLEET_API_KEYS / FLEET_ADMIN_KEYS add
        keys = {
            "api_keys": ",".join(filter(None, (auth.api_key, user.api_keys))),
            "admin_keys": ",".join(filter(None, (auth.admin_key, user.admin_keys))),
        }
    return msgspec.structs.replace(
        user,
        **servers,
        **keys,
        gateway_host="127.0.0.1",
        gateway_port=port,
        metrics_port=free_port(),
        state_dir=str(state_dir),
    )


def up(
    state_dir: Path,
    gateway_port: int = 8000,
    timeout_s: float = 120.0,
    auth: bool = True,
    services: bool = True,
    defaults: Mapping[str, str] | None = None,
) -> StackManifest:
    """Start everything and return once every service answers /health; on failure, stop what started.
    Every server runs with the generated credentials; `auth=False` leaves the gateway's APIs open.
    `services=False` starts only the servers, for services run on their own (`fleet worker ...`).
    `defaults`: FLEET_* settings for the services where the user's environment sets none.
    `gateway_port` 0: a free port picked here with the servers' ports, so no two picks collide (a
    port another process picked can be taken by this stack's servers before the gateway binds it)."""
    state_dir = state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    existing = read_manifest(state_dir)
    if existing is not None and running(existing):
        raise StartupError(f"a stack is already running from {state_dir} (run `fleet down` first)")
    if services and gateway_port == 0:
        gateway_port = free_port()
    elif services and not _port_free(gateway_port):
        raise StartupError(f"port {gateway_port} is in use: stop what listens there or pass --port")
    creds = secrets.load_or_create(state_dir)
    manifest = StackManifest(state_dir=str(state_dir))
    try:
        starts = (
            lambda: start_nats(state_dir, creds.nats_user, creds.nats_password),
            lambda: start_s3(state_dir, creds.s3_access_key, creds.s3_secret_key),
            lambda: start_redis(state_dir, creds.redis_password),
        )
        for start in starts:
            manifest.processes.append(start())
            write_manifest(manifest)
        nats, s3, redis = manifest.processes
        manifest.env = connection_env(nats, s3, redis, creds)
        manifest.nats_url = nats_url_with_credentials(nats.url, creds)
        if auth:
            manifest.api_key, manifest.admin_key = creds.api_key, creds.admin_key
        write_manifest(manifest)
        if not services:
            return manifest
        settings = _service_settings(
            state_dir, manifest.env, gateway_port, creds if auth else None, defaults or {}
        )
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
            write_manifest(manifest)
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
