"""What each image installs, installed and started without Docker.

An image's Python contents are wheels: Dockerfile.service builds the wheels of proto, bus, runtime,
the compose service's EXTRA_LIBS and its SERVICE_DIR, then installs them with --no-index into a clean
Python; Dockerfile.worker-mlx-cpu does the same with its own list. Here the same folders (read from
docker-compose.yml's build args and from the worker's Dockerfile) are built into one wheelhouse, and
each image's packages are installed from it into an empty venv, which then runs the image's module
against real NATS, S3 and Redis until /health says ok. A dependency that a service imports at start
but does not declare fails here as it would in its image. (Left out: the downloader's model packages,
which only carry model files, and the vLLM images, whose base is vLLM's own.)
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import yaml

from fleet_local import stack
from fleet_local.processes import free_port, process_started_at, spawn, stop_pid, wait_http

REPO = Path(__file__).resolve().parents[1]
BASE_LIBS = ("libs/proto", "libs/bus", "libs/runtime")  # what Dockerfile.service always builds
WORKER_DOCKERFILE = REPO / "deploy/docker/Dockerfile.worker-mlx-cpu"


class Image(msgspec.Struct, frozen=True):
    service: str
    folders: tuple[str, ...]  # repository folders whose wheels (and their dependencies) it installs
    module: str
    port_setting: str  # where the module serves /health


def compose_images() -> list[Image]:
    """The images docker-compose.yml builds from Dockerfile.service, by their build args."""
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    ports = {"gateway": "FLEET_GATEWAY_PORT", "metrics-collector": "FLEET_METRICS_PORT"}
    images = []
    for name, service in services.items():
        build = service.get("build") or {}
        if not build.get("dockerfile", "").endswith("Dockerfile.service"):
            continue
        args = build["args"]
        folders = (*BASE_LIBS, *args.get("EXTRA_LIBS", "").split(), args["SERVICE_DIR"])
        images.append(Image(name, folders, args["MODULE"], ports.get(name, "FLEET_HEALTH_PORT")))
    return images


def worker_image() -> Image:
    """The MLX CPU worker: the folders its Dockerfile's `pip wheel` names."""
    text = WORKER_DOCKERFILE.read_text().replace("\\\n", " ")
    wheel_line = next(line for line in text.splitlines() if "pip wheel" in line)
    folders = tuple(re.findall(r"\./((?:libs|services)/[\w-]+)", wheel_line))
    return Image("engine-worker", folders, "fleet_worker", "FLEET_HEALTH_PORT")


IMAGES = [*compose_images(), worker_image()]


def distribution(folder: str) -> str:
    return tomllib.loads((REPO / folder / "pyproject.toml").read_text())["project"]["name"]


def pip(*args: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pip", "-q", *args], capture_output=True, text=True, timeout=1200
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every image's folders and their dependencies as wheels, built once (`pip wheel`, as the
    images' builder stages do; dependencies come from the same indexes `make install` uses)."""
    folder = tmp_path_factory.mktemp("wheels")
    folders = sorted({f for image in IMAGES for f in image.folders})
    pip("wheel", "--wheel-dir", str(folder), *(str(REPO / f) for f in folders))
    return folder


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """NATS, S3 and Redis with credentials (`fleet up --infra-only`): their connection settings."""
    state = tmp_path_factory.mktemp("infra")
    manifest = stack.up(state, services=False)
    try:
        yield stack.joining_env(manifest)
    finally:
        stack.down(state)


def test_the_images_are_the_compose_services_and_the_worker() -> None:
    assert sorted(image.service for image in IMAGES) == [
        "downloader",
        "engine-worker",
        "gateway",
        "metrics-collector",
        "scheduler",
    ]
    assert {"libs/store", "services/engine-worker"} <= set(worker_image().folders)


@pytest.mark.parametrize("image", IMAGES, ids=lambda image: image.service)
def test_an_image_s_packages_alone_start_its_service(
    image: Image, wheelhouse: Path, servers: dict[str, str], tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # Only this image's packages: pip resolves their dependencies from the wheelhouse, nothing else.
    pip("--python", str(python), "install", "--no-index", "--find-links", str(wheelhouse),
        *(distribution(f) for f in image.folders))  # fmt: skip
    port = free_port()
    # A clean environment, as in a container: nothing of this test's venv leaks in.
    env = {"PATH": f"{venv}/bin:/usr/bin:/bin", "HOME": str(tmp_path), **servers}
    env |= {"FLEET_STATE_DIR": str(tmp_path / "state"), image.port_setting: str(port)}
    log_path = tmp_path / f"{image.service}.log"
    proc = spawn([str(python), "-m", image.module], log_path, env=env)
    started_at = process_started_at(proc.pid)
    try:
        health = f"http://127.0.0.1:{port}/health"
        wait_http(proc, image.service, log_path, health, 120)
        with urllib.request.urlopen(health, timeout=10) as response:
            assert json.loads(response.read())["status"] == "ok"
    finally:
        stop_pid(proc.pid, started_at)
