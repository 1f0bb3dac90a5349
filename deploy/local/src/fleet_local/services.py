"""`fleet gateway|scheduler|downloader|metrics-collector|worker`: one service in the foreground.

It runs with the same FLEET_* settings docker compose and Kubernetes give the service, so a service
(an engine-worker on a Mac, say) joins a cluster whose other parts run anywhere. Settings come from,
strongest first: this command's flags, the process environment, then the --env-file files in order
(a later file overrides an earlier one), as `docker compose` lets the shell override its env files.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from fleet_local.stack import SERVICES
from fleet_runtime.settings import PREFIX, load_settings

# The command name of each service (`fleet worker` runs the engine-worker) and its module.
SERVICE_MODULES = {("worker" if name == "engine-worker" else name): module for name, module in SERVICES}
# The setting --port sets: the gateway and the collector serve /health on their own port.
PORT_SETTINGS = {"gateway": "FLEET_GATEWAY_PORT", "metrics-collector": "FLEET_METRICS_PORT"}


class EnvFileError(ValueError):
    """An env file could not be read or has a line that is not NAME=VALUE."""


def parse_env_file(text: str, source: str) -> dict[str, str]:
    """NAME=VALUE lines (dotenv, as `fleet env` and compose's join-env print them): blank lines and
    # comments are skipped, `export ` is allowed, a value may be quoted as a shell would."""
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, equals, value = line.removeprefix("export ").partition("=")
        name = name.strip()
        if not equals or not name.isidentifier():
            raise EnvFileError(f"{source}:{number}: expected NAME=VALUE, got {raw.strip()!r}")
        try:
            words = shlex.split(value, comments=True)
        except ValueError as exc:
            raise EnvFileError(f"{source}:{number}: {exc}") from None
        values[name] = " ".join(words)
    return values


def dotenv(env: Mapping[str, str]) -> str:
    """env as NAME=VALUE lines that parse_env_file (and a POSIX shell) read back unchanged."""
    return "".join(f"{name}={shlex.quote(value)}\n" for name, value in sorted(env.items()))


def service_env(
    service: str,
    environ: Mapping[str, str],
    env_files: Sequence[Mapping[str, str]] = (),
    nats_url: str = "",
    node_id: str = "",
    port: int | None = None,
) -> dict[str, str]:
    """The environment `service` runs with: the files, then the environment, then the flags."""
    env: dict[str, str] = {}
    for values in env_files:
        env.update(values)
    env.update(environ)
    if nats_url:
        env[PREFIX + "NATS_URL"] = nats_url
    if node_id:
        env[PREFIX + "NODE_ID"] = node_id
    if port is not None:
        env[PORT_SETTINGS.get(service, PREFIX + "HEALTH_PORT")] = str(port)
    return env


def read_env_files(paths: Sequence[str]) -> list[dict[str, str]]:
    files = []
    for path in paths:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise EnvFileError(f"--env-file {path}: {exc.strerror}") from None
        files.append(parse_env_file(text, path))
    return files


def exec_service(service: str, env: dict[str, str]) -> None:
    """Replace this process with the service (its PID, signals and exit code become the service's),
    after checking the settings so a typo fails here with the setting's name."""
    load_settings(env)
    module = SERVICE_MODULES[service]
    os.execve(sys.executable, [sys.executable, "-m", module], env)
