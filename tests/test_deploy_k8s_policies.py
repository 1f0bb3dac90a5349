"""The rendered Kubernetes overlays (tests/test_k8s.py renders them) scale, survive drains, let only the
right pods in, and watch what exists.

- Autoscalers: one per Deployment at most (HPA or KEDA ScaledObject), on a Deployment of the render
  that leaves `replicas` to it; KEDA triggers of known types whose queries, stream and consumer are
  Fleet's own; the HPA alternative's metric is prometheus-adapter's rule's.
- Disruption budgets: every worker and every replicated server has one, and each selects pods.
- Network policies, evaluated as Kubernetes does (a pod selected by an Ingress policy takes only what
  some rule allows): who reaches each Service port, and the workers' and exporters' pod ports, is
  exactly the table NEEDED; NATS routes only NATS -> NATS.
- Monitoring: monitors select what exists by declared port names, and every metric an alert, a KEDA
  query or the Grafana dashboard names is exported by the metrics-collector (fleet_metrics.registry)
  or is one of the few upstream series listed in UPSTREAM_METRICS.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from fleet_downloader.main import CONSUMER as DOWNLOADER_CONSUMER
from fleet_metrics.registry import FleetMetrics, node_families
from fleet_proto.subjects import CMD_STREAM
from tests.test_k8s import K8S_DIR, RENDERS, WORKERS, generated, named, of_kind, pod_spec, rendered

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy/grafana/fleet.json"
ADAPTER = K8S_DIR / "extras/prometheus-adapter.yaml"

# Series the manifests name that Fleet does not export: Prometheus' own, prometheus-nats-exporter's
# (-healthz) and kube-state-metrics'.
UPSTREAM_METRICS = {"up", "gnatsd_healthz_status", "kube_pod_status_phase"}
# KEDA's scalers used here, with the metadata each one requires (keda.sh/docs/latest/scalers/).
KEDA_TRIGGERS = {
    "prometheus": {"serverAddress", "query", "threshold"},
    "nats-jetstream": {"natsServerMonitoringEndpoint", "account", "stream", "consumer", "lagThreshold"},
}

FLEET_SERVICES = {"gateway", "scheduler", "downloader", "metrics-collector"}
EVERY_FLEET_POD = FLEET_SERVICES | set(WORKERS)
# Who connects from outside the namespace: Prometheus (namespace monitoring), KEDA's operator
# (namespace keda), and anyone else (a client, an Ingress controller).
OUTSIDE = {
    "prometheus": ("monitoring", {"app.kubernetes.io/name": "prometheus"}),
    "keda": ("keda", {"app": "keda-operator"}),
    "outsider": ("default", {"app": "curl"}),
}
# (Service or pod, port name) -> the clients that need it; the policies must allow exactly these.
NEEDED = {
    ("nats", "client"): EVERY_FLEET_POD,
    ("nats-headless", "client"): EVERY_FLEET_POD,
    ("nats-headless", "cluster"): {"nats"},
    ("nats-headless", "monitor"): {"keda"},
    ("s3", "s3"): {"gateway", "downloader", *WORKERS},
    ("redis", "redis"): {"gateway", "scheduler", "metrics-collector", *WORKERS},
    ("gateway", "http"): EVERY_FLEET_POD | {"nats", "redis", "seaweedfs", *OUTSIDE},
    ("metrics-collector", "metrics"): {"prometheus"},
    # Pod ports that no Service fronts.
    ("pod:engine-worker-mlx-cpu", "handoff"): set(WORKERS),
    ("pod:engine-worker-vllm-cuda", "handoff"): set(WORKERS),
    ("pod:engine-worker-vllm-cuda", 52400): set(WORKERS),  # the pipeline ring's first port
    ("pod:engine-worker-mlx-cpu", 52463): set(WORKERS),  # and its last
    ("pod:nats", "metrics"): {"prometheus"},
}
POLICY_RENDER = "observability"  # every server, both workers, KEDA and the monitoring


def fleet_metric_names() -> set[str]:
    """Every series name the metrics-collector can export, suffixes included."""
    names = set()
    families = [*FleetMetrics().registry.collect(), *node_families([])]
    for family in families:
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
        names |= {family.name + suffix for suffix in suffixes}
    return names


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless"}
PROMQL_WORDS |= {"offset", "bool", "le", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads (not its functions, keywords or label names)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for match in re.finditer(r"(?<![\w.])[a-zA-Z_:][\w:]*", expr):
        rest = expr[match.end() :].lstrip()
        if not rest.startswith("(") and match[0].lower() not in PROMQL_WORDS:
            names.add(match[0])
    return names


def test_metric_names_reads_promql_as_intended() -> None:
    expr = 'sum by (le) (rate(fleet_x_bucket{node=~"a.+"}[5m])) > 1e3 and on (pod) up or vector(0)'
    assert metric_names(expr) == {"fleet_x_bucket", "up"}


@pytest.mark.parametrize("name", RENDERS)
def test_one_autoscaler_per_deployment_and_it_owns_the_count(name: str) -> None:
    docs = rendered(name)
    deployments = {d["metadata"]["name"]: d for d in of_kind(docs, "Deployment")}
    scalers = [*of_kind(docs, "HorizontalPodAutoscaler"), *of_kind(docs, "ScaledObject")]
    targets = [s["spec"]["scaleTargetRef"]["name"] for s in scalers]
    assert len(targets) == len(set(targets)), f"two autoscalers on one Deployment: {sorted(targets)}"
    assert "gateway" in targets
    for scaler in scalers:
        ref = scaler["spec"]["scaleTargetRef"]
        assert (ref.get("apiVersion", "apps/v1"), ref.get("kind", "Deployment")) == ("apps/v1", "Deployment")
        deployment = deployments[ref["name"]]
        # The autoscaler owns the count; a `replicas` here would reset it on every apply.
        assert "replicas" not in deployment["spec"], ref["name"]
        spec = scaler["spec"]
        low, high = (
            spec.get("minReplicas", spec.get("minReplicaCount")),
            spec.get("maxReplicas", spec.get("maxReplicaCount")),
        )
        assert 1 <= low < high, scaler["metadata"]["name"]
        for metric in spec.get("metrics", []):
            if metric["type"] == "Resource":  # utilization is relative to the requests
                for container in pod_spec(deployment)["containers"]:
                    assert metric["resource"]["name"] in container["resources"]["requests"]
    assert named(docs, "HorizontalPodAutoscaler", "gateway")["spec"]["minReplicas"] >= 2


def test_keda_scales_the_gpu_workers_and_the_downloader_in_the_gpu_overlay() -> None:
    docs = rendered("gpu")
    kinds = {
        s["spec"]["scaleTargetRef"]["name"]: s["kind"]
        for s in [*of_kind(docs, "HorizontalPodAutoscaler"), *of_kind(docs, "ScaledObject")]
    }
    assert kinds == {
        "gateway": "HorizontalPodAutoscaler",
        "engine-worker-mlx-cpu": "HorizontalPodAutoscaler",
        "engine-worker-vllm-cuda": "ScaledObject",
        "downloader": "ScaledObject",
    }
    # Without KEDA (cpu overlay) the downloader runs one pod of its own.
    assert named(rendered("cpu"), "Deployment", "downloader")["spec"]["replicas"] == 1


def test_keda_triggers_are_known_and_read_fleets_own_series_and_queue() -> None:
    docs = rendered("gpu")
    exported = fleet_metric_names()
    for scaled in of_kind(docs, "ScaledObject"):
        for trigger in scaled["spec"]["triggers"]:
            metadata = trigger["metadata"]
            assert KEDA_TRIGGERS[trigger["type"]] <= set(metadata), trigger
            if trigger["type"] == "prometheus":
                assert metric_names(metadata["query"]) <= exported, metadata["query"]
                assert float(metadata["threshold"]) > 0
            else:
                assert (metadata["stream"], metadata["consumer"]) == (CMD_STREAM.name, DOWNLOADER_CONSUMER)
                host, _, port = metadata["natsServerMonitoringEndpoint"].partition(":")
                headless = named(docs, "Service", host.split(".")[0])
                assert host.split(".")[1] == headless["metadata"]["namespace"]
                assert headless["spec"]["clusterIP"] == "None"
                assert int(port) in [p["port"] for p in headless["spec"]["ports"] if p["name"] == "monitor"]
                # KEDA asks the consumer's leader at <server name>.<endpoint>: servers are named by pod.
                assert "server_name: $POD_NAME" in generated(docs, "nats-config")["data"]["nats.conf"]


def test_the_hpa_alternative_reads_the_adapters_metric() -> None:
    (adapter,) = yaml.safe_load_all(ADAPTER.read_text())
    (rule,) = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    assert rule["resources"]["overrides"]["node"] == {"resource": "pod"}
    assert rule["name"]["as"] in fleet_metric_names()
    hpa = named(rendered("all"), "HorizontalPodAutoscaler", "engine-worker-vllm-cuda")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    assert not of_kind(rendered("all"), "ScaledObject")  # gpu-hpa took KEDA's place


@pytest.mark.parametrize("name", RENDERS)
def test_workers_and_replicated_servers_have_disruption_budgets(name: str) -> None:
    docs = rendered(name)
    budgets = of_kind(docs, "PodDisruptionBudget")
    templates = [w["spec"]["template"] for w in [*of_kind(docs, "Deployment"), *of_kind(docs, "StatefulSet")]]
    for pdb in budgets:
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert any(labels_match(selector, t["metadata"]["labels"]) for t in templates), pdb["metadata"][
            "name"
        ]

    def budget_of(workload: dict) -> list[dict]:
        labels = workload["spec"]["template"]["metadata"]["labels"]
        return [p for p in budgets if labels_match(p["spec"]["selector"]["matchLabels"], labels)]

    for worker in WORKERS:
        if any(d["metadata"]["name"] == worker for d in of_kind(docs, "Deployment")):
            (pdb,) = budget_of(named(docs, "Deployment", worker))
            assert pdb["spec"]["maxUnavailable"] == 1
    for workload in [*of_kind(docs, "Deployment"), *of_kind(docs, "StatefulSet")]:
        if workload["spec"].get("replicas", 1) > 1 or workload["metadata"]["name"] == "gateway":
            assert budget_of(workload), workload["metadata"]["name"]
    (scheduler,) = budget_of(named(docs, "Deployment", "scheduler"))
    assert scheduler["spec"]["minAvailable"] == 1


def labels_match(selector: dict, labels: dict) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels and matchExpressions) against labels."""
    if not labels_match(selector.get("matchLabels", {}), labels):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[operator]
        if not ok:
            return False
    return True


def clients(docs: tuple[dict, ...]) -> dict[str, tuple[str, dict]]:
    """Each client by name: (its namespace, its pod labels)."""
    found = {
        w["metadata"]["name"]: ("fleet", w["spec"]["template"]["metadata"]["labels"])
        for w in [*of_kind(docs, "Deployment"), *of_kind(docs, "StatefulSet")]
    }
    return found | OUTSIDE


def allowed(docs: tuple[dict, ...], client: tuple[str, dict], target: dict, port: int) -> bool:
    """Whether `client` (namespace, labels) may open `port` on pods of the template `target`."""
    namespace, labels = client
    target_labels = target["metadata"]["labels"]
    named_ports = {
        p["name"]: p["containerPort"] for c in target["spec"]["containers"] for p in c.get("ports", [])
    }
    policies = [
        p for p in of_kind(docs, "NetworkPolicy")
        if selects(p["spec"]["podSelector"], target_labels) and "Ingress" in p["spec"]["policyTypes"]
    ]  # fmt: skip
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports") or [{}]
            in_ports = any(
                "port" not in p
                or named_ports.get(p["port"], p["port"])
                <= port
                <= p.get("endPort", named_ports.get(p["port"], p["port"]))
                for p in ports
            )
            peers = rule.get("from")
            from_peer = peers is None or any(
                (selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": namespace})
                 if "namespaceSelector" in peer else namespace == policy["metadata"]["namespace"])
                and ("podSelector" not in peer or selects(peer["podSelector"], labels))
                for peer in peers
            )  # fmt: skip
            if in_ports and from_peer:
                return True
    return False


def targets(docs: tuple[dict, ...], where: str, port: str | int) -> list[tuple[dict, int]]:
    """The pod templates behind a Service port (or `pod:<workload>`'s port) and the port they open."""
    templates = [w["spec"]["template"] for w in [*of_kind(docs, "Deployment"), *of_kind(docs, "StatefulSet")]]
    if where.startswith("pod:"):
        workload = next(
            w
            for w in [*of_kind(docs, "Deployment"), *of_kind(docs, "StatefulSet")]
            if w["metadata"]["name"] == where[4:]
        )
        chosen, wanted = [workload["spec"]["template"]], port
    else:
        service = named(docs, "Service", where)
        (service_port,) = [p for p in service["spec"]["ports"] if p["name"] == port]
        chosen = [t for t in templates if labels_match(service["spec"]["selector"], t["metadata"]["labels"])]
        wanted = service_port.get("targetPort", service_port["port"])
    found = []
    for template in chosen:
        ports = {
            p.get("name"): p["containerPort"]
            for c in template["spec"]["containers"]
            for p in c.get("ports", [])
        }
        found.append((template, ports.get(wanted, wanted) if isinstance(wanted, str) else wanted))
    assert found and all(isinstance(number, int) for _, number in found), (where, port)
    return found


def test_every_service_port_in_the_table_and_the_table_covers_every_service_port() -> None:
    docs = rendered(POLICY_RENDER)
    service_ports = {
        (s["metadata"]["name"], p["name"]) for s in of_kind(docs, "Service") for p in s["spec"]["ports"]
    }
    assert service_ports == {key for key in NEEDED if not key[0].startswith("pod:")}


@pytest.mark.parametrize(("where", "port"), list(NEEDED), ids=[f"{w}:{p}" for w, p in NEEDED])
def test_the_network_policies_let_in_exactly_who_needs_each_port(where: str, port: str | int) -> None:
    docs = rendered(POLICY_RENDER)
    everyone = clients(docs)
    for template, number in targets(docs, where, port):
        let_in = {name for name, client in everyone.items() if allowed(docs, client, template, number)}
        assert let_in == NEEDED[(where, port)], f"{where}:{port} -> {number}"


def test_nats_routes_are_only_between_nats_servers_and_the_rest_is_denied() -> None:
    docs = rendered(POLICY_RENDER)
    (deny,) = [p for p in of_kind(docs, "NetworkPolicy") if p["spec"]["podSelector"] == {}]
    assert deny["spec"]["policyTypes"] == ["Ingress"] and "ingress" not in deny["spec"]
    nats = named(docs, "StatefulSet", "nats")["spec"]["template"]
    everyone = clients(docs)
    assert {name for name, c in everyone.items() if allowed(docs, c, nats, 6222)} == {"nats"}
    # SeaweedFS's master, volume server and filer ports stay inside its pod.
    seaweedfs = named(docs, "StatefulSet", "seaweedfs")["spec"]["template"]
    for port in (9333, 8080, 8888):
        assert not {name for name, c in everyone.items() if allowed(docs, c, seaweedfs, port)}


def test_the_monitors_select_what_exists_by_declared_ports() -> None:
    docs = rendered("observability")
    for monitor in of_kind(docs, "ServiceMonitor"):
        (service,) = [
            s
            for s in of_kind(docs, "Service")
            if labels_match(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        port_names = {p["name"] for p in service["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= port_names
        # The collector's own `node` and `instance` labels survive the scrape.
        assert all(e["honorLabels"] for e in monitor["spec"]["endpoints"])
    for monitor in of_kind(docs, "PodMonitor"):
        pods = [
            w
            for w in of_kind(docs, "StatefulSet")
            if labels_match(
                monitor["spec"]["selector"]["matchLabels"], w["spec"]["template"]["metadata"]["labels"]
            )
        ]
        assert pods
        for workload in pods:
            port_names = {p["name"] for c in pod_spec(workload)["containers"] for p in c.get("ports", [])}
            assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= port_names


def test_every_alert_names_series_that_exist_and_jobs_the_monitors_make() -> None:
    docs = rendered("observability")
    known = fleet_metric_names() | UPSTREAM_METRICS
    jobs = set()
    for monitor in [*of_kind(docs, "ServiceMonitor"), *of_kind(docs, "PodMonitor")]:
        assert monitor["spec"]["jobLabel"] == "app.kubernetes.io/name"
        jobs.add(monitor["metadata"]["labels"]["app.kubernetes.io/name"])
    (rule,) = of_kind(docs, "PrometheusRule")
    alerts = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    assert {
        "FleetNodeLost",
        "FleetRequestsWaiting",
        "FleetQueuedTokensGrowing",
        "FleetJetStreamUnhealthy",
    } <= {r["alert"] for r in alerts}
    for alert in alerts:
        assert metric_names(alert["expr"]) <= known, alert["alert"]
        assert set(re.findall(r'job="([^"]+)"', alert["expr"])) <= jobs, alert["alert"]
        assert {"summary", "description"} <= set(alert["annotations"]) and alert["labels"]["severity"]


def test_the_grafana_dashboard_plots_series_that_exist() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = set().union(*(metric_names(e) for e in exprs))
    assert used <= fleet_metric_names(), used - fleet_metric_names()
    wanted = {
        "fleet_request_ttft_seconds_bucket",
        "fleet_tokens_generated_total",
        "fleet_gpu_utilization_ratio",
    }
    wanted |= {
        "fleet_admission_waiting_requests",
        "fleet_instance_queued_tokens",
        "fleet_instance_active_requests",
    }
    assert wanted <= used
    # Shipped as a ConfigMap Grafana's sidecar picks up, the same file as compose mounts.
    config_map = named(rendered("observability"), "ConfigMap", "fleet-grafana-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["fleet.json"]) == dashboard
