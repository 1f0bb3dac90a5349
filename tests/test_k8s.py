"""The Kubernetes manifests in deploy/k8s/ are valid and keep the deployment's invariants.

Offline, without a cluster. Every document of every manifest is validated against the OpenAPI schemas
of Kubernetes 1.37 in strict mode (unknown fields are errors), with the schemas that the
kubernetes-validate package ships: the offline equivalent of kubeconform. The other tests check what
a schema cannot: the kustomization lists every file; Fleet's containers have probes on their health
ports, resource requests, no privileges, the secrets mounted read-only and the shared ConfigMap; every
FLEET_* name is a real setting; Services, HPAs and disruption budgets point at what exists; the NATS
routes name each server; and the Helm values for NATS use keys of the official chart.
"""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from fleet_metrics.registry import node_families
from fleet_runtime.settings import PREFIX
from tests.support import SETTING_NAMES

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
K8S_DIR = REPO / "deploy" / "k8s"
KUBERNETES_VERSION = "1.37.0"
MANIFESTS = sorted(p for p in K8S_DIR.glob("*.yaml") if p.name != "kustomization.yaml")

FLEET_IMAGES = (
    "fleet/gateway",
    "fleet/scheduler",
    "fleet/downloader",
    "fleet/metrics-collector",
    "fleet/worker-mlx-cpu",
    "fleet/worker-vllm-cuda",
)
UPSTREAM_IMAGES = ("nats", "minio/minio", "minio/mc", "redis")
# Where each image serves GET /health: the gateway on its API port, the collector on its metrics port.
HEALTH_PORTS = {"fleet/gateway": 8000, "fleet/metrics-collector": 9100}
DEFAULT_HEALTH_PORT = 8081
SECRET_DIR = "/run/fleet-secrets"
SECRET_KEYS = {"nats_password", "minio_password", "redis_password", "api_key", "admin_key"}
SECRET_FILE_VARS = ("FLEET_NATS_PASSWORD_FILE", "FLEET_S3_SECRET_KEY_FILE", "FLEET_REDIS_PASSWORD_FILE")
FLEET_UID = 10001  # the images' user (deploy/docker/Dockerfile.*)
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job")

# Key paths of the official NATS chart's values.yaml (github.com/nats-io/k8s, helm/charts/nats), read
# at tag nats-1.2.6 and unchanged at chart 2.14.2: the ones helm/nats-values.yaml may use. Below the
# free-form keys (merge, env, topologySpreadConstraints) the chart takes anything.
NATS_CHART_KEYS = {
    "config",
    "config.cluster",
    "config.cluster.enabled",
    "config.cluster.port",
    "config.cluster.replicas",
    "config.cluster.routeURLs",
    "config.cluster.merge",
    "config.jetstream",
    "config.jetstream.enabled",
    "config.jetstream.fileStore",
    "config.jetstream.fileStore.enabled",
    "config.jetstream.fileStore.dir",
    "config.jetstream.fileStore.pvc",
    "config.jetstream.fileStore.pvc.enabled",
    "config.jetstream.fileStore.pvc.size",
    "config.jetstream.fileStore.pvc.storageClassName",
    "config.jetstream.fileStore.maxSize",
    "config.jetstream.memoryStore",
    "config.monitor",
    "config.merge",
    "container",
    "container.image",
    "container.env",
    "container.merge",
    "podTemplate",
    "podTemplate.topologySpreadConstraints",
    "podTemplate.merge",
    "podDisruptionBudget",
    "podDisruptionBudget.enabled",
    "natsBox",
    "natsBox.enabled",
}
NATS_CHART_FREE_FORM = {"merge", "env", "topologySpreadConstraints"}


def load_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


DOCUMENTS = [(path.name, doc) for path in MANIFESTS for doc in load_documents(path)]


def of_kind(kind: str) -> list[dict]:
    return [doc for _, doc in DOCUMENTS if doc["kind"] == kind]


def named(kind: str, name: str) -> dict:
    (doc,) = [doc for doc in of_kind(kind) if doc["metadata"]["name"] == name]
    return doc


def workloads() -> list[dict]:
    return [doc for _, doc in DOCUMENTS if doc["kind"] in WORKLOAD_KINDS]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def image_name(image: str) -> str:
    """The image without its tag: `fleet/gateway:latest` -> `fleet/gateway`."""
    name, _, tag = image.rpartition(":")
    return name if name and "/" not in tag else image


def fleet_containers() -> list[tuple[dict, dict]]:
    return [
        (workload, container)
        for workload in workloads()
        for container in pod_spec(workload)["containers"]
        if image_name(container["image"]) in FLEET_IMAGES
    ]


FLEET_CONTAINERS = fleet_containers()
FLEET_IDS = [workload["metadata"]["name"] for workload, _ in FLEET_CONTAINERS]


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


def pod_templates() -> list[dict]:
    return [workload["spec"]["template"] for workload in workloads()]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_validates_against_the_kubernetes_schema(path: Path) -> None:
    failures = []
    for doc in load_documents(path):
        what = f"{path.name}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            at = ".".join(str(part) for part in exc.path) or "(top)"
            failures.append(f"{what}: at {at}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            failures.append(f"{what}: {exc.message}")
    assert not failures, "\n".join(failures)


def test_the_kustomization_lists_exactly_the_manifest_files() -> None:
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == "fleet"
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources)), "a resource is listed twice"
    assert set(resources) == {p.name for p in MANIFESTS}


def test_the_kustomization_maps_every_fleet_image() -> None:
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    assert sorted(image["name"] for image in kustomization["images"]) == sorted(FLEET_IMAGES)
    for image in kustomization["images"]:
        assert image["newName"] == image["name"], "the default is the name `docker compose build` gives"


def test_every_document_is_in_the_fleet_namespace_or_none() -> None:
    for file, doc in DOCUMENTS:
        namespace = doc["metadata"].get("namespace")
        assert namespace in (None, "fleet"), f"{file}: {doc['kind']}/{doc['metadata']['name']}: {namespace}"


def test_every_object_and_pod_carries_the_fleet_labels() -> None:
    labelled = [
        (f"{file}: {doc['kind']}", doc["metadata"]) for file, doc in DOCUMENTS if doc["kind"] != "Namespace"
    ]
    labelled += [(f"pod of {w['metadata']['name']}", w["spec"]["template"]["metadata"]) for w in workloads()]
    for what, metadata in labelled:
        labels = metadata.get("labels", {})
        assert labels.get("app.kubernetes.io/part-of") == "fleet", what
        assert {"app.kubernetes.io/name", "app.kubernetes.io/component"} <= set(labels), what


def test_the_images_are_fleets_and_the_upstream_servers() -> None:
    used = {
        image_name(container["image"])
        for workload in workloads()
        for container in pod_spec(workload)["containers"] + pod_spec(workload).get("initContainers", [])
    }
    assert used == set(FLEET_IMAGES) | set(UPSTREAM_IMAGES)


def test_every_container_pulls_its_image_if_not_present() -> None:
    for workload in workloads():
        for container in pod_spec(workload)["containers"]:
            assert container.get("imagePullPolicy") == "IfNotPresent", workload["metadata"]["name"]


@pytest.mark.parametrize(("workload", "container"), FLEET_CONTAINERS, ids=FLEET_IDS)
def test_every_fleet_container_has_probes_and_resource_requests(workload: dict, container: dict) -> None:
    assert "readinessProbe" in container
    assert "livenessProbe" in container or "startupProbe" in container
    requests = container.get("resources", {}).get("requests", {})
    assert {"cpu", "memory"} <= set(requests)


@pytest.mark.parametrize(("workload", "container"), FLEET_CONTAINERS, ids=FLEET_IDS)
def test_every_fleet_probe_asks_the_services_health_port(workload: dict, container: dict) -> None:
    expected = HEALTH_PORTS.get(image_name(container["image"]), DEFAULT_HEALTH_PORT)
    probes = [container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in container]
    for probe in probes:
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
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] == FLEET_UID
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"]["drop"] == ["ALL"]


@pytest.mark.parametrize(("workload", "container"), FLEET_CONTAINERS, ids=FLEET_IDS)
def test_every_fleet_container_reads_its_secrets_from_the_mounted_secret(
    workload: dict, container: dict
) -> None:
    volumes = {volume["name"]: volume for volume in pod_spec(workload)["volumes"]}
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == SECRET_DIR]
    secret = volumes[mount["name"]]["secret"]
    assert secret["secretName"] == "fleet-secrets"
    assert secret["defaultMode"] == 0o400
    assert mount["readOnly"] is True

    env = env_values(container)
    assert set(SECRET_FILE_VARS) <= set(env)
    for name, value in env.items():
        if name.startswith(PREFIX) and name.endswith("_FILE"):
            directory, _, key = value.rpartition("/")
            assert directory == SECRET_DIR and key in SECRET_KEYS, f"{name}={value}"
    assert {"configMapRef": {"name": "fleet-config"}} in container["envFrom"]


@pytest.mark.parametrize(("workload", "container"), FLEET_CONTAINERS, ids=FLEET_IDS)
def test_every_fleet_container_writes_only_to_empty_dirs(workload: dict, container: dict) -> None:
    state_dir = named("ConfigMap", "fleet-config")["data"]["FLEET_STATE_DIR"]
    volumes = {volume["name"]: volume for volume in pod_spec(workload)["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    for path in (state_dir, "/tmp"):
        assert "emptyDir" in mounts[path], f"{path} is not an emptyDir"


def test_every_fleet_setting_in_the_manifests_exists() -> None:
    used = set(named("ConfigMap", "fleet-config")["data"])
    used |= {
        name
        for workload in workloads()
        for container in pod_spec(workload)["containers"]
        for name in env_values(container)
    }
    unknown = {
        name for name in used if name.startswith(PREFIX) and name.removesuffix("_FILE") not in SETTING_NAMES
    }
    assert not unknown, f"not fleet_runtime settings: {sorted(unknown)}"


def test_the_gateway_serves_on_its_health_port() -> None:
    (container,) = pod_spec(named("Deployment", "gateway"))["containers"]
    env = env_values(container)
    assert env["FLEET_GATEWAY_HOST"] == "0.0.0.0"
    assert int(env["FLEET_GATEWAY_PORT"]) == HEALTH_PORTS["fleet/gateway"]
    assert {"FLEET_API_KEYS_FILE", "FLEET_ADMIN_KEYS_FILE"} <= set(env)


def test_the_metrics_collector_serves_and_is_scraped_on_9100() -> None:
    workload = named("Deployment", "metrics-collector")
    (container,) = pod_spec(workload)["containers"]
    assert int(env_values(container)["FLEET_METRICS_PORT"]) == 9100
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert annotations["prometheus.io/port"] == "9100"
    service = named("Service", "metrics-collector")
    assert [port["port"] for port in service["spec"]["ports"]] == [9100]


def test_the_scheduler_runs_two_replicas_that_a_drain_cannot_both_stop() -> None:
    scheduler = named("Deployment", "scheduler")
    assert scheduler["spec"]["replicas"] == 2
    assert scheduler["spec"]["strategy"]["type"] == "RollingUpdate"
    budgets = [
        pdb
        for pdb in of_kind("PodDisruptionBudget")
        if labels_match(
            pdb["spec"]["selector"]["matchLabels"], scheduler["spec"]["template"]["metadata"]["labels"]
        )
    ]
    assert [pdb["spec"].get("minAvailable") for pdb in budgets] == [1]


def test_the_gpu_worker_requests_a_gpu_and_tolerates_gpu_nodes() -> None:
    spec = pod_spec(named("Deployment", "engine-worker-vllm-cuda"))
    (container,) = spec["containers"]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    (shm,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"


@pytest.mark.parametrize("name", ["engine-worker-mlx-cpu", "engine-worker-vllm-cuda"])
def test_workers_advertise_their_pod_ip_for_handoffs_and_pipeline_rings(name: str) -> None:
    spec = pod_spec(named("Deployment", name))
    (container,) = spec["containers"]
    names = [var["name"] for var in container["env"]]
    env = env_values(container)
    # $(POD_IP) expands only when POD_IP comes first.
    assert names.index("POD_IP") < names.index("FLEET_HANDOFF_ADVERTISE")
    assert names.index("POD_IP") < names.index("FLEET_RING_HOST")
    assert env["FLEET_RING_HOST"] == "$(POD_IP)"
    (pod_ip,) = [var for var in container["env"] if var["name"] == "POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    port = int(env["FLEET_HANDOFF_PORT"])
    assert env["FLEET_HANDOFF_ADVERTISE"] == f"$(POD_IP):{port}"
    assert env["FLEET_HANDOFF_HOST"] == "0.0.0.0"
    assert container_port(container, "handoff") == port
    # Unset: each pod's hostname is its node id.
    assert "FLEET_NODE_ID" not in env


@pytest.mark.parametrize("name", ["engine-worker-mlx-cpu", "engine-worker-vllm-cuda"])
def test_workers_keep_their_model_cache_within_its_volume(name: str) -> None:
    spec = pod_spec(named("Deployment", name))
    (container,) = spec["containers"]
    state_dir = named("ConfigMap", "fleet-config")["data"]["FLEET_STATE_DIR"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == state_dir]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    cache_bytes = int(env_values(container)["FLEET_MODEL_CACHE_BYTES"])
    assert 0 < cache_bytes <= quantity_bytes(volume["emptyDir"]["sizeLimit"])


def test_every_autoscaler_targets_a_deployment_of_the_folder() -> None:
    deployments = {doc["metadata"]["name"]: doc for doc in of_kind("Deployment")}
    autoscalers = of_kind("HorizontalPodAutoscaler")
    assert {hpa["metadata"]["name"] for hpa in autoscalers} == {
        "gateway",
        "engine-worker-mlx-cpu",
        "engine-worker-vllm-cuda",
    }
    for hpa in autoscalers:
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
        deployment = deployments[target["name"]]
        # The HPA owns the count; a `replicas` here would reset it on every apply.
        assert "replicas" not in deployment["spec"], target["name"]
        assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
        for metric in hpa["spec"]["metrics"]:
            if metric["type"] == "Resource":  # utilization is relative to the requests
                for container in pod_spec(deployment)["containers"]:
                    assert metric["resource"]["name"] in container["resources"]["requests"]
    assert named("HorizontalPodAutoscaler", "gateway")["spec"]["minReplicas"] >= 2


def test_the_gpu_autoscaler_uses_a_metric_the_collector_exports() -> None:
    exported = {family.name for family in node_families([])}
    hpa = named("HorizontalPodAutoscaler", "engine-worker-vllm-cuda")
    names = [
        metric["pods"]["metric"]["name"] for metric in hpa["spec"]["metrics"] if metric["type"] == "Pods"
    ]
    assert names
    assert set(names) <= exported


def test_every_service_selects_pods_and_targets_a_declared_port() -> None:
    templates = pod_templates()
    for service in of_kind("Service"):
        name = service["metadata"]["name"]
        selected = [
            t for t in templates if labels_match(service["spec"]["selector"], t["metadata"]["labels"])
        ]
        assert selected, f"Service {name} selects no pods"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert all(any(container_port(c, target) for c in t["spec"]["containers"]) for t in selected), (
                f"Service {name}: no container declares port {target}"
            )


def test_every_disruption_budget_selects_pods() -> None:
    templates = pod_templates()
    for pdb in of_kind("PodDisruptionBudget"):
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert any(labels_match(selector, t["metadata"]["labels"]) for t in templates), pdb["metadata"][
            "name"
        ]


def nats_container() -> dict:
    (container,) = pod_spec(named("StatefulSet", "nats"))["containers"]
    return container


def nats_routes() -> list[str]:
    """The cluster routes of nats.conf, each $NAME replaced by the container's env value."""
    conf = named("ConfigMap", "nats-config")["data"]["nats.conf"]
    (routes,) = re.findall(r"^\s*routes\s*[:=]?\s*\[(.*?)\]", conf, re.MULTILINE | re.DOTALL)
    env = env_values(nats_container())
    items = [item for item in re.split(r"[\s,]+", routes) if item]
    return [env[item.removeprefix("$")] if item.startswith("$") else item for item in items]


def test_nats_routes_name_every_server_through_the_headless_service() -> None:
    nats = named("StatefulSet", "nats")
    replicas = nats["spec"]["replicas"]
    assert replicas == 3
    assert nats["spec"]["podManagementPolicy"] == "Parallel"
    headless = named("Service", nats["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    # The servers must resolve each other before any of them is ready.
    assert headless["spec"]["publishNotReadyAddresses"] is True
    cluster_port = container_port(nats_container(), "cluster")
    expected = {f"nats-{i}.{headless['metadata']['name']}:{cluster_port}" for i in range(replicas)}
    routes = nats_routes()
    # Each route logs in (the cluster block requires it).
    assert all(route.startswith("nats://$(NATS_USER):$(NATS_PASSWORD)@") for route in routes), routes
    assert {route.rpartition("@")[2] for route in routes} == expected


def test_nats_takes_its_credentials_from_the_secret_and_the_config() -> None:
    env = {var["name"]: var for var in nats_container()["env"]}
    assert env["NATS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "fleet-secrets",
        "key": "nats_password",
    }
    assert env["NATS_USER"]["valueFrom"]["configMapKeyRef"] == {
        "name": "fleet-config",
        "key": "FLEET_NATS_USER",
    }
    names = list(env)
    # $(NATS_USER) and $(NATS_PASSWORD) expand in the routes only when defined before them.
    for route in (name for name in names if name.startswith("NATS_ROUTE_")):
        assert names.index("NATS_USER") < names.index(route)
        assert names.index("NATS_PASSWORD") < names.index(route)
    conf = named("ConfigMap", "nats-config")["data"]["nats.conf"]
    assert conf.count("password: $NATS_PASSWORD") == 2, "clients and routes both log in"


def test_stream_replicas_match_the_nats_servers() -> None:
    replicas = named("ConfigMap", "fleet-config")["data"]["FLEET_STREAM_REPLICAS"]
    assert int(replicas) == named("StatefulSet", "nats")["spec"]["replicas"]


def chart_key_paths(values: dict, prefix: str = "") -> set[str]:
    paths = set()
    for key, value in values.items():
        path = f"{prefix}{key}"
        paths.add(path)
        if isinstance(value, dict) and key not in NATS_CHART_FREE_FORM:
            paths |= chart_key_paths(value, f"{path}.")
    return paths


def test_the_nats_helm_values_use_keys_of_the_official_chart() -> None:
    values = yaml.safe_load((K8S_DIR / "helm" / "nats-values.yaml").read_text())
    unknown = chart_key_paths(values) - NATS_CHART_KEYS
    assert not unknown, f"not in the nats chart's values.yaml: {sorted(unknown)}"
    cluster = values["config"]["cluster"]
    assert cluster["enabled"] is True
    assert cluster["replicas"] == named("StatefulSet", "nats")["spec"]["replicas"]
    assert values["config"]["jetstream"]["enabled"] is True
    assert values["config"]["jetstream"]["fileStore"]["pvc"]["enabled"] is True
    # The chart renders `<< $NAME >>` as a bare NATS variable; the routes come from container.env.
    assert len(cluster["merge"]["routes"]) == cluster["replicas"]
    for route in cluster["merge"]["routes"]:
        assert values["container"]["env"][re.fullmatch(r"<< \$(\w+) >>", route)[1]]


def test_every_fleet_image_is_one_docker_compose_builds() -> None:
    """The manifests pull what `docker compose build && docker compose push` tags."""
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    built = {s["image"].split("/", 1)[1].split(":")[0] for s in services.values() if "build" in s}
    assert {image.removeprefix("fleet/") for image in FLEET_IMAGES} <= built
