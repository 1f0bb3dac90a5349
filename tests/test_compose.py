"""docker-compose.yml is valid and keeps the deployment's invariants.

The invariants are checked on the parsed YAML (anchors and merge keys resolved) everywhere; the
file is also validated by `docker compose config` where the compose plugin is installed (no engine
is needed for that).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yml"
FLEET_SERVICES = ("gateway", "scheduler", "downloader", "metrics-collector", "engine-worker")
INFRA_SERVICES = ("nats", "minio", "redis")


def _compose(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE_FILE), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


@pytest.fixture(scope="module")
def compose_available() -> None:
    if shutil.which("docker") is None:
        pytest.skip("docker client not installed")
    try:
        version = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"docker compose not usable: {exc}")
    if version.returncode != 0:
        reason = (version.stderr.strip() or version.stdout.strip()).splitlines()[0]
        pytest.skip(f"docker compose plugin not available: {reason}")


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def test_compose_config_json_has_every_service(compose_available: None) -> None:
    result = _compose("config", "--format", "json")
    assert result.returncode == 0, result.stderr
    assert set(FLEET_SERVICES + INFRA_SERVICES) <= set(json.loads(result.stdout)["services"])


def test_compose_config_is_valid(compose_available: None) -> None:
    result = _compose("config", "-q")
    assert result.returncode == 0, result.stderr


def test_all_services_present(config: dict) -> None:
    assert set(FLEET_SERVICES + INFRA_SERVICES) <= set(config["services"])


def test_engine_worker_is_scalable(config: dict) -> None:
    worker = config["services"]["engine-worker"]
    assert "container_name" not in worker
    assert not worker.get("ports")
    # Unset, so each replica falls back to its container hostname.
    assert "FLEET_NODE_ID" not in (worker.get("environment") or {})


@pytest.mark.parametrize("name", FLEET_SERVICES)
def test_fleet_service_has_healthcheck(config: dict, name: str) -> None:
    healthcheck = config["services"][name].get("healthcheck")
    assert healthcheck and healthcheck.get("test"), f"{name} has no healthcheck"
    assert not healthcheck.get("disable")


@pytest.mark.parametrize("name", FLEET_SERVICES)
def test_fleet_service_dockerfile_exists(config: dict, name: str) -> None:
    build = config["services"][name]["build"]
    dockerfile = REPO / build["context"] / build.get("dockerfile", "Dockerfile")
    assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
    assert dockerfile.resolve().is_relative_to(REPO)


@pytest.mark.parametrize(("service", "needs"), [("scheduler", "redis"), ("metrics-collector", "redis")])
def test_services_wait_for_what_they_connect_to(config: dict, service: str, needs: str) -> None:
    assert config["services"][service]["depends_on"][needs]["condition"] == "service_healthy"


def test_the_vllm_gpu_worker_is_opt_in_and_reserves_gpus(config: dict) -> None:
    worker = config["services"]["engine-worker-vllm"]
    assert worker["profiles"] == ["gpu"]  # plain `docker compose up` on a machine without GPUs skips it
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    dockerfile = REPO / worker["build"]["context"] / worker["build"]["dockerfile"]
    assert dockerfile.is_file() and "vllm/vllm-openai:" in dockerfile.read_text()
    assert "container_name" not in worker and "ports" not in worker  # scales like the CPU worker


@pytest.mark.parametrize("worker", ["engine-worker", "engine-worker-vllm"])
def test_workers_serve_kv_handoffs_on_the_compose_network(config: dict, worker: str) -> None:
    env = config["services"][worker]["environment"]
    assert env["FLEET_HANDOFF_HOST"] == "0.0.0.0" and env["FLEET_HANDOFF_PORT"] == "8900"
    assert env["FLEET_NATS_URL"] == "nats://nats:4222"  # the shared settings still apply


SECRETS_DIR = "/run/fleet-secrets/"


def test_no_credential_is_written_in_the_file() -> None:
    text = COMPOSE_FILE.read_text()
    for leaked in ("fleet-dev-", "PASSWORD:", "SECRET_KEY:", '--requirepass "fleet'):
        assert leaked not in text, leaked


@pytest.mark.parametrize("name", (*FLEET_SERVICES, "engine-worker-vllm"))
def test_services_read_their_credentials_from_the_generated_secret_files(config: dict, name: str) -> None:
    service = config["services"][name]
    env = service["environment"]
    assert env["FLEET_NATS_PASSWORD_FILE"].startswith(SECRETS_DIR)
    assert env["FLEET_S3_SECRET_KEY_FILE"].startswith(SECRETS_DIR)
    assert env["FLEET_REDIS_PASSWORD_FILE"].startswith(SECRETS_DIR)
    assert "fleet-secrets:/run/fleet-secrets:ro" in service["volumes"]
    assert service["depends_on"]["secrets-init"]["condition"] == "service_completed_successfully"


def test_the_gateway_needs_keys_and_the_servers_their_passwords(config: dict) -> None:
    services = config["services"]
    gateway = services["gateway"]["environment"]
    assert gateway["FLEET_API_KEYS_FILE"] == SECRETS_DIR + "api_key"
    assert gateway["FLEET_ADMIN_KEYS_FILE"] == SECRETS_DIR + "admin_key"
    init = " ".join(services["secrets-init"]["entrypoint"])
    for name in ("nats_password", "minio_password", "redis_password", "api_key", "admin_key"):
        assert name in init
    assert "umask 077" in init and "chmod 0600" in init
    assert "nats_password" in " ".join(services["nats"]["entrypoint"])
    assert services["minio"]["environment"]["MINIO_ROOT_PASSWORD_FILE"] == SECRETS_DIR + "minio_password"
    assert "--requirepass" in " ".join(services["redis"]["entrypoint"])
