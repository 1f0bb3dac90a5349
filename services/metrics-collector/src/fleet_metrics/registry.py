"""The collector's Prometheus registry: request histograms/counters and scrape-time node gauges.

Pure: no I/O. One `FleetMetrics` per service instance, each with its own `CollectorRegistry`
(never the process-global default one), so tests and services do not share series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleet_proto import InstanceStatus, NodeMetrics, State
from fleet_proto.messages import EMBED_TASK, AdmissionSample

# The text format /metrics serves (generate_latest writes the classic 0.0.4 format).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class RequestStatsLike(Protocol):
    """The fields of fleet_proto.messages.RequestStats that the registry reads (read-only: it is frozen)."""

    @property
    def model_id(self) -> str: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...
    @property
    def ttft_s(self) -> float: ...
    @property
    def tpot_s(self) -> float: ...
    @property
    def total_s(self) -> float: ...
    @property
    def finish_reason(self) -> str: ...
    @property
    def prefix_cached_tokens(self) -> int: ...
    @property
    def task(self) -> str: ...
    @property
    def inputs(self) -> int: ...
    @property
    def migrations(self) -> int: ...
    @property
    def queued_s(self) -> float: ...


class AdmissionCollector(Collector):
    """The gateways' admission queues at scrape time, from `source()`: each live gateway's latest
    sample (waiting requests summed per model, refusals per reason)."""

    def __init__(self, source: Callable[[], Iterable[AdmissionSample]]) -> None:
        self._source = source

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        waiting = GaugeMetricFamily(
            "fleet_admission_waiting_requests",
            "Requests waiting for room (every instance of their model full), over all gateways.",
            labels=["model"],
        )
        refused = CounterMetricFamily(
            "fleet_admission_refused",
            "Requests refused by admission (queue full, key's queue full, waited too long).",
            labels=["reason"],
        )
        by_model: dict[str, int] = {}
        by_reason: dict[str, int] = {}
        for sample in self._source():
            for model, count in sample.waiting.items():
                by_model[model] = by_model.get(model, 0) + count
            for reason, count in sample.refused.items():
                by_reason[reason] = by_reason.get(reason, 0) + count
        for model, count in sorted(by_model.items()):
            waiting.add_metric([model], count)
        for reason, count in sorted(by_reason.items()):
            refused.add_metric([reason], count)
        return iter([waiting, refused])


class ScalingCollector(Collector):
    """Each model's instances by status, and the bounds of its autoscaling policy where enabled,
    from the State at scrape time (`source()`): what a dashboard plots beside demand, and what an
    alert compares (instances under the policy's minimum)."""

    def __init__(self, source: Callable[[], State | None]) -> None:
        self._source = source

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        instances = GaugeMetricFamily(
            "fleet_model_instances", "Instances of each model, by status.", labels=["model", "status"]
        )
        bounds = GaugeMetricFamily(
            "fleet_model_scaling_instances",
            "An autoscaled model's policy bounds (bound: min or max).",
            labels=["model", "bound"],
        )
        state = self._source()
        if state is None:
            return iter([instances, bounds])
        counts: dict[tuple[str, str], int] = {}
        for instance in state.instances.values():
            key = (instance.model_id, InstanceStatus(instance.status).value)
            counts[key] = counts.get(key, 0) + 1
        for (model, status), count in sorted(counts.items()):
            instances.add_metric([model, status], count)
        for model, scaling in sorted(state.scaling.items()):
            if scaling.policy.enabled:
                bounds.add_metric([model, "min"], scaling.policy.min_instances)
                bounds.add_metric([model, "max"], scaling.policy.max_instances)
        return iter([instances, bounds])


class NodeCollector(Collector):
    """Node, instance and GPU gauges built at scrape time from `source()`: the latest sample of
    every live node. A node that is no longer returned is simply not reported."""

    def __init__(self, source: Callable[[], Iterable[NodeMetrics]]) -> None:
        self._source = source

    def describe(self) -> list[Metric]:
        return []  # names are only known at scrape time; nothing to check for clashes

    def collect(self) -> Iterator[Metric]:
        return iter(node_families(self._source()))


def node_families(samples: Iterable[NodeMetrics]) -> list[Metric]:
    """The gauge families for these node samples (one series per node / instance / GPU)."""
    node = ["node"]
    mem_used = GaugeMetricFamily("fleet_node_memory_used_bytes", "Memory in use on the node.", labels=node)
    mem_avail = GaugeMetricFamily(
        "fleet_node_memory_available_bytes", "Memory available on the node.", labels=node
    )
    cpu = GaugeMetricFamily(
        "fleet_node_cpu_utilization_ratio", "CPU utilisation of the node over all cores (0..1).", labels=node
    )
    disk = GaugeMetricFamily(
        "fleet_node_disk_free_bytes", "Free disk where the node keeps model files.", labels=node
    )
    inst = ["node", "instance"]
    active = GaugeMetricFamily(
        "fleet_instance_active_requests", "Requests running in the instance now.", labels=inst
    )
    queued = GaugeMetricFamily(
        "fleet_instance_queued_tokens", "Prompt tokens waiting to be prefilled in the instance.", labels=inst
    )
    gpu = ["node", "gpu"]
    gpu_util = GaugeMetricFamily("fleet_gpu_utilization_ratio", "GPU utilisation (0..1).", labels=gpu)
    gpu_temp = GaugeMetricFamily("fleet_gpu_temperature_celsius", "GPU temperature.", labels=gpu)
    gpu_power = GaugeMetricFamily("fleet_gpu_power_watts", "GPU power draw.", labels=gpu)
    gpu_mem = GaugeMetricFamily("fleet_gpu_memory_used_bytes", "GPU memory in use.", labels=gpu)
    kv_memory = GaugeMetricFamily(
        "fleet_kv_memory_blocks", "KV blocks the node's engines hold in memory (tier 1).", labels=node
    )
    kv_counters = {
        field: CounterMetricFamily(f"fleet_kv_{field}", help_text, labels=node)
        for field, help_text in (
            ("fetched_blocks", "KV blocks fetched from object storage (tier 2)."),
            ("fetched_bytes", "Bytes of KV blocks fetched from object storage."),
            ("uploaded_blocks", "KV blocks uploaded to object storage."),
            ("uploaded_bytes", "Bytes of KV blocks uploaded to object storage."),
        )
    }

    for s in sorted(samples, key=lambda m: m.node_id):
        n = s.node_id
        mem_used.add_metric([n], s.memory_used_bytes)
        mem_avail.add_metric([n], s.memory_available_bytes)
        cpu.add_metric([n], cpu_ratio(s.cpu_percent))
        disk.add_metric([n], s.disk_free_bytes)
        kv_memory.add_metric([n], getattr(s, "kv_memory_blocks", 0))
        for field, family in kv_counters.items():
            family.add_metric([n], getattr(s, f"kv_{field}", 0))
        for instance_id, value in sorted(s.active_requests.items()):
            active.add_metric([n, instance_id], value)
        for instance_id, value in sorted(s.queued_tokens.items()):
            queued.add_metric([n, instance_id], value)
        for g in getattr(s, "gpus", ()) or ():
            labels = [n, str(_get(g, "index"))]
            for gauge, field in (
                (gpu_util, "utilization_ratio"),
                (gpu_temp, "temperature_c"),
                (gpu_power, "power_w"),
                (gpu_mem, "memory_used_bytes"),
            ):
                value = _get(g, field)
                if _known(value):
                    gauge.add_metric(labels, float(value))
    families = [mem_used, mem_avail, cpu, disk, active, queued, gpu_util, gpu_temp, gpu_power, gpu_mem]
    return [*families, kv_memory, *kv_counters.values()]


def cpu_ratio(cpu_percent: float) -> float:
    return min(max(cpu_percent / 100.0, 0.0), 1.0)


def _get(obj: Any, field: str) -> Any:
    return obj.get(field) if isinstance(obj, dict) else getattr(obj, field, None)


def _known(value: Any) -> bool:
    """-1 (or any negative, or a missing field) means the node could not read the value."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


class FleetMetrics:
    """All metrics the collector exports, in a registry of its own."""

    def __init__(
        self,
        live_nodes: Callable[[], Iterable[NodeMetrics]] = tuple,
        live_gateways: Callable[[], Iterable[AdmissionSample]] = tuple,
        state: Callable[[], State | None] = lambda: None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.ttft = Histogram(
            "fleet_request_ttft_seconds",
            "Time to first token.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "fleet_request_tpot_seconds",
            "Time per output token after the first.",
            ["model"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "fleet_request_duration_seconds", "End-to-end request time.", buckets=DURATION_BUCKETS, registry=r
        )
        # prometheus_client appends `_total` to counter names itself
        self.generated = Counter(
            "fleet_tokens_generated", "Completion tokens generated.", ["model"], registry=r
        )
        self.prompt = Counter("fleet_prompt_tokens", "Prompt tokens processed.", ["model"], registry=r)
        self.requests = Counter(
            "fleet_requests", "Requests finished, by finish reason.", ["model", "finish_reason"], registry=r
        )
        self.migrations = Counter(
            "fleet_request_migrations",
            "Times a request moved to another instance because its worker died or drained.",
            ["model"],
            registry=r,
        )
        self.admission_wait = Histogram(
            "fleet_admission_wait_seconds",
            "Time a request waited for room because every instance of its model was full (0: none).",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.prefix_hit = Gauge(
            "fleet_prefix_cache_hit_ratio",
            "Prompt tokens served from the prefix cache / all prompt tokens, over all requests.",
            registry=r,
        )
        # embedding requests (RequestStats.task "embed") have their own series: no tokens generated
        self.embedding_requests = Counter(
            "fleet_embedding_requests", "Embedding requests finished, by finish reason.",
            ["model", "finish_reason"], registry=r,
        )  # fmt: skip
        self.embedding_inputs = Counter("fleet_embedding_inputs", "Inputs embedded.", ["model"], registry=r)
        self.embedding_tokens = Counter(
            "fleet_embedding_tokens", "Input tokens embedded.", ["model"], registry=r
        )
        self.embedding_duration = Histogram(
            "fleet_embedding_duration_seconds", "Embedding request time, routing included.", ["model"],
            buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self._prompt_tokens = 0
        self._cached_tokens = 0
        r.register(NodeCollector(live_nodes))
        r.register(AdmissionCollector(live_gateways))
        r.register(ScalingCollector(state))

    def observe_request(self, stats: RequestStatsLike) -> None:
        if stats.task == EMBED_TASK:
            self.observe_embedding(stats)
            return
        model = stats.model_id
        self.requests.labels(model, stats.finish_reason or "unknown").inc()
        if stats.migrations > 0:
            self.migrations.labels(model).inc(stats.migrations)
        self.admission_wait.labels(model).observe(max(stats.queued_s, 0.0))
        self.duration.observe(max(stats.total_s, 0.0))
        if stats.prompt_tokens > 0:
            self.prompt.labels(model).inc(stats.prompt_tokens)
        if stats.completion_tokens > 0:
            self.generated.labels(model).inc(stats.completion_tokens)
            if stats.ttft_s >= 0:  # no first token: no TTFT to observe
                self.ttft.labels(model).observe(stats.ttft_s)
        if stats.completion_tokens > 1 and stats.tpot_s >= 0:  # TPOT needs a second token
            self.tpot.labels(model).observe(stats.tpot_s)
        self._prompt_tokens += max(stats.prompt_tokens, 0)
        self._cached_tokens += min(max(stats.prefix_cached_tokens, 0), max(stats.prompt_tokens, 0))
        self.prefix_hit.set(prefix_hit_ratio(self._cached_tokens, self._prompt_tokens))

    def observe_embedding(self, stats: RequestStatsLike) -> None:
        model = stats.model_id
        self.embedding_requests.labels(model, stats.finish_reason or "unknown").inc()
        self.embedding_duration.labels(model).observe(max(stats.total_s, 0.0))
        self.embedding_inputs.labels(model).inc(max(stats.inputs, 0))
        self.embedding_tokens.labels(model).inc(max(stats.prompt_tokens, 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def prefix_hit_ratio(cached_tokens: int, prompt_tokens: int) -> float:
    return cached_tokens / prompt_tokens if prompt_tokens > 0 else 0.0
