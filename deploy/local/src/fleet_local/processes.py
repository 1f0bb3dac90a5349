"""Child processes of the embedded stack: start with logs in files, wait until ready, stop by PID."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil


class StartupError(RuntimeError):
    """A child process exited or did not become ready in time; the message names its log file."""


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LISTEN_PORTS_FROM = 20000  # free ports are picked from here up to the ephemeral range


def ephemeral_low(path: Path = EPHEMERAL_RANGE) -> int:
    """The lowest port the kernel hands to outgoing connections (Linux's default: 32768)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Ports this process handed out: a server told a port may bind it only seconds later (weed mini's
# admin starts after its S3 is up), so a port free now is not necessarily untaken; picking it twice
# failed a worker's health server with "address already in use" in CI. Process-wide like the ports.
_HANDED_OUT: deque[int] = deque(maxlen=2048)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, below the ephemeral range, and not handed out before by this process: a port
    the OS picked (bind to 0) can be handed to some outgoing connection before the server that was
    told it binds it (seen under test load)."""
    low = ephemeral_low()
    chooser = random.Random()
    for _ in range(200):
        port = chooser.randrange(LISTEN_PORTS_FROM, low) if low > LISTEN_PORTS_FROM + 1000 else 0
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            picked = int(sock.getsockname()[1])
        _HANDED_OUT.append(picked)
        return picked
    raise StartupError(f"no free port on {host} below {low}")


def spawn(
    argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start `argv` in its own session (so a terminal's Ctrl-C reaches only `fleet up`)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=None if env is None else dict(env),
            cwd=cwd,
            start_new_session=True,
        )


def _log_tail(log_path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _wait(ready, proc: subprocess.Popen[bytes], what: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StartupError(
                f"{what} exited with code {proc.returncode}; log {log_path}:\n{_log_tail(log_path)}"
            )
        if ready():
            return
        time.sleep(0.05)
    raise StartupError(
        f"{what} was not ready after {timeout_s:.0f} s; log {log_path}:\n{_log_tail(log_path)}"
    )


def tcp_open(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return 200 <= response.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_tcp(proc: subprocess.Popen[bytes], what: str, log_path: Path, port: int, timeout_s: float) -> None:
    _wait(lambda: tcp_open("127.0.0.1", port), proc, what, log_path, timeout_s)


def wait_http(proc: subprocess.Popen[bytes], what: str, log_path: Path, url: str, timeout_s: float) -> None:
    _wait(lambda: http_ok(url), proc, what, log_path, timeout_s)


def process_started_at(pid: int) -> float:
    return float(psutil.Process(pid).create_time())


def pid_alive(pid: int, started_at: float | None = None) -> bool:
    """Whether `pid` runs and, given `started_at`, is still the same process (PIDs get reused)."""
    try:
        process = psutil.Process(pid)
        if started_at is not None and abs(process.create_time() - started_at) > 0.01:
            return False
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stop_pid(pid: int, started_at: float | None = None, timeout_s: float = 15.0) -> None:
    """SIGTERM the process group led by `pid` (our children start their own session), then SIGKILL."""
    if not pid_alive(pid, started_at):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reap our own child, if it is one
        if not pid_alive(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
