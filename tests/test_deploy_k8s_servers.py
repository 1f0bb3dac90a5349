"""The servers of the rendered Kubernetes overlays (tests/test_k8s.py renders them): NATS's cluster
routes and credentials, the tls component's certificates reaching NATS and every Fleet pod, the
external-s3 component replacing SeaweedFS, and the NATS Helm values using keys of the official chart.
"""

from __future__ import annotations

import os
import re

import yaml

from tests.test_k8s import (
    K8S_DIR,
    container_port,
    env_values,
    fleet_config,
    fleet_containers,
    generated,
    named,
    pod_spec,
    rendered,
)

# Key paths of the official NATS chart's values.yaml (github.com/nats-io/k8s, helm/charts/nats), read
# at tag nats-1.2.6 and unchanged at chart 2.14.2: the ones helm/nats-values.yaml may use. Below the
# free-form keys (merge, env, topologySpreadConstraints) the chart takes anything.
NATS_CHART_KEYS = {
    *("config", "config.cluster", "config.cluster.enabled", "config.cluster.port"),
    *("config.cluster.replicas", "config.cluster.routeURLs", "config.cluster.merge", "config.jetstream"),
    *("config.jetstream.enabled", "config.jetstream.fileStore", "config.jetstream.fileStore.enabled"),
    *("config.jetstream.fileStore.dir", "config.jetstream.fileStore.pvc"),
    *("config.jetstream.fileStore.pvc.enabled", "config.jetstream.fileStore.pvc.size"),
    *("config.jetstream.fileStore.pvc.storageClassName", "config.jetstream.fileStore.maxSize"),
    *("config.jetstream.memoryStore", "config.monitor", "config.merge", "container", "container.image"),
    *("container.env", "container.merge", "podTemplate", "podTemplate.topologySpreadConstraints"),
    *("podTemplate.merge", "podDisruptionBudget", "podDisruptionBudget.enabled", "natsBox"),
    "natsBox.enabled",
}
NATS_CHART_FREE_FORM = {"merge", "env", "topologySpreadConstraints"}


def nats_container(docs: tuple[dict, ...]) -> dict:
    (container,) = [
        c for c in pod_spec(named(docs, "StatefulSet", "nats"))["containers"] if c["name"] == "nats"
    ]
    return container


def test_nats_routes_name_every_server_through_the_headless_service() -> None:
    docs = rendered("gpu")
    nats = named(docs, "StatefulSet", "nats")
    replicas = nats["spec"]["replicas"]
    assert replicas == 3 and nats["spec"]["podManagementPolicy"] == "Parallel"
    headless = named(docs, "Service", nats["spec"]["serviceName"])
    # The servers must resolve each other before any of them is ready.
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    conf = generated(docs, "nats-config")["data"]["nats.conf"]
    (routes,) = re.findall(r"^\s*routes\s*[:=]?\s*\[(.*?)\]", conf, re.MULTILINE | re.DOTALL)
    env = env_values(nats_container(docs))
    urls = [env[item.removeprefix("$")] for item in re.split(r"[\s,]+", routes) if item]
    cluster_port = container_port(nats_container(docs), "cluster")
    expected = {f"nats-{i}.{headless['metadata']['name']}:{cluster_port}" for i in range(replicas)}
    # Each route logs in (the cluster block requires it).
    assert all(url.startswith("nats://$(NATS_USER):$(NATS_PASSWORD)@") for url in urls), urls
    assert {url.rpartition("@")[2] for url in urls} == expected
    assert int(fleet_config(docs)["FLEET_STREAM_REPLICAS"]) == replicas


def test_nats_takes_its_credentials_from_the_secret_and_the_config() -> None:
    docs = rendered("gpu")
    env = {var["name"]: var for var in nats_container(docs)["env"]}
    assert env["NATS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "fleet-secrets",
        "key": "nats_password",
    }
    assert env["NATS_USER"]["valueFrom"]["configMapKeyRef"] == {
        "name": generated(docs, "fleet-config")["metadata"]["name"],
        "key": "FLEET_NATS_USER",
    }
    names = list(env)
    for route in (name for name in names if name.startswith("NATS_ROUTE_")):
        assert names.index("NATS_USER") < names.index(route) and names.index("NATS_PASSWORD") < names.index(
            route
        )
    conf = generated(docs, "nats-config")["data"]["nats.conf"]
    assert conf.count("password: $NATS_PASSWORD") == 2, "clients and routes both log in"


def test_the_tls_overlay_gives_nats_its_certificate_and_every_fleet_pod_the_ca() -> None:
    docs = rendered("tls")
    config = fleet_config(docs)
    assert config["FLEET_NATS_URL"].startswith("tls://")
    ca_file = config["FLEET_NATS_TLS_CA_FILE"]
    for workload, container in fleet_containers(docs):
        volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
        mounted = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
        volume = mounted[os.path.dirname(ca_file)]["secret"]
        assert (volume["secretName"], volume["items"]) == ("nats-tls", [{"key": "ca.crt", "path": "ca.crt"}])
    nats = generated(docs, "nats-config")["data"]
    server = nats_container(docs)
    mounts = {m["mountPath"]: m["name"] for m in server["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(named(docs, "StatefulSet", "nats"))["volumes"]}
    for key in ("tls.conf", "cluster-tls.conf"):
        for path in re.findall(r"_file:\s*(\S+)", nats[key]):
            assert volumes[mounts[os.path.dirname(path)]]["secret"]["secretName"] == "nats-tls", path
        assert f"include ./{key}" in nats["nats.conf"]
    plain = generated(rendered("gpu"), "nats-config")["data"]
    assert "tls {" not in plain["tls.conf"] + plain["cluster-tls.conf"]


def test_the_external_s3_overlay_runs_no_seaweedfs_and_points_fleet_elsewhere() -> None:
    docs = rendered("external-s3")
    assert not [
        d for d in docs if d["metadata"].get("labels", {}).get("app.kubernetes.io/name") == "seaweedfs"
    ]
    s3_env = dict(
        line.split("=", 1)
        for line in (K8S_DIR / "components/external-s3/s3.env").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert {k: fleet_config(docs)[k] for k in s3_env} == s3_env
    assert fleet_config(rendered("cpu"))["FLEET_S3_ENDPOINT"] == "s3:8333"  # SeaweedFS's Service


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
    assert cluster["replicas"] == named(rendered("gpu"), "StatefulSet", "nats")["spec"]["replicas"]
    assert values["config"]["jetstream"]["enabled"] is True
    assert values["config"]["jetstream"]["fileStore"]["pvc"]["enabled"] is True
    # The chart renders `<< $NAME >>` as a bare NATS variable; the routes come from container.env.
    assert len(cluster["merge"]["routes"]) == cluster["replicas"]
    for route in cluster["merge"]["routes"]:
        assert values["container"]["env"][re.fullmatch(r"<< \$(\w+) >>", route)[1]]
